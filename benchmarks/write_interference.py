"""What each part of a background checkpoint write costs a training loop beside it.

The loop of `checkpoint.py` (one thread, MLP + AdamW, ~0.55 s steps) trains while a
background thread repeats one kind of work on a 515 MB buffer, without pause: nothing
(idle), CRC-32 in 1 MB pieces, a copy into a 16 MB ring in 1 MB pieces (numpy, no GIL),
both (what `direct_io.py` does per byte), and O_DIRECT writes of 16 MB chunks to disk.
From the step-time increase and the passes the thread made per second follows the cost to
training of one pass over 515 MB, in milliseconds of step time. Kinds alternate over rounds.

    .venv/bin/python benchmarks/write_interference.py --rounds 3

The last line printed is one JSON object with those figures.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
import zlib

import numpy as np
import torch
from checkpoint import Trainer
from harness import alternate, emit, temp_root

SIZE = 515 << 20
CHUNK = 16 << 20
PIECE = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="training steps per kind and round")
    p.add_argument("--dir", default=None, help="where the O_DIRECT file goes")
    args = p.parse_args()
    torch.set_num_threads(1)
    trainer = Trainer(3000, 5, 64)
    trainer.step()
    src = np.full(SIZE, 3, dtype=np.uint8)
    chunk = mmap.mmap(-1, CHUNK)
    ring = np.frombuffer(chunk, dtype=np.uint8)
    path = temp_root("unbroken-write-interference-", dir=args.dir) / "direct.bin"

    def crc() -> None:
        for o in range(0, SIZE, PIECE):
            zlib.crc32(src[o:o + PIECE])

    def copy() -> None:
        for o in range(0, SIZE, PIECE):
            ring[o % CHUNK:o % CHUNK + PIECE] = src[o:o + PIECE]

    def crc_copy() -> None:
        for o in range(0, SIZE, PIECE):
            zlib.crc32(src[o:o + PIECE])
            ring[o % CHUNK:o % CHUNK + PIECE] = src[o:o + PIECE]

    def direct_write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            for _ in range(0, SIZE, CHUNK):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)

    kinds = {"idle": lambda: time.sleep(0.1), "crc32": crc, "copy": copy, "crc32+copy": crc_copy,
             "o_direct_write": direct_write}

    def one_kind(name: str, r: int) -> tuple[float, float]:
        """(mean step time, passes per second) while `name`'s work runs beside the loop."""
        work, stop, passes = kinds[name], threading.Event(), [0]

        def loop() -> None:
            while not stop.is_set():
                work()
                passes[0] += 1

        thread = threading.Thread(target=loop)
        t0 = time.perf_counter()
        thread.start()
        steps = [trainer.step() for _ in range(args.steps)]
        elapsed = time.perf_counter() - t0
        stop.set()
        thread.join()
        step, rate = statistics.fmean(steps), passes[0] / elapsed
        print(f"  round {r + 1} {name:15s} step {step * 1e3:6.1f} ms  {rate:5.2f} passes/s",
              flush=True)
        return step, rate

    try:  # every kind in each round, in the same order
        samples = alternate(list(kinds), args.rounds, one_kind, reverse=False)
    finally:
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    idle = statistics.fmean(s for s, _ in samples["idle"])
    out: dict = {"benchmark": "write_interference", "idle_step_ms": round(idle * 1e3, 1)}
    print()
    for name in list(kinds)[1:]:
        step = statistics.fmean(s for s, _ in samples[name])
        rate = statistics.fmean(r for _, r in samples[name])
        slowdown = step / idle - 1
        # Seconds of step time lost per second, divided by passes per second.
        cost_ms = slowdown / rate * 1e3 if rate else None
        out[name] = {"step_slowdown_pct": round(slowdown * 100, 1), "passes_per_s": round(rate, 2),
                     "cost_ms_per_515mb": round(cost_ms, 1) if cost_ms is not None else None}
        print(f"{name:15s} steps {slowdown:+6.1%} while it runs, {rate:5.2f} passes/s: "
              f"{cost_ms:5.1f} ms of step time per 515 MB")
    emit(out)


if __name__ == "__main__":
    main()
