"""The Trainer example (examples/hf_trainer/train.py), unchanged (run with runpy), protected
by a run of the script's own with numerical checks on: `unbroken.init(anomalies=...)`,
handed to `protect(trainer, run)` as the Trainer is built (the automatic integration then
leaves it as it is).

    unbroken run --nproc-per-node 2 --fault nan:rank=1,step=4,persistent=1 \
        tests/scripts/hf_anomalies.py --output-dir out ...

`--skip-steps S[,S...]` (read here; every other argument goes to the example): the run
passes over these steps (`run.skip_steps`), as a reference for a job that skipped them.
"""

import runpy
import sys
from pathlib import Path

from transformers import Trainer

import unbroken
from unbroken.integrations.hf import protect

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"

SKIP: list[int] = []
if "--skip-steps" in sys.argv:
    at = sys.argv.index("--skip-steps")
    SKIP = [int(s) for s in sys.argv[at + 1].split(",")]
    del sys.argv[at:at + 2]

built = Trainer.__init__


def checked(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    built(self, *args, **kwargs)
    run = unbroken.init(anomalies=unbroken.AnomalyConfig(
        numerics=unbroken.NumericsConfig(enabled=True)))
    if SKIP:
        run.skip_steps(SKIP)
    protect(self, run)


Trainer.__init__ = checked
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
