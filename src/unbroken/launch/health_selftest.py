"""One rank of the health check's collective self-test (`health_check.check_collective`):
`python -m unbroken.launch.health_selftest STORE RANK WORLD BACKEND`. Joins a group of
the node's local ranks through a file store, all-reduces its rank + 1 and checks the sum;
exits 1 with one line on stderr if it is wrong. Runs in a process of its own: the agent
itself never imports torch."""

from __future__ import annotations

import sys
from datetime import timedelta


def main(argv: list[str]) -> int:
    store_path, rank, world, backend = argv[0], int(argv[1]), int(argv[2]), argv[3]
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        t = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(t)
        want = world * (world + 1) / 2
        if t.item() != want:
            print(f"the all-reduce gave {t.item():g}, not {want:g}", file=sys.stderr)
            return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
