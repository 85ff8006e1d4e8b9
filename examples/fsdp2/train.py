"""Train a small transformer language model sharded with FSDP2 (`fully_shard`) on `run.train`.

Runs under `unbroken run`, under `torchrun`, or as a single `python train.py` (one process:
nothing to shard, so the model trains whole):

    unbroken run --nproc-per-node 2 --max-restarts 3 examples/fsdp2/train.py \\
        --steps 100 --checkpoint-dir /tmp/fsdp2-ckpt

Each rank holds only its shard of the parameters and of AdamW's state. Under `unbroken run`,
a rank that dies does not stop the others: they keep their processes, the dead rank's
replacement gets its shard from a buddy's in-memory snapshot (or, with `--replicas 2`, from
the live replica in the other HSDP group), and training goes on in place. Only when every
copy of a shard is gone does the job restart from the last sharded (DCP) checkpoint.

The data is synthetic: sequences drawn from a fixed random Markov chain in which every token
has `--branch` equally likely successors, so the loss falls from ln(vocab) towards the
chain's entropy, ln(branch). A step's global batch is a function of (seed, step) alone,
split by rank: a step redone after a fault, or run by a replacement, sees the same data,
whatever the world size.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import unbroken


# ---------------------------------------------------------------------------- the model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and an untied head.

    `forward(idx)`: idx is (batch, t) token ids with t <= seq; returns (batch, t, vocab) logits.
    """

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shard(model: Transformer, mesh: DeviceMesh) -> None:
    """FSDP2: each block is one unit of all-gather and reduce-scatter, and the root holds
    the rest (embeddings, final norm, head). On a 1-D mesh that is FSDP; on a 2-D mesh
    ("replicate", "shard") it is HSDP: sharded within a replica group, replicated across."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


# ---------------------------------------------------------------------------- the data
class MarkovData:
    """Sequences from a fixed random Markov chain: token i is followed by one of `branch`
    successors, uniformly. The chain depends on `seed` only; a step's batch on (seed, step)
    only, never on the rank count or on which process asks."""

    def __init__(self, vocab: int, branch: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.branch, self.seed = vocab, branch, seed
        self.successors = torch.stack([torch.randperm(vocab, generator=g)[:branch]
                                       for _ in range(vocab)])  # (vocab, branch)

    def batch(self, step: int, rank: int, world: int, global_batch: int,
              seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step `step`'s global batch: inputs and next-token targets,
        each (rows, seq). Rank r of W gets rows [r*B//W, (r+1)*B//W): every rank at least
        one when B >= W."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(global_batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (global_batch,), generator=g)
        picks = torch.randint(self.branch, (global_batch, seq), generator=g)
        for t in range(seq):
            tokens[:, t + 1] = self.successors[tokens[:, t], picks[:, t]]
        rows = tokens[rank * global_batch // world:(rank + 1) * global_batch // world]
        return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------- the job
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--branch", type=int, default=4, help="successors per token in the chain")
    p.add_argument("--dim", type=int, default=64, help="model width (divisible by --heads)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP replica groups (the world size must divide by it); 1: FSDP")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip; 0: none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None,
                   help="sharded (DCP) checkpoints go here; the job resumes from the newest")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--snapshot-every", type=int, default=None,
                   help="in-memory shard snapshot every N steps (default: unbroken picks N "
                        "so that snapshots cost at most 1%% of step time; 0: none)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step waits, standing in for accelerator time")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--final-state", default=None,
                   help="rank 0 writes the whole (unsharded) model state dict here at the end")
    args = p.parse_args()
    for name in ("steps", "global_batch", "seq", "vocab", "branch", "dim", "layers", "heads",
                 "replicas", "print_every", "checkpoint_every"):
        if getattr(args, name) < 1 and not (name == "steps" and args.steps == 0):
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        p.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    if args.branch > args.vocab:
        p.error(f"--branch ({args.branch}) cannot exceed --vocab ({args.vocab})")
    return args


def make_mesh(run: unbroken.Run, replicas: int, device: str) -> DeviceMesh:
    """The job's one device mesh over every rank: (world,) for FSDP, (replicas, world /
    replicas) for HSDP. Exits with one line if the world does not divide."""
    world = run.world_size
    if world % replicas:
        sys.exit(f"train.py: --replicas {replicas} does not divide the world size {world}")
    if replicas == 1:
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device, (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    # Joins the job (gloo on CPU, NCCL on GPU). Sharded checkpoints every --checkpoint-every
    # steps, written in the background; in-memory snapshots of the shards for in-place recovery.
    run = unbroken.init(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                        snapshot_every=args.snapshot_every, seed=args.seed)
    if args.global_batch < run.world_size:
        sys.exit(f"train.py: --global-batch ({args.global_batch}) must be at least the world "
                 f"size ({run.world_size}): every rank needs a sequence")
    device = "cuda" if run.backend == "nccl" else "cpu"
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = Transformer(args.vocab, args.seq, args.dim, args.layers, args.heads).to(device)
    whole = sum(p.numel() for p in model.parameters())
    if run.world_size > 1:  # one process has no group to shard over: it trains whole
        shard(model, make_mesh(run, args.replicas, device))
    elif args.replicas != 1:
        sys.exit("train.py: --replicas needs more than one process")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine down to 10 %
        if step < args.warmup:
            return (step + 1) / args.warmup
        done = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, done)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    # What a step commits, a checkpoint holds and a recovery restores. The runtime steps
    # the optimizer and the scheduler after step_fn returns: that update is the commit.
    run.track(model, optimizer, scheduler=scheduler)
    data = MarkovData(args.vocab, args.branch, args.seed)
    if run.rank == 0 and not run.joining:  # not again from a replacement of rank 0
        mesh = "unsharded" if run.world_size == 1 else (
            f"FSDP over {run.world_size} ranks" if args.replicas == 1 else
            f"HSDP: {args.replicas} replica groups of {run.world_size // args.replicas} shards")
        print(f"train.py: {whole / 1e6:.2f} M parameters, {mesh}; loss floor "
              f"ln({args.branch}) = {math.log(args.branch):.3f}", flush=True)

    def train_step(step: int, net: nn.Module) -> None:
        """Forward and backward of one step (and the gradient clip); no optimizer.step()."""
        x, y = data.batch(step, run.rank, run.world_size, args.global_batch, args.seq)
        x, y = x.to(device), y.to(device)
        # Summed over this rank's tokens and scaled so that FSDP2's mean over ranks is the
        # mean over the global batch, however it is split.
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum")
        (loss * run.world_size / (args.global_batch * args.seq)).backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), args.clip)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        mean = loss.detach() / y.numel()
        run.log(loss=mean, lr=scheduler.get_last_lr()[0])
        # run.joining: a spare's warm-up steps, which count for nothing, are not printed.
        if run.rank == 0 and not run.joining and (step % args.print_every == 0
                                                  or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean.item():.3f}", flush=True)

    # Starts after the newest committed step (a checkpoint's, or a peer's in a recovery).
    run.train(train_step, steps=args.steps)
    if args.final_state:  # a collective: every rank gathers, rank 0 keeps the whole tensors
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
        if run.rank == 0:
            torch.save(state, args.final_state)
    if run.rank == 0:
        print(f"train.py: done at step {run.step}", flush=True)
    run.close()


if __name__ == "__main__":
    main()
