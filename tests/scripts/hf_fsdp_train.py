"""The Trainer example (examples/hf_trainer/train.py), unchanged, under the Trainer's own FSDP2
path on CPU and gloo: Accelerate's FSDP plugin from the environment, as `accelerate launch
--use_fsdp --fsdp_version 2` sets it, and one shim.

The shim: Accelerate 1.16 (`AcceleratorState.__init__`) turns its FSDP plugin on only for
the accelerator back-ends (`MULTI_GPU`, `MULTI_NPU`, ...), never `MULTI_CPU`; on CPU the
Trainer given FSDP would train plain DDP. After that `__init__`, the shim sets the
distributed type to `FSDP` and keeps the plugin, as that branch does for an accelerator (no
mixed precision here: the job trains in fp32). Nothing else is changed: the Trainer, its
`accelerator.prepare` (Accelerate's `fsdp2_prepare_model`, torch's `fully_shard` on a
default cpu mesh), the process group, unbroken's integration and the fault are as they come.

    unbroken run --nproc-per-node 2 --on-fault wait tests/scripts/hf_fsdp_train.py --output-dir out

`--shards PATH` (read here, the rest goes to the example): after training, each rank saves
its local shards of the parameters to PATH.<rank> (the example's `--final` would save rank
0's DTensors, not the full parameters), so that runs compare shard by shard.
"""

import os
import runpy
import sys
from pathlib import Path

os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")

from accelerate.state import AcceleratorState, DistributedType, PartialState  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer" / "train.py"
building = AcceleratorState.__init__


def build_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):  # noqa: ANN001, ANN002, ANN003
    building(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


shards = None
if "--shards" in sys.argv:
    at = sys.argv.index("--shards")
    shards = sys.argv[at + 1]
    del sys.argv[at:at + 2]
AcceleratorState.__init__ = build_with_fsdp_on_cpu
sys.argv[0] = str(EXAMPLE)
trainer = runpy.run_path(str(EXAMPLE), run_name="__main__")["trainer"]
if shards:
    import torch

    torch.save({name: getattr(p, "to_local", lambda p=p: p)().detach().clone()
                for name, p in trainer.model.named_parameters()},
               f"{shards}.{trainer.args.process_index}")
