"""examples/lightning/train.py, unchanged (run with runpy), on `UnbrokenDDPStrategy` given a
run of the script's own with numerical checks on: `unbroken.init(anomalies=...)`, made as
the Trainer builds its strategy (the strategy name `unbroken_checked`, registered here and
passed to the example's `--strategy`).

    unbroken run --nproc-per-node 2 --fault nan:rank=1,step=3,persistent=1 \
        tests/scripts/lightning_anomalies.py --steps 8 --accum 2 ...

`--skip-steps S[,S...]` (read here; every other argument goes to the example): the run
passes over these steps (`run.skip_steps`), as a reference for a job that skipped them.
"""

import runpy
import sys
from pathlib import Path

from lightning.pytorch.strategies import StrategyRegistry

import unbroken
from unbroken.integrations.lightning import UnbrokenDDPStrategy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning" / "train.py"

SKIP: list[int] = []
if "--skip-steps" in sys.argv:
    at = sys.argv.index("--skip-steps")
    SKIP = [int(s) for s in sys.argv[at + 1].split(",")]
    del sys.argv[at:at + 2]


def checked(**kwargs):  # noqa: ANN003, ANN201
    run = unbroken.init(anomalies=unbroken.AnomalyConfig(
        numerics=unbroken.NumericsConfig(enabled=True)))
    if SKIP:
        run.skip_steps(SKIP)
    return UnbrokenDDPStrategy(run=run, **kwargs)


StrategyRegistry.register("unbroken_checked", checked, description="unbroken_ddp, checked",
                          override=True, start_method="popen")
sys.argv = [str(EXAMPLE), *sys.argv[1:], "--strategy", "unbroken_checked"]
runpy.run_path(str(EXAMPLE), run_name="__main__")
