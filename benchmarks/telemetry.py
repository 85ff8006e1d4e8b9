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
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from harness import free_port  # noqa: E402

from unbroken.telemetry.events import read_events  # noqa: E402
from unbroken.telemetry.goodput import account  # noqa: E402

MODEL = ["--global-batch", "16", "--seq", "64", "--dim", "64", "--layers", "2",
         "--print-every", "100000"]


def run_once(steps: int, live: bool, workdir: Path) -> tuple[float, int, Path]:
    """One job; returns rank 0's steady-state seconds per step, the scrapes made, run dir."""
    run_dir = workdir / f"run-{'on' if live else 'off'}-{time.monotonic_ns()}"
    flags = ["--status-every", "0"]
    port = free_port()
    if live:
        flags = ["--metrics-port", str(port), "--status-every", "5"]
    cmd = [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node", "2",
           "--run-dir", str(run_dir), *flags, str(REPO / "examples" / "gpt" / "train.py"),
           "--steps", str(steps), *MODEL]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=REPO)
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
        if proc.wait(timeout=900) != 0:
            raise SystemExit(f"the job failed (exit {proc.returncode}); see {run_dir}")
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = read_events(run_dir / "events.jsonl")
    steps0 = [e for e in events if e["event"] == "step" and e.get("slot") == 0]
    kept = steps0[args.skip:]
    per_step = (kept[-1]["t"] - (kept[0]["t"] - kept[0]["duration"])) / len(kept)
    return per_step, scrapes[0], run_dir


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="unbroken-telemetry-bench-") as tmp:
        workdir = Path(tmp)
        rounds = []
        last_on = None
        for r in range(args.rounds):
            pair = {}
            for live in ((False, True) if r % 2 == 0 else (True, False)):
                per_step, scrapes, run_dir = run_once(args.steps, live, workdir)
                pair["on" if live else "off"] = per_step
                if live:
                    pair["scrapes"] = scrapes
                    last_on = run_dir
            pair["ratio"] = pair["on"] / pair["off"]
            rounds.append(pair)
            print(f"round {r + 1}: off {1000 * pair['off']:.2f} ms/step, on "
                  f"{1000 * pair['on']:.2f} ms/step ({pair['scrapes']} scrapes), "
                  f"on/off {pair['ratio']:.4f}", flush=True)
        events = read_events(last_on / "events.jsonl")
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
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--skip", type=int, default=50, help="warm-up steps left out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    main()
