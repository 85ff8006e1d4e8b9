"""A sharded worker for in-place recovery tests: a two-layer model under FSDP2 (`--hsdp`:
HSDP, 2 replica groups of world/2 shards), AdamW, `run.train`.

`--out PATH`: rank 0 writes the full parameters there at the end, to compare runs.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--hsdp", action="store_true")
p.add_argument("--width", type=int, default=16, help="hidden rows (uneven if not divisible)")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--sleep-until", default=None, metavar="PATH",
               help="sleep --step-sleep per step only until PATH exists (see ckpt_train.py)")
p.add_argument("--snapshot-every", type=int, default=None)
p.add_argument("--checkpoint-dir", default=None)
p.add_argument("--checkpoint-every", type=int, default=10)
p.add_argument("--out", default=None)
p.add_argument("--two-meshes", action="store_true",
               help="shard the layers on two distinct meshes (not recoverable in place)")
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
               help="cuda: the model on this worker's GPU, NCCL (benchmarks/gpu_multi.py)")
args = p.parse_args()

torch.set_num_threads(1)
run = unbroken.init(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    snapshot_every=args.snapshot_every)
world = run.world_size
device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else "cpu"
if args.hsdp:
    mesh = init_device_mesh(args.device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
else:
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("shard",))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, args.width), torch.nn.Tanh(),
                            torch.nn.Linear(args.width, 8)).to(device)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
    if args.two_meshes:  # a mesh of another name: equal meshes would count as one
        mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("other",))
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
run.track(model, optimizer)


def step_fn(step, net):
    g = torch.Generator().manual_seed(step * 100 + run.rank)
    net(torch.randn(4, 8, generator=g).to(device)).pow(2).mean().backward()
    if args.step_sleep and not (args.sleep_until and os.path.exists(args.sleep_until)):
        time.sleep(args.step_sleep)


run.train(step_fn, steps=args.steps)
full = [p.full_tensor().detach().cpu() for p in model.parameters()]
if args.out and (not dist.is_initialized() or dist.get_rank() == 0):
    torch.save(full, args.out)
run.close()
