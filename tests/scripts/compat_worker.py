"""A torchrun-style worker for tests/integration/test_torchrun_compat.py.

Each rank prints one line to stdout and one to stderr, joins the job with
`init_process_group("gloo")` (env:// by default, `--init tcp` for
tcp://$MASTER_ADDR:$MASTER_PORT), all-reduces rank+1, and writes what it saw as JSON to
$COMPAT_OUT/rank<RANK>.json. Options make it fail: `--fail-first` exits 3 on the first
attempt (TORCHELASTIC_RESTART_COUNT 0), `--raise-on-rank R` raises on rank R after every
rank has written its file, `--record` wraps main in torchelastic's `@record` (which writes
TORCHELASTIC_ERROR_FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

# What the launcher sets; the test compares them between torchrun and unbroken run.
ENV_KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "CUDA_VISIBLE_DEVICES"]

MESSAGE = "compat worker failure on rank {rank}"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--init", choices=("env", "tcp"), default="env")
    p.add_argument("--fail-first", action="store_true")
    p.add_argument("--raise-on-rank", type=int, default=None)
    p.add_argument("--record", action="store_true")
    return p.parse_args(argv)


def _main(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    # One write per line: print() writes the text and the newline separately when
    # unbuffered, and two ranks sharing the launcher's stdout could interleave between them.
    sys.stdout.write(f"compat-stdout rank={rank}\n")
    sys.stdout.flush()
    sys.stderr.write(f"compat-stderr rank={rank}\n")
    sys.stderr.flush()
    if args.fail_first and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        sys.exit(3)
    if args.init == "tcp":
        init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group("gloo", init_method=init, rank=rank,
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    record_ = {k: os.environ.get(k) for k in ENV_KEYS}
    record_.update(is_torchelastic_launched=dist.is_torchelastic_launched(), sum=t.item(),
                   init=args.init, main_module=main_spec.name if main_spec else None)
    out = os.environ["COMPAT_OUT"]
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(record_, fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))
    dist.barrier()  # every file is written before any rank fails
    if args.raise_on_rank == rank:
        raise RuntimeError(MESSAGE.format(rank=rank))
    dist.destroy_process_group()


@record
def _recorded_main(args: argparse.Namespace) -> None:
    _main(args)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    (_recorded_main if args.record else _main)(args)


if __name__ == "__main__":
    main()
