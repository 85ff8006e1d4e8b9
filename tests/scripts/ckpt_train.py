"""A small worker for checkpoint tests: a two-layer model, AdamW, `run.train`.

`--fsdp` shards it with FSDP2 (one shard per rank, uneven when the world size does not
divide the rows); `--full-state PATH` makes rank 0 write the full, unsharded model and
optimizer state there at the end, to compare runs of different world sizes.
"""

import argparse
import gc
import os
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import unbroken

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--checkpoint-dir", default=None)
p.add_argument("--checkpoint-every", type=int, default=5)
p.add_argument("--checkpoint-timeout", type=float, default=600.0)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--sleep-until", default=None, metavar="PATH",
               help="sleep --step-sleep per step only until PATH exists: a test that has seen "
                    "what it waited for lets the job run out its steps at full speed")
p.add_argument("--fsdp", action="store_true")
p.add_argument("--full-state", default=None)
p.add_argument("--exact", action="store_true", help="sum gradients in rank order (bit-identical)")
p.add_argument("--exit-code-after-training", type=int, default=0,
               help="rank 1 exits with this code after training (a crash in teardown)")
p.add_argument("--own-group", action="store_true",
               help="form the process group itself before unbroken.init(), as Accelerate, "
                    "Lightning and torchtitan do")
p.add_argument("--replacements-crash", action="store_true",
               help="a replacement worker raises before it can join (a crash loop)")
p.add_argument("--count-old-views", action="store_true",
               help="log, with each step, how many views that build() made in earlier "
                    "generations are still alive (weak references)")
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
               help="cuda: the model on this worker's GPU, NCCL (benchmarks/gpu_multi.py)")
args = p.parse_args()

torch.set_num_threads(1)
if args.own_group:
    dist.init_process_group("gloo")
run = unbroken.init(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    checkpoint_timeout=args.checkpoint_timeout)
if args.replacements_crash and run.joining and not run.spare:
    raise RuntimeError("this replacement cannot start")
torch.manual_seed(0)
device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5)).to(device)
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
run.track(model, optimizer)


BUILT = []  # --count-old-views: a weak reference to each DDP that build() made
ALIVE_AT_BUILD = []  # how many of the earlier ones were still alive at each build()


def build():
    if args.fsdp or run.world_size == 1:
        return model
    ddp = DDP(model)
    if args.exact:
        ddp.register_comm_hook(None, unbroken.exact_allreduce)
    if args.count_old_views:
        gc.collect()  # what only a cycle keeps is not counted: only what is still referenced
        ALIVE_AT_BUILD.append(sum(ref() is not None for ref in BUILT))
        BUILT.append(weakref.ref(ddp))
    return ddp


def step_fn(step, net):
    if args.count_old_views and args.step_sleep:
        time.sleep(args.step_sleep)  # first: a peer killed now breaks this step's backward
    g = torch.Generator().manual_seed(step * 100 + run.rank)
    x = torch.randn(4, 6, generator=g).to(device)
    net(x).pow(2).mean().backward()
    if args.count_old_views:
        run.log(old_views=sum(ref() is not None for ref in BUILT[:-1]), views=len(BUILT),
                old_at_build=ALIVE_AT_BUILD[-1])
    if args.step_sleep and not args.count_old_views and not (
            args.sleep_until and os.path.exists(args.sleep_until)):
        time.sleep(args.step_sleep)


print(f"ckpt_train: rank {run.rank} of {run.world_size} trains from step {run.step}", flush=True)
run.train(step_fn, steps=args.steps, build=build)
if args.full_state:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd["state"]}, args.full_state)
run.close()
if args.exit_code_after_training and run.slot == 1:
    os._exit(args.exit_code_after_training)
