"""A training loop of your own (DDP, or FSDP2 as HSDP), recovered in place by a two-line change.

The loop is the one a torchrun script has: a DataLoader with a DistributedSampler, gradient
accumulation with `no_sync()`, a gradient clip, an LR scheduler, its own all-reduce of the
loss for printing. The change (docs/your-loop.md):

    for step, micro in run.steps(args.steps, data=loader, micro_batches=args.accum):
        with run.try_step():
            ...the step as it was...

Runs unchanged under `unbroken run`, under `torchrun`, or as a single `python train.py`:

    unbroken run --nproc-per-node 4 --spares 1 examples/custom_loop/train.py --steps 200

Under `unbroken run`, a worker's fault does not stop the others: the survivors keep their
processes, the step is redone on the same batch, and a spare or a replacement takes the
dead rank's place with its state and its place in the data.
"""

from __future__ import annotations

import argparse
import array
import os
import signal
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))
from data import CharCorpus  # noqa: E402  (the GPT example's corpus and model)
from model import GPT, GPTConfig  # noqa: E402

import unbroken  # noqa: E402


class Windows(Dataset):
    """`count` windows of `seq + 1` characters at seeded places in the corpus."""

    def __init__(self, corpus: CharCorpus, seq: int, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data, self.seq = corpus.data, seq
        self.starts = torch.randint(0, len(corpus.data) - seq - 1, (count,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        return self.data[s: s + self.seq], self.data[s + 1: s + self.seq + 1]


class RankStream(IterableDataset):
    """(tests) A rank's own stream of windows, each `1..64` characters after the last by the
    rank's own draws: after the same number of batches the ranks stand at different places,
    so a rank's place is its loader's state, which no other rank holds. `rank()` is asked
    when iterated (a promoted spare's is the rank it took)."""

    def __init__(self, corpus: CharCorpus, seq: int, seed: int, rank) -> None:
        self.data, self.seq, self.seed, self.rank = corpus.data, seq, seed, rank
        self.pos, self.count = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rank, room = self.rank(), len(self.data) - self.seq - 1
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 7_919 + self.count)
            self.pos = (self.pos + int(torch.randint(1, 65, (), generator=g))) % room
            self.count += 1
            yield self.data[self.pos: self.pos + self.seq], \
                self.data[self.pos + 1: self.pos + self.seq + 1]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.count = state["pos"], state["count"]


def _die_here(args: argparse.Namespace, step: int, rank: int, where: str) -> None:
    """The test's fault: SIGKILL this process at `--die-at STEP:RANK:WHERE`, once per marker."""
    for spec in args.die_at:
        at, who, what = spec.split(":")
        marker = Path(f"{args.die_marker}.{spec.replace(':', '_')}")
        if (int(at), int(who), what) == (step, rank, where) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def deferred(net: torch.nn.Module) -> Iterator[None]:
    """A micro-batch whose gradients are not reduced yet (all but the step's last)."""
    net = getattr(net, "_orig_mod", net)  # torch.compile's wrapper
    if isinstance(net, DDP):
        with net.no_sync():
            yield
    elif hasattr(net, "set_requires_gradient_sync"):  # FSDP2
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    else:
        yield


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch, per rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--windows", type=int, default=256, help="the dataset's size")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step waits, standing in for accelerator time")
    p.add_argument("--exact", action="store_true",
                   help="reduce gradients in rank order: bit-identical results across recoveries")
    p.add_argument("--hsdp", type=int, default=0, metavar="R",
                   help="FSDP2 as HSDP: R replica groups, each sharding the model over "
                        "world / R ranks (0: DDP)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (backend aot_eager: no compiler on CPU)")
    p.add_argument("--reduce-loss", action="store_true",
                   help="all-reduce the loss inside the step, after the update (for printing)")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--step-log", default=None, metavar="PATH",
                   help="(benchmarks) rank 0 appends '<step> <wall time>' at each step's end")
    p.add_argument("--final-state", default=None, help="rank 0 saves the whole state here")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--bare", action="store_true",
                   help="(benchmarks) the loop as torchrun runs it, without run.steps(data=...) "
                        "and run.try_step(): the baseline of their cost per step")
    p.add_argument("--die-at", action="append", default=[], metavar="STEP:RANK:WHERE",
                   help="(tests) SIGKILL this rank at STEP, WHERE: micro (between the "
                        "micro-batches), update (after optimizer.step()), reduce (before the "
                        "loss's all-reduce); once, remembered in --die-marker files")
    p.add_argument("--die-marker", default="/tmp/unbroken-custom-loop")
    p.add_argument("--iterable", action="store_true",
                   help="(tests) feed the loop a plain generator over the loader, which cannot "
                        "be positioned: the job then restarts on a fault")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="(tests) every rank waits before this step until --hold-file exists "
                        "(up to 300 s)")
    p.add_argument("--hold-file", default=None)
    p.add_argument("--stateful", action="store_true",
                   help="(tests) torchdata's StatefulDataLoader over a per-rank stream whose "
                        "place differs from rank to rank (RankStream)")
    args = p.parse_args()

    torch.set_num_threads(1)
    run = unbroken.init(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                        seed=args.seed)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    corpus = CharCorpus.load()
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=args.seq,
                          n_layer=args.layers, n_embd=args.dim))
    net = model
    if args.hsdp and run.world_size > 1:  # sharded: each block, then the root
        mesh = init_device_mesh("cpu", (args.hsdp, run.world_size // args.hsdp),
                                mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif dist.is_initialized() and dist.get_world_size() > 1:
        net = DDP(model)
        if args.exact:
            net.register_comm_hook(None, unbroken.exact_allreduce)
    if args.compile:
        net = torch.compile(net, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    run.track(model, optimizer, scheduler=scheduler)
    dataset = Windows(corpus, args.seq, args.windows, args.seed)
    # A spare's rank is -1 until it is promoted: run.steps(data=...) remakes its sampler then.
    sampler = DistributedSampler(dataset, num_replicas=run.world_size, rank=max(run.rank, 0),
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    if args.stateful:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            sys.exit("--stateful needs torchdata: pip install torchdata")
        stream = RankStream(corpus, args.seq, args.seed, lambda: max(run.rank, 0))
        loader = StatefulDataLoader(stream, batch_size=args.batch)

    def one_step(step: int, micro: list) -> torch.Tensor:
        total = torch.zeros(())
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with nullcontext() if last else deferred(net):
                loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten()) / len(micro)
                loss.backward()
            total += loss.detach()
            if not last:
                _die_here(args, step, run.rank, "micro")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _die_here(args, step, run.rank, "update")
        if args.reduce_loss and run.world_size > 1:
            _die_here(args, step, run.rank, "reduce")
            dist.all_reduce(total)
            total /= dist.get_world_size()
        return total

    def after(step: int, micro: list, total: torch.Tensor) -> None:
        scheduler.step()  # the runtime stepped it at the commit: this call is then a no-op
        crc = zlib.crc32(array.array("q", torch.cat([x for x, _ in micro]).flatten().tolist()))
        run.log(loss=total, data=crc)
        if run.rank == 0 and step % args.print_every == 0:
            print(f"step {step:4d}  loss {total.item():.3f}", flush=True)
        if args.step_log and run.rank == 0:
            with open(args.step_log, "a") as log:
                log.write(f"{step} {time.time()}\n")

    if args.bare:  # the loop as torchrun runs it
        micro, step = [], 0
        for epoch in range(10**6):
            sampler.set_epoch(epoch)
            for batch in loader:
                micro.append(batch)
                if len(micro) == args.accum:
                    after(step, micro, one_step(step, micro))
                    micro, step = [], step + 1
                if step == args.steps:
                    break
            if step == args.steps:
                break
    else:
        data = (b for epoch in range(10**6) for b in loader) if args.iterable else loader
        for step, micro in run.steps(args.steps, data=data, micro_batches=args.accum):
            if step == args.hold_at and args.hold_file:
                with run.phase("hold"):  # many step times long: no hang timeout runs in it
                    deadline = time.monotonic() + 300
                    while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
                        time.sleep(0.05)
            with run.try_step():
                total = one_step(step, micro)
            after(step, micro, total)

    if args.final_state:  # a collective when sharded: every rank gathers, rank 0 saves
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(model, options=full),
                 "optim": get_optimizer_state_dict(model, optimizer, options=full),
                 "scheduler": scheduler.state_dict()}
        if run.rank == 0:
            torch.save(state, args.final_state)
    run.close()


if __name__ == "__main__":
    main()
