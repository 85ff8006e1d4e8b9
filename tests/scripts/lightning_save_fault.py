"""examples/lightning/train.py, unchanged (run with runpy), whose rank 1 is SIGKILLed inside
Lightning's own checkpoint save in its first life: the first save at `global_step` >= N
(`--kill-in-save N`, before the example's own flags), after the checkpoint is dumped and
before the strategy writes it and meets the save's barrier. A replacement (UNBROKEN_JOIN=1,
`WorkerEnv.joining`) saves as usual.

    unbroken run ... tests/scripts/lightning_save_fault.py --kill-in-save 10 --checkpoint-every 5 ...
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from lightning.pytorch.strategies.strategy import Strategy

from unbroken.control.worker_env import WorkerEnv

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning" / "train.py"

assert sys.argv[1] == "--kill-in-save", sys.argv
AT = int(sys.argv[2])
sys.argv = [str(EXAMPLE), *sys.argv[3:]]

_save = Strategy.save_checkpoint


def save_checkpoint(self, checkpoint, filepath, storage_options=None):  # noqa: ANN001, ANN201
    if self.global_rank == 1 and checkpoint["global_step"] >= AT:
        print(f"rank 1 killed inside the checkpoint save at step {checkpoint['global_step']}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(self, checkpoint, filepath, storage_options)


if not WorkerEnv.from_environ().joining:
    Strategy.save_checkpoint = save_checkpoint
runpy.run_path(str(EXAMPLE), run_name="__main__")
