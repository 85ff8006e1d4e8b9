"""An unchanged torchrun-style DDP script that checkpoints itself, as users write them:
`torch.save` to a temporary file then `os.replace` on rank 0 every `--every` steps (or a
DCP save on every rank with `--dcp`), resumes from its own checkpoint, and (attempt 0 only)
SIGKILLs rank 1 at `--kill-at`. It knows nothing of unbroken; it measures itself, for the
test to compare with the report: OUT/measured-A-R.json, per attempt A and rank R, holds
the seconds inside each save and load and each step's [step, start, end].

    plain_saver.py OUT CKPT --steps N --every K --kill-at S [--dcp] [--megabytes M]
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("ckpt")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--every", type=int, default=10)
p.add_argument("--kill-at", type=int, default=27)
p.add_argument("--dcp", action="store_true")
p.add_argument("--megabytes", type=int, default=64)
p.add_argument("--step-s", type=float, default=0.05)
a = p.parse_args()

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
ballast = torch.zeros(a.megabytes * (1 << 18))  # what makes a real checkpoint take time
measured = {"saves": [], "loads": [], "steps": []}
start = 0
if a.dcp:
    import torch.distributed.checkpoint as dcp

    if os.path.exists(os.path.join(a.ckpt, ".metadata")):
        state = {"model": model.state_dict(), "ballast": ballast, "step": torch.tensor(0)}
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=a.ckpt)
        measured["loads"].append(time.perf_counter() - t0)
        model.load_state_dict(state["model"])
        start = int(state["step"])
else:
    path = os.path.join(a.ckpt, "latest.pt")
    if os.path.exists(path):
        t0 = time.perf_counter()
        state = torch.load(path, weights_only=True)
        measured["loads"].append(time.perf_counter() - t0)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]


def save(step: int) -> None:
    if a.dcp:
        state = {"model": model.state_dict(), "ballast": ballast, "step": torch.tensor(step)}
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=a.ckpt)
        measured["saves"].append(time.perf_counter() - t0)
    elif rank == 0:
        os.makedirs(a.ckpt, exist_ok=True)
        tmp = os.path.join(a.ckpt, "latest.pt.tmp")
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "ballast": ballast, "step": step}
        t0 = time.perf_counter()
        torch.save(state, tmp)
        measured["saves"].append(time.perf_counter() - t0)
        os.replace(tmp, os.path.join(a.ckpt, "latest.pt"))


def dump() -> None:  # whole or not at all: the agent may stop this rank at any moment
    path = os.path.join(a.out, f"measured-{attempt}-{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(measured, fh)
    os.replace(path + ".tmp", path)


for step in range(start, a.steps):
    t0 = time.time()
    x = torch.randn(8, 16)
    loss = ddp(x).pow(2).mean()
    time.sleep(a.step_s)  # the step's compute, on a real job
    loss.backward()
    opt.step()
    opt.zero_grad()
    measured["steps"].append([step, t0, time.time()])
    dump()
    if attempt == 0 and rank == 1 and step == a.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if (step + 1) % a.every == 0:
        save(step + 1)
dump()
dist.destroy_process_group()
