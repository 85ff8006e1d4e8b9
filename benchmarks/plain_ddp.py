"""The example's training step as a plain DDP loop, without unbroken: the steady-state baseline.

Same model, data, loss and optimizer as examples/gpt/train.py; run under torchrun. Rank 0
appends one line per step (`{"step": s, "t": wall time at the step's end}`) to --timing-file.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from data import CharCorpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--timing-file", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    corpus = CharCorpus.load()
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=args.seq,
                          n_layer=args.layers, n_embd=args.dim))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log = open(args.timing_file, "a") if rank == 0 else None  # noqa: SIM115
    for step in range(args.steps):
        x, y = corpus.batch(step, rank, world, args.global_batch, args.seq, args.seed)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten(), reduction="sum")
        (loss * world / (args.global_batch * args.seq)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        zlib.crc32(array.array("q", x.flatten().tolist()).tobytes())
        if log is not None:
            log.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            log.flush()
    if log is not None:
        log.close()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
