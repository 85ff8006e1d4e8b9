"""The sharded benchmark's worker: an MLP of `--layers` square layers under FSDP2 over
every rank, AdamW, `run.train`, a checkpoint every `--checkpoint-every` steps.

With the defaults (4 layers of 2048) the model and optimizer state is 201 MB in total:
16.8 M float32 parameters and AdamW's two moments. `--step-sleep` stands in for
accelerator time, so that a spare can warm up on idle CPU as it would on a GPU host.
"""

import argparse
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--width", type=int, default=2048)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--snapshot-every", type=int, default=None)
p.add_argument("--checkpoint-dir", default=None)
p.add_argument("--checkpoint-every", type=int, default=20)
args = p.parse_args()

torch.set_num_threads(1)
run = unbroken.init(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    snapshot_every=args.snapshot_every)
mesh = init_device_mesh("cpu", (run.world_size,))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                              for _ in range(args.layers)])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
run.track(model, optimizer)


def step_fn(step, net):
    g = torch.Generator().manual_seed(step * 100 + run.rank)
    net(torch.randn(8, args.width, generator=g)).pow(2).mean().backward()
    if args.step_sleep:
        time.sleep(args.step_sleep)


run.train(step_fn, steps=args.steps)
run.close()
