"""An unmodified torchrun-style script: env:// init, one all-reduce, prints its environment."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"]
record = {k: os.environ.get(k) for k in keys}
record["sum"] = t.item()
record["argv"] = sys.argv[1:]
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as fh:
    json.dump(record, fh)
dist.destroy_process_group()
