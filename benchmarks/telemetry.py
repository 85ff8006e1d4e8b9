"""What live telemetry costs the training loop: the same job with and without the leader's
Prometheus endpoint, its accounting (re-run every 5 s) and the status line, side by side.

Each round runs the example GPT on 2 workers twice, once with `--status-every 0` and no
`--metrics-port` (nothing live runs), once with `--metrics-port` and `--status-every 5`
while a scraper reads `/metrics` every second (Prometheus's default is every 15 s). Rounds
alternate the order, so that machine noise hits both. The figure is the wall time per step
of rank 0 in steady state (from its events: the first `--skip` steps are left out), so the
loop's work between steps counts too. Also: what one run of the accounting costs per 1,000
events.

    .venv/bin/python benchmarks/telemetry.py

The last line printed is one JSON object holding at least `metrics_overhead_pct`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    alternate,
    emit,
    free_port,
    kill_everything,
    launch,
    temp_root,
    wait_or_kill,
)

sys.path.insert(0, str(REPO / "src"))

from unbroken.telemetry.events import read_events  # noqa: E402
from unbroken.telemetry.goodput import account  # noqa: E402

MODEL = ["--global-batch", "16", "--seq", "64", "--dim", "64", "--layers", "2",
         "--print-every", "100000"]


def run_once(steps: int, skip: int, live: bool, workdir: Path) -> tuple[float, int, Path]:
    """One job; returns rank 0's steady-state seconds per step, the scrapes made, run dir."""
    run_dir = workdir / f"run-{'on' if live else 'off'}-{time.monotonic_ns()}"
    flags = ["--status-every", "0"]
    port = free_port()
    if live:
        flags = ["--metrics-port", str(port), "--status-every", "5"]
    cmd = [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node", "2",
           "--run-dir", str(run_dir), *flags, str(EXAMPLE), "--steps", str(steps), *MODEL]
    proc = launch(cmd, run_dir)
    scrapes, stop = [0], threading.Event()

    def scrape() -> None:
        while not stop.wait(1.0):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    r.read()
                scrapes[0] += 1
            except OSError:
                pass  # not up yet, or gone at the end
    scraper = threading.Thread(target=scrape, daemon=True)
    if live:
        scraper.start()
    try:
        code = wait_or_kill(proc, run_dir, 900)
        if code != 0:
            raise SystemExit(f"the job failed (exit {code}); see {run_dir}")
    finally:
        stop.set()
        kill_everything(proc, run_dir)
    events = read_events(run_dir / "events.jsonl")
    steps0 = [e for e in events if e["event"] == "step" and e.get("slot") == 0]
    kept = steps0[skip:]
    per_step = (kept[-1]["t"] - (kept[0]["t"] - kept[0]["duration"])) / len(kept)
    return per_step, scrapes[0], run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--skip", type=int, default=50, help="warm-up steps left out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    workdir = temp_root("unbroken-telemetry-bench-")
    rounds: list[dict] = [{} for _ in range(args.rounds)]
    last_on: list[Path] = []

    def one_run(side: str, i: int) -> float:
        per_step, scrapes, run_dir = run_once(args.steps, args.skip, side == "on", workdir)
        pair = rounds[i]
        pair[side] = per_step
        if side == "on":
            pair["scrapes"] = scrapes
            last_on.append(run_dir)
        if "on" in pair and "off" in pair:  # the round's second run
            pair["ratio"] = pair["on"] / pair["off"]
            print(f"round {i + 1}: off {1000 * pair['off']:.2f} ms/step, on "
                  f"{1000 * pair['on']:.2f} ms/step ({pair['scrapes']} scrapes), "
                  f"on/off {pair['ratio']:.4f}", flush=True)
        return per_step

    alternate(["off", "on"], args.rounds, one_run)
    events = read_events(last_on[-1] / "events.jsonl")
    t0 = time.perf_counter()
    account(events)
    account_s = time.perf_counter() - t0
    ratio = statistics.median(p["ratio"] for p in rounds)
    result = {
        "metrics_overhead_pct": round(100 * (ratio - 1), 3),
        "step_s_off": round(statistics.median(p["off"] for p in rounds), 6),
        "step_s_on": round(statistics.median(p["on"] for p in rounds), 6),
        "ratios": [round(p["ratio"], 4) for p in rounds],
        "scrapes_per_run": [p["scrapes"] for p in rounds],
        "steps": args.steps, "rounds": args.rounds,
        "account_ms_per_1k_events": round(1000 * account_s / (len(events) / 1000), 3),
        "events_per_run": len(events),
    }
    print(f"telemetry overhead: {result['metrics_overhead_pct']:+.2f}% per step "
          f"(median of {args.rounds} on/off ratios {result['ratios']}); one accounting of "
          f"{len(events)} events: {1000 * account_s:.0f} ms")
    emit(result)


if __name__ == "__main__":
    main()
