"""The Trainer example (examples/hf_trainer/train.py), unchanged, with one fault added: rank 1
SIGKILLs itself inside the Trainer's own checkpoint save at a given step (after the model
file, as it would save the optimizer and scheduler), in its first life only (a replacement,
`UNBROKEN_JOIN=1`, saves normally).

    unbroken run --nproc-per-node 2 --on-fault wait tests/scripts/hf_save_fault.py \
        --kill-in-save 10 --output-dir out ...

`--kill-in-save STEP` is read here; every other argument goes to the example.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from transformers import Trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"

at = sys.argv.index("--kill-in-save")
STEP = int(sys.argv[at + 1])
del sys.argv[at:at + 2]
FIRST_LIFE = os.environ.get("UNBROKEN_JOIN") != "1"
saving = Trainer._save_optimizer_and_scheduler


def save_or_die(self, output_dir):  # noqa: ANN001, ANN201
    if FIRST_LIFE and self.args.process_index == 1 and self.state.global_step == STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    return saving(self, output_dir)


Trainer._save_optimizer_and_scheduler = save_or_die
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
