"""An Accelerate training loop of your own, recovered in place by the same two lines.

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    run.track(model, optimizer, scheduler=scheduler)
    for step, (x, y) in run.steps(args.steps, data=loader):
        if step == args.hold_at and args.hold_file:
            with run.phase("hold"):  # many step times long: no hang timeout runs in it
                deadline = time.monotonic() + 300
                while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
                    time.sleep(0.05)
        with run.try_step():
            ...accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()...

The prepared loader is positioned by step when its order is a function of the epoch
(`use_seedable_sampler=True`, or no shuffling); Accelerate's own `accumulate()` is not
(accumulate with `micro_batches=` instead): see docs/your-loop.md. Runs unchanged under
`unbroken run`, under `torchrun` and alone:

    unbroken run --nproc-per-node 2 --spares 1 examples/accelerate/train.py --steps 100
"""

from __future__ import annotations

import argparse
import array
import os
import time
import zlib

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

import unbroken


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4, help="per process")
    p.add_argument("--exact", action="store_true",
                   help="reduce gradients in rank order: bit-identical results across recoveries")
    p.add_argument("--final-state", default=None, help="rank 0 saves the whole state here")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step waits, standing in for accelerator time")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="(tests) before step N every rank waits, in a declared long phase, "
                        "until --hold-file exists (up to 300 s)")
    p.add_argument("--hold-file", default=None)
    args = p.parse_args()

    torch.set_num_threads(1)
    run = unbroken.init(seed=0)  # forms the group Accelerate then uses
    accelerator = Accelerator(cpu=True,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)  # the same initial weights and data on every rank
    data = TensorDataset(torch.randn(args.samples, 8), torch.randn(args.samples, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s / 50))
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.exact and accelerator.num_processes > 1:
        model.register_comm_hook(None, unbroken.exact_allreduce)
    run.track(model, optimizer, scheduler=scheduler)

    for step, (x, y) in run.steps(args.steps, data=loader):
        if step == args.hold_at and args.hold_file:
            with run.phase("hold"):  # many step times long: no hang timeout runs in it
                deadline = time.monotonic() + 300
                while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
                    time.sleep(0.05)
        with run.try_step():
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            time.sleep(args.step_sleep)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()  # the runtime stepped it at the commit: a no-op
        run.log(loss=loss, data=zlib.crc32(array.array("d", x.flatten().tolist())))

    if args.final_state and run.rank == 0:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(),
                    "optim": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   args.final_state)
    run.close()


if __name__ == "__main__":
    main()
