"""What the worker runtime costs a step: a plain loop against `run.steps()`, in one process.

The runtime's per-step work is a heartbeat stamp (two stores into a shared page), the fault
check, and one event line appended to the log. Both loops train the example GPT on the
same batches; rounds alternate so that machine noise hits both.

    .venv/bin/python benchmarks/step_overhead.py

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt"))
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from data import CharCorpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

from unbroken.runtime.heartbeat import HeartbeatWriter  # noqa: E402


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


def with_runtime(corpus: CharCorpus, steps: int, run_dir: Path) -> float:
    import unbroken

    os.environ["UNBROKEN_RUN_DIR"] = str(run_dir)
    os.environ["UNBROKEN_HEARTBEAT_FILE"] = str(run_dir / "rank_0.hb")
    run = unbroken.init()
    model, optimizer = _setup(corpus)
    run.track(model, optimizer)
    t0 = time.perf_counter()
    for step in run.steps(steps):
        loss = _train_step(model, optimizer, corpus, step)
        run.log(loss=loss)
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
    corpus = CharCorpus.load()
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-bench-overhead-"))
    plain_times, runtime_times = [], []
    plain(corpus, 20)  # warm caches and lazy imports for both
    for r in range(args.rounds):
        pairs = [("plain", plain), ("runtime", with_runtime)]
        for name, fn in pairs if r % 2 == 0 else pairs[::-1]:
            t = fn(corpus, args.steps) if name == "plain" else fn(corpus, args.steps, tmp / f"r{r}")
            (plain_times if name == "plain" else runtime_times).append(t)
            print(f"round {r + 1} {name:8s} {1000 * t:.3f} ms/step", flush=True)
    stamp = stamp_cost(tmp / "stamp.hb")
    p_med, r_med = statistics.median(plain_times), statistics.median(runtime_times)
    overhead = (r_med - p_med) / p_med
    print(f"\nplain loop {1000 * p_med:.3f} ms/step, with the runtime {1000 * r_med:.3f} ms/step: "
          f"overhead {100 * overhead:+.2f}% ({1e6 * (r_med - p_med):.1f} us/step)")
    print(f"heartbeat stamp alone: {1e9 * stamp:.0f} ns")
    print(json.dumps({"benchmark": "step_overhead", "plain_ms": round(1000 * p_med, 4),
                      "runtime_ms": round(1000 * r_med, 4), "overhead_pct": round(100 * overhead, 2),
                      "overhead_us": round(1e6 * (r_med - p_med), 1), "stamp_ns": round(1e9 * stamp)}))


if __name__ == "__main__":
    main()
