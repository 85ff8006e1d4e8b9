"""What the worker runtime costs a step: a plain loop against `run.steps()` and `run.train()`,
in one process.

The runtime's per-step work is a heartbeat stamp (two stores into a shared page), the fault
check, and one event line appended to the log; `run.train` also seeds the RNG from the step
and steps the optimizer itself. In place, `run.train` also runs a watchdog thread (a tick
every 50 ms, abort on notice) and marks its step and the model's forward on the heartbeat
page: the `watchdog` loop is `run.train` with both. The `watched` loop is the plain loop
of an unchanged script under `unbroken run`: the hooks that clock its steps
(`runtime/watch/`: torch's global optimizer hooks, `backward`, one `script_steps` line a
step) active; in every other loop they are armed but inactive, as with `--no-integrations`.
All loops train the example GPT on the same batches; rounds alternate so that machine noise
hits all of them. Also the hooks' own cost per step, alone (`hooks_us`): the calls a step
makes into them, timed in a tight loop.

    .venv/bin/python benchmarks/step_overhead.py

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from harness import REPO, alternate, emit, temp_root

sys.path.insert(0, str(REPO / "examples" / "gpt"))
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from data import CharCorpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unbroken.runtime.generations.watchdog import Watchdog  # noqa: E402
from unbroken.runtime.heartbeat import HeartbeatWriter  # noqa: E402
from unbroken.runtime.watch import hooks, watcher  # noqa: E402
from unbroken.telemetry.events import EventLog  # noqa: E402


def _setup(corpus: CharCorpus):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=32, n_layer=1, n_embd=32))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train_step(model, optimizer, corpus, step):
    x, y = corpus.batch(step, 0, 1, 4, 32)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def plain(corpus: CharCorpus, steps: int) -> float:
    model, optimizer = _setup(corpus)
    t0 = time.perf_counter()
    for step in range(steps):
        _train_step(model, optimizer, corpus, step)
    return (time.perf_counter() - t0) / steps


def watched(corpus: CharCorpus, steps: int, run_dir: Path) -> float:
    """The plain loop with the script-watching hooks active (as `unbroken run` arms them)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = EventLog(run_dir / "events.jsonl", source="worker", node=0, rank=0, attempt=0,
                   slot=0)
    watcher._active = watcher.Watch(log)
    try:
        return plain(corpus, steps)
    finally:
        watcher._active.finish()
        watcher._active = None
        log.close()


def hooks_cost(path: Path, n: int = 50_000) -> float:
    """Seconds per step inside the hooks alone: the calls one step makes (a `backward`, an
    optimizer's pre- and post-hook, the step's line), without the training around them."""
    log = EventLog(path, source="worker", node=0, rank=0, attempt=0, slot=0)
    watch = watcher.Watch(log)
    clock, loss = watch.clock, torch.tensor(1.5)
    t0 = time.perf_counter()
    for _ in range(n):
        now = time.time()
        watch.ended(clock.backward(now, hooks._loss(loss)))
        watch.ended(clock.before_update(1))
        clock.after_update(1, time.time())
    elapsed = (time.perf_counter() - t0) / n
    log.close()
    return elapsed


def _run(corpus: CharCorpus, run_dir: Path):
    """A worker runtime as `unbroken run` would give it: events and a heartbeat page."""
    import unbroken

    os.environ["UNBROKEN_RUN_DIR"] = str(run_dir)
    os.environ["UNBROKEN_HEARTBEAT_FILE"] = str(run_dir / "rank_0.hb")
    run = unbroken.init()
    model, optimizer = _setup(corpus)
    run.track(model, optimizer)
    return run, model, optimizer


def with_runtime(corpus: CharCorpus, steps: int, run_dir: Path) -> float:
    run, model, optimizer = _run(corpus, run_dir)
    t0 = time.perf_counter()
    for step in run.steps(steps):
        loss = _train_step(model, optimizer, corpus, step)
        run.log(loss=loss)
    elapsed = (time.perf_counter() - t0) / steps
    run.close()
    return elapsed


def with_train(corpus: CharCorpus, steps: int, run_dir: Path, watchdog: bool = False) -> float:
    run, _, _ = _run(corpus, run_dir)
    if watchdog:  # as in place (which needs an agent): the thread, and the progress hooks
        engine = run.engine  # the engine starts one only in place, under an agent
        engine._watchdog = Watchdog(engine.heartbeat, lambda: None, lambda *a: None)
        engine._watchdog.start()

    def step_fn(step: int, net: torch.nn.Module) -> None:
        x, y = corpus.batch(step, 0, 1, 4, 32)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        run.log(loss=loss)

    t0 = time.perf_counter()
    run.train(step_fn, steps)
    elapsed = (time.perf_counter() - t0) / steps
    run.close()
    return elapsed


def stamp_cost(path: Path, n: int = 200_000) -> float:
    hb = HeartbeatWriter(path)
    t0 = time.perf_counter()
    for i in range(n):
        hb.stamp(i)
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    hooks.arm()  # as in every worker: armed; active only in the `watched` loop
    corpus = CharCorpus.load()
    tmp = temp_root("unbroken-bench-overhead-")
    loops = {"plain": lambda r: plain(corpus, args.steps),
             "watched": lambda r: watched(corpus, args.steps, tmp / f"h{r}"),
             "steps": lambda r: with_runtime(corpus, args.steps, tmp / f"s{r}"),
             "train": lambda r: with_train(corpus, args.steps, tmp / f"t{r}"),
             "watchdog": lambda r: with_train(corpus, args.steps, tmp / f"w{r}", watchdog=True)}
    plain(corpus, 20)  # warm caches and lazy imports for all
    times = alternate(list(loops), args.rounds, lambda name, r: loops[name](r),
                      report=lambda r, name, t: print(f"round {r + 1} {name:6s} {1000 * t:.3f} "
                                                      "ms/step", flush=True))
    stamp = stamp_cost(tmp / "stamp.hb")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = {"benchmark": "step_overhead", "plain_ms": round(1000 * med["plain"], 4)}
    print()
    for name in ("watched", "steps", "train", "watchdog"):
        overhead = (med[name] - med["plain"]) / med["plain"]
        label = "hooks on" if name == "watched" else f"run.{name}()"
        print(f"{label}: {1000 * med[name]:.3f} ms/step against plain {1000 * med['plain']:.3f}: "
              f"overhead {100 * overhead:+.2f}% ({1e6 * (med[name] - med['plain']):.1f} us/step)")
        result.update({f"{name}_ms": round(1000 * med[name], 4),
                       f"{name}_overhead_pct": round(100 * overhead, 2),
                       f"{name}_overhead_us": round(1e6 * (med[name] - med["plain"]), 1)})
    hooked = hooks_cost(tmp / "hooks.jsonl")
    print(f"heartbeat stamp alone: {1e9 * stamp:.0f} ns; the watching hooks alone: "
          f"{1e6 * hooked:.2f} us/step")
    emit({**result, "stamp_ns": round(1e9 * stamp), "hooks_us": round(1e6 * hooked, 2)})


if __name__ == "__main__":
    main()
