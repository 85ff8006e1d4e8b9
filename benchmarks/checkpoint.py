"""What a checkpoint costs the training loop: torch.save, DCP's three ways, and unbroken.

One process trains an MLP whose weights plus AdamW state come to ~540 MB, and checkpoints
the same live state, in turns, with:

- `torch.save`: `torch.save` of model and optimizer state, then fsync;
- `dcp.save`: DCP's synchronous save (its writer fsyncs);
- `dcp.async_save`: the thread executor with the default stager (the copy is made in the call);
- `dcp.async_save+staging`: with `DefaultStager(use_async_staging=True)`: the copy is made
  in the background too; the loop waits for it before the next optimizer update, as it must;
- `unbroken`: `Checkpointer.start` (staged behind the next step, persist, verify, commit).

Per checkpoint: the training-loop stall (the time the loop is blocked: the call, plus any
wait before the next optimizer update) and the time to durable (call to files fsynced; for
unbroken, to the committed checkpoint with its manifest); for the background ones, the step
time while the persist runs, against steps with nothing in flight, measured in the same run,
and the background cost: the extra step time those steps took in all.
The loop trains on one thread (`--threads`), leaving the machine's other core to whatever
runs in the background, as a GPU job leaves its host CPUs.

    .venv/bin/python benchmarks/checkpoint.py --checkpoints 3

The last line printed is one JSON object with the figures and their ratios to torch.save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from harness import REPO, alternate, emit, ratio, temp_root

sys.path.insert(0, str(REPO / "src"))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from unbroken.checkpoint.checkpointer import Checkpointer  # noqa: E402
from unbroken.telemetry import schema as ev  # noqa: E402

ARMS = ["torch.save", "dcp.save", "dcp.async_save", "dcp.async_save+staging", "unbroken"]


class Trainer:
    """An MLP and AdamW; each step optionally waits (timed) before the optimizer update."""

    def __init__(self, width: int, layers: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width)
        self.before_update: Callable[[], None] | None = None  # e.g. wait for a staging copy
        self.waited = 0.0

    def step(self) -> float:
        """One step; returns its duration without any explicit wait (counted as stall)."""
        t0 = time.perf_counter()
        self.model(self.x).square().mean().backward()
        waited = 0.0
        if self.before_update is not None:
            w0 = time.perf_counter()
            self.before_update()
            waited = time.perf_counter() - w0
            self.before_update = None
        self.optimizer.step()  # unbroken's pre-hook may wait here: it reports that itself
        self.optimizer.zero_grad(set_to_none=True)
        self.waited = waited
        return time.perf_counter() - t0 - waited

    def dcp_state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, [self.optimizer])
        return {"model": model_sd, "optim": optim_sd}

    def nbytes(self) -> int:
        state = self.dcp_state()
        total = 0
        for group in (state["model"], *state["optim"]["state"].values()):
            total += sum(t.numel() * t.element_size() for t in group.values()
                         if isinstance(t, torch.Tensor))
        return total


def fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Arm:
    """One way to checkpoint. `begin` returns once the loop may go on (the stall); `done`
    says whether the checkpoint is durable, and `durable_at` when it became so."""

    def __init__(self, name: str, trainer: Trainer, root: Path) -> None:
        self.name, self.trainer, self.root = name, trainer, root
        self.step_time: float | None = None  # what unbroken's runtime would pass: its average
        self.durable_at: float | None = None
        self.extra_stall = 0.0  # waits the loop paid after begin() returned
        self.count = 0
        self._future: Future | None = None
        self._response = None
        self._stager: DefaultStager | None = None
        self._events: list = []  # the checkpointer's typed events (telemetry.schema)
        self.ckpt: Checkpointer | None = None
        if name == "unbroken":
            self.ckpt = Checkpointer(root / "unbroken", keep=1,
                                     record=self._events.append)
            self.ckpt.protect(trainer.model, [trainer.optimizer])

    def _target(self) -> Path:
        self.count += 1
        path = self.root / f"{self.name}-{self.count}"
        shutil.rmtree(self.root / f"{self.name}-{self.count - 1}", ignore_errors=True)
        return path

    def begin(self) -> None:
        self.durable_at = None
        self.extra_stall = 0.0
        tr = self.trainer
        if self.name == "torch.save":
            path = self._target()
            torch.save({"model": tr.model.state_dict(), "optim": tr.optimizer.state_dict()}, path)
            fsync_tree(path)
            self.durable_at = time.perf_counter()
        elif self.name == "dcp.save":
            dcp.save(tr.dcp_state(), checkpoint_id=self._target(), no_dist=True)
            self.durable_at = time.perf_counter()
        elif self.name == "dcp.async_save":
            self._future = dcp.async_save(tr.dcp_state(), checkpoint_id=self._target(), no_dist=True)
            self._future.add_done_callback(self._mark_durable)
        elif self.name == "dcp.async_save+staging":
            if self._stager is None:
                self._stager = DefaultStager(StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                    use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))
            response = dcp.async_save(tr.dcp_state(), checkpoint_id=self._target(), no_dist=True,
                                      async_stager=self._stager)
            staging = response.staging_completion
            tr.before_update = staging.result  # the next update must not overwrite the source
            response.upload_completion.add_done_callback(self._mark_durable)
            self._response = response
        else:
            self._events.clear()
            assert self.ckpt.start(tr.dcp_state(), step=self.count + 1, step_time=self.step_time)
            self.count += 1

    def _mark_durable(self, _future: Future) -> None:
        self.durable_at = time.perf_counter()

    def done(self) -> bool:
        if self.name == "unbroken":
            return self.ckpt.wait(0)
        return self.durable_at is not None

    def finish(self, started: float) -> tuple[float, float]:
        """(extra stall the arm itself reports, seconds from begin to durable)."""
        if self.name == "unbroken":
            saved = [e for e in self._events if isinstance(e, ev.CheckpointSaved)]
            if not saved:
                raise RuntimeError(f"unbroken checkpoint failed: {self._events}")
            return saved[0].stall, saved[0].durable
        if self._future is not None:
            self._future.result()
            self._future = None
        if self._response is not None:
            self._response.upload_completion.result()
            self._response = None
        return 0.0, self.durable_at - started

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    tr = Trainer(args.width, args.layers, args.batch)
    for _ in range(2):  # AdamW state exists from the first update on
        tr.step()
    state_mb = tr.nbytes() / 2**20
    root = temp_root("ckpt-bench-", dir=args.dir)
    print(f"state: {state_mb:.0f} MB (model + AdamW), width {args.width} x {args.layers} layers; "
          f"checkpoints under {root}", flush=True)
    arms = {name: Arm(name, tr, root) for name in ARMS}
    baseline: list[float] = []
    results: dict[str, dict[str, list]] = {n: {"stall": [], "durable": [], "during": [],
                                               "rounds": []} for n in ARMS}

    def one_checkpoint(name: str, i: int) -> None:
        arm = arms[name]
        baseline.extend(tr.step() for _ in range(args.quiet_steps))
        arm.step_time = statistics.fmean(baseline[-args.quiet_steps:])
        t0 = time.perf_counter()
        arm.begin()
        call = time.perf_counter() - t0
        during, waits = [], 0.0
        for _ in range(args.max_steps):
            if arm.done():
                break
            during.append(tr.step())
            waits += tr.waited
        reported_stall, durable = arm.finish(t0)
        stall = reported_stall if name == "unbroken" else call + waits
        results[name]["stall"].append(stall)
        results[name]["durable"].append(durable)
        results[name]["during"].extend(during)
        results[name]["rounds"].append(during)
        print(f"  round {i + 1} {name:24s} stall {stall * 1e3:8.1f} ms   durable "
              f"{durable:6.2f} s   steps during persist {len(during)}", flush=True)

    try:  # every arm in each round, in the same order, so that machine noise hits them all
        alternate(ARMS, args.checkpoints, one_checkpoint, reverse=False)
    finally:
        for arm in arms.values():
            arm.close()
        shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(baseline)
    out: dict = {"benchmark": "checkpoint", "state_mb": round(state_mb, 1),
                 "checkpoints_per_arm": args.checkpoints, "train_threads": args.threads,
                 "baseline_step_s": round(base, 4)}
    ref_stall = statistics.median(results["torch.save"]["stall"])
    ref_durable = statistics.median(results["torch.save"]["durable"])
    for name in ARMS:
        r = results[name]
        stall, durable = statistics.median(r["stall"]), statistics.median(r["durable"])
        during = statistics.fmean(r["during"]) if r["during"] else None
        out[name] = {
            "stall_s": round(stall, 4), "durable_s": round(durable, 3),
            "stall_vs_torch_save": ratio(stall, ref_stall, 4),
            "durable_vs_torch_save": ratio(durable, ref_durable, 3),
            "steps_during_persist": len(r["during"]),
            # What the background work cost the loop per checkpoint, in seconds of step time.
            "background_cost_s": round(statistics.median(
                sum(d - base for d in during) for during in r["rounds"]), 4),
            "step_slowdown_during_persist_pct": (round((during / base - 1) * 100, 2)
                                                 if during is not None else None),
        }
    ours = out["unbroken"]
    out["targets"] = {
        "stall_pct_of_torch_save": round(ours["stall_vs_torch_save"] * 100, 2),
        "stall_below_every_dcp_variant": all(
            ours["stall_s"] < out[n]["stall_s"] for n in ARMS if n.startswith("dcp")),
        "durable_vs_dcp_save": ratio(ours["durable_s"], out["dcp.save"]["durable_s"], 3),
        "step_slowdown_during_persist_pct": ours["step_slowdown_during_persist_pct"],
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints per arm")
    p.add_argument("--width", type=int, default=3000)
    p.add_argument("--layers", type=int, default=5, help="5 x 3000^2: ~540 MB with AdamW state")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the training loop")
    p.add_argument("--quiet-steps", type=int, default=3, help="steps with nothing in flight per round")
    p.add_argument("--max-steps", type=int, default=200, help="steps to wait for a persist at most")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = p.parse_args()
    out = run(args)
    print()
    print(f"{'arm':24s} {'stall':>10s} {'vs torch.save':>14s} {'durable':>9s} {'vs torch.save':>14s} "
          f"{'steps slower while persisting':>30s}")
    for name in ARMS:
        r = out[name]
        slow = r["step_slowdown_during_persist_pct"]
        print(f"{name:24s} {r['stall_s'] * 1e3:8.1f}ms {r['stall_vs_torch_save']:13.2%} "
              f"{r['durable_s']:8.2f}s {r['durable_vs_torch_save']:13.2f}x "
              f"{'-' if slow is None else f'{slow:+.1f} %':>30s}")
    t = out["targets"]
    print(f"\nunbroken: stall {t['stall_pct_of_torch_save']} % of torch.save's (target <= 2 %), "
          f"below every DCP variant: {t['stall_below_every_dcp_variant']}; durable "
          f"{t['durable_vs_dcp_save']}x dcp.save (target <= 1.5x); steps "
          f"{t['step_slowdown_during_persist_pct']:+.1f} % while persisting (target <= 5 %)")
    emit(out)


if __name__ == "__main__":
    main()
