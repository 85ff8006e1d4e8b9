"""The control plane on both backends, side by side in one run: the embedded TCPStore (held
by the node-0 agent) and etcd (a separate service, with an elected leader).

1. **Leader host lost.** Three agents on loopback (one worker each, the example GPT),
   trained past step 15; the leader's agent is SIGKILLed (its workers die with it, as with
   the host). The figure is the time from the kill to the first step completed by the job
   that goes on (a later attempt or generation), median of `--tries`. With the TCPStore the
   job is lost (the followers give up after their retry window): `null`.
2. **The control plane at 8 to 2,048 agents** (`sim_agents.py`): simulated followers in 8
   processes, each running the follower's real control look (its watch, its election
   check, its reads, its lease) at the pace of a training node's agent, and the leader's
   real planner, lease watch and claim check. First IDLE_S seconds of nothing: each
   follower's requests per second (its lease included), the leader's, the requests one
   idle leader look makes (asserted equal at every agent count), etcd's CPU. Then a member
   dies and at once every survivor appends its departure: `plan_ms`, the death published
   to the next generation's plan written, split into `writes_ms` (to the last departure
   written: the survivors' cost) and `planner_ms` (from there to the plan). Beside it, on
   etcd, `put_floor_ms`: as many bare puts from 8 processes with no client of ours, the
   floor this machine puts under one write per survivor.
3. **Steady-state step overhead** of etcd: the same 2-node job with no faults on each
   backend, a `--step-sleep` step (50 ms), in alternating rounds; the overhead is the median
   of the rounds' paired ratios, with their spread.

etcd's data directory is on tmpfs (/dev/shm): the figures are the control plane's, not a
disk's fsyncs.

    .venv/bin/python benchmarks/failover.py --tries 5 --rounds 5

The last line printed is one JSON object with the figures (keys named in issues 11 and 29).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    EventTail,
    alternate,
    emit,
    epoch,
    free_port,
    kill_everything,
    launch,
    paired_ratios,
    step_period,
    temp_root,
    track,
)

TINY = ["--global-batch", "8", "--seq", "32", "--dim", "32", "--layers", "1",
        "--print-every", "100000"]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # start_etcd: the tests' one-member etcd

from conftest import start_etcd  # noqa: E402

from unbroken.control.address import BackendKind, ControlAddress, open_backend  # noqa: E402
from unbroken.control.tcp import serve_store  # noqa: E402


# ---------------------------------------------------------------- 1. leader host lost
def _agents(backend: str, endpoint: str, root: Path, steps: int) -> tuple[list, Path]:
    root.mkdir(parents=True)
    run_dir = root / "run"
    port = free_port()
    plane = (["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint] if backend == "etcd"
             else ["--master-port", str(port), "--control-retry-window", "3"])
    # A fresh id per try: a try's killed agents leave their keys in etcd, and a job under
    # the same id would meet them (refused as a dead job's, rightly).
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    procs = [launch([sys.executable, "-m", "unbroken", "run", "--run-dir", str(run_dir),
                     "--nnodes", "3", "--node-rank", str(node), "--rdzv-id", job_id,
                     "--max-restarts", "3", *plane, str(EXAMPLE), "--steps", str(steps), *TINY,
                     "--checkpoint-dir", str(root / "ckpt"), "--checkpoint-every", "10"],
                    run_dir, log=f"agent-{node}.log") for node in range(3)]
    return procs, run_dir


def failover_once(backend: str, endpoint: str, root: Path) -> float | None:
    """Seconds from the leader's agent SIGKILLed to the first step the job then completes;
    None if the job was lost."""
    procs, run_dir = _agents(backend, endpoint, root, steps=100000)
    tail = EventTail(run_dir)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            tail.poll()
            if any(e["event"] == "step" and e["step"] >= 15 for e in tail.events):
                break
            time.sleep(0.05)
        else:
            return None
        leader = next(e["node"] for e in tail.events if e["event"] == "node_set")
        killed_at = time.time()
        os.kill(procs[leader].pid, 9)
        before = max((epoch(e) for e in tail.events if e["event"] == "step"), default=(0, 0))
        survivor = procs[(leader + 1) % 3]
        while time.monotonic() < deadline:
            step = next((e for e in tail.poll() if e["event"] == "step" and e["t"] > killed_at
                         and epoch(e) > before), None)
            if step is not None:
                return step["t"] - killed_at
            if survivor.poll() is not None:
                return None  # the job is lost
            time.sleep(0.005)
        return None
    finally:
        for p in procs:
            kill_everything(p, run_dir)


# ---------------------------------------------------------------- 2. planning latency
IDLE_S = 5.0  # the idle window over which request rates are counted


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plan_latency(backend: str, endpoint: str, n: int, etcd_pid: int | None,
                 procs: int = 8) -> dict[str, float | None]:
    """n simulated followers and the leader, idle for IDLE_S, then one death: the figures
    of part 2 (see the module's docstring)."""
    from sim_agents import Leader, Signals, requests_of, run_followers

    run_id = f"plan{n}-{time.monotonic_ns()}"
    served = None
    if backend == "tcp":
        served, port = serve_store("127.0.0.1", 0, 120)
        endpoint = f"127.0.0.1:{port}"
    Leader.claim(backend, endpoint, run_id)
    ctx = mp.get_context("fork")  # before the leader's threads: a fork copies no thread
    sig = Signals(ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue())
    groups = [list(range(1 + i, n + 1, procs)) for i in range(min(procs, n))]
    children = [ctx.Process(target=run_followers, args=(backend, endpoint, run_id, g, n, sig, n))
                for g in groups]
    for c in children:
        c.start()
    leader = Leader(backend, endpoint, run_id, n)
    try:
        for _ in children:
            sig.ready.get(timeout=600)
        # The idle window starts once the leader's watch is live (at most 30 s; its
        # reconnects are reported): until then its looks read etcd.
        mirror = getattr(getattr(leader.backend.client, "kv", None), "mirror", None)
        settle, live_by = time.monotonic() + 2.0, time.monotonic() + 30.0
        while time.monotonic() < settle or (mirror is not None and not mirror.live
                                            and time.monotonic() < live_by):
            leader.look()
            leader.pace()
        looks0, req0, lease0 = leader.looks, requests_of(leader.backend), requests_of(leader.lease)
        cpu0 = _cpu_s(etcd_pid) if etcd_pid else 0.0
        sig.measure.set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < IDLE_S:
            leader.look()
            leader.pace()
        idle = time.monotonic() - t0
        look_req = requests_of(leader.backend) - req0
        figures: dict[str, float | None] = {
            "leader_look_requests": round(look_req / max(1, leader.looks - looks0), 3),
            "leader_requests_s": round((look_req + requests_of(leader.lease) - lease0) / idle, 2),
            "etcd_cpu_idle": round((_cpu_s(etcd_pid) - cpu0) / idle, 3) if etcd_pid else None}
        if mirror is not None:  # a look that made requests: was the copy live, and if not, why
            figures["leader_watch"] = {"live": mirror.live, "reconnects": mirror.reconnects,
                                       "last_error": mirror.last_error}
        cpu1 = _cpu_s(etcd_pid) if etcd_pid else 0.0
        published = leader.publish_death(n)
        sig.go.set()
        while leader.state.gen == 0:
            leader.look()
            leader.pace()
        planned = time.time()
        figures["etcd_cpu_plan_s"] = round(_cpu_s(etcd_pid) - cpu1, 3) if etcd_pid else None
        sig.stop.set()
        got = [sig.out.get(timeout=120) for _ in children]
        last_left = max(f.last_left for f in got)
        figures.update({
            "plan_ms": round(1000 * (planned - published), 1),
            "writes_ms": round(1000 * max(0.0, last_left - published), 1),
            "planner_ms": round(1000 * max(0.0, planned - last_left), 1),
            "follower_requests_s": round(sum(f.idle_requests for f in got)
                                         / sum(f.idle_s * f.agents for f in got), 3)})
        return figures
    finally:
        sig.stop.set()
        for c in children:
            c.join(30)
            if c.is_alive():
                c.kill()
        leader.close()
        leader.backend.watch(None)
        if backend == "etcd":
            leader.backend.stop_retrying()
            open_backend(ControlAddress(BackendKind.ETCD, (endpoint,)), run_id, 10.0).delete_prefix()
        del served  # closes a TCPStore served here


def put_floor(endpoint: str, n: int, procs: int = 8) -> float:
    """The floor under the survivors' writes on this machine: n - 1 plain puts (300-byte
    values, about a signed `NodeDepartures`) to etcd's JSON gateway from `procs` processes
    at once, each on one kept-alive connection: no signing, no retries, no client of ours.
    Milliseconds from the start signal to the last reply."""
    ctx = mp.get_context("fork")
    go, ready, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    prefix = f"floor/{uuid.uuid4().hex}/"
    host, port = endpoint.rsplit(":", 1)

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    def writer(part: range) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v3/kv/range", json.dumps({"key": b64(prefix)}))
        conn.getresponse().read()  # connected and answered before the start
        ready.put(os.getpid())
        go.wait()
        for i in part:
            conn.request("POST", "/v3/kv/put", json.dumps({"key": b64(f"{prefix}{i}"),
                                                             "value": b64("x" * 300)}))
            conn.getresponse().read()
        out.put(time.time())

    children = [ctx.Process(target=writer, args=(range(1 + i, n, procs),))
                for i in range(min(procs, n - 1))]
    for c in children:
        c.start()
    try:
        for _ in children:
            ready.get(timeout=60)
        t0 = time.time()
        go.set()
        last = max(out.get(timeout=120) for _ in children)
        return round(1000 * (last - t0), 1)
    finally:
        for c in children:
            c.join(10)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        conn.request("POST", "/v3/kv/deleterange",
                     json.dumps({"key": b64(prefix), "range_end": b64(end)}))
        conn.getresponse().read()


# ---------------------------------------------------------------- 3. steady state
def steady_step(backend: str, endpoint: str, root: Path, steps: int,
                model: list[str] = TINY) -> float | None:
    run_dir = root / "run"
    port = free_port()
    plane = (["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint] if backend == "etcd"
             else ["--master-port", str(port)])
    job_id = f"steady-{uuid.uuid4().hex[:8]}"  # fresh: as in _agents
    procs = [launch([sys.executable, "-m", "unbroken", "run", "--run-dir", str(run_dir),
                     "--nnodes", "2", "--node-rank", str(k), "--rdzv-id", job_id, *plane,
                     str(EXAMPLE), "--steps", str(steps), *model],
                    run_dir, log=f"agent-{k}.log") for k in range(2)]
    try:
        for p in procs:
            p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            kill_everything(p, run_dir)
    tail = EventTail(run_dir)
    tail.poll()
    ready = max((e["t"] for e in tail.events if e["event"] == "standby_ready"), default=0.0)
    ends = [e["t"] for e in tail.events if e["event"] == "step" and e["rank"] == 0][50:]
    ends = [t for t in ends if t > ready]
    return step_period(ends)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=5, help="leader kills on etcd (median)")
    p.add_argument("--agents", default="8,64,512,2048", help="simulated agent counts")
    p.add_argument("--rounds", type=int, default=3, help="steady-state rounds per backend")
    p.add_argument("--steady-steps", type=int, default=300)
    p.add_argument("--step-sleep", type=float, default=0.05, help="the steady state's step")
    p.add_argument("--parts", default="failover,plan,steady", help="which parts to run")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    root = temp_root("unbroken-failover-")  # a SIGTERM ends the agents and etcd (harness)
    shm = temp_root("unbroken-etcd-", dir="/dev/shm")  # etcd's data on tmpfs
    etcd = start_etcd("127.0.0.1", shm / "etcd")
    track(etcd.proc)
    fail: dict[str, list] = {"etcd": [], "tcp": []}
    plan: dict[str, dict[str, dict]] = {"etcd": {}, "tcp": {}}
    steady: dict[str, list] = {"etcd": [], "tcp": []}
    try:
        def show_fail(i: int, backend: str, t: float | None) -> None:
            print(f"failover try {i + 1} {backend:4s} "
                  + (f"{t:.3f}s" if t is not None else "job lost"), flush=True)

        if "failover" in parts:  # the TCPStore loses the job every time: one try shows it
            fail = alternate(["etcd", "tcp"], args.tries,
                             lambda backend, i: failover_once(backend, etcd.endpoint,
                                                              root / f"fail-{backend}-{i}"),
                             tries={"tcp": 1}, report=show_fail)
        for n in (int(x) for x in args.agents.split(",") if "plan" in parts):
            for backend in ("tcp", "etcd"):
                got = plan_latency(backend, etcd.endpoint, n,
                                   etcd.proc.pid if backend == "etcd" else None)
                if backend == "etcd":
                    got["put_floor_ms"] = put_floor(etcd.endpoint, n)
                plan[backend][str(n)] = got
                print(f"planning {backend:4s} {n:5d} agents: fault -> plan {got['plan_ms']:8.1f} ms"
                      f" (survivors' writes {got['writes_ms']:8.1f} ms, planner "
                      f"{got['planner_ms']:6.1f} ms); idle: follower "
                      f"{got['follower_requests_s']:.2f} req/s, leader "
                      f"{got['leader_requests_s']:.2f} req/s, "
                      f"{got['leader_look_requests']} req/look; etcd CPU idle "
                      f"{got['etcd_cpu_idle']}, planning {got['etcd_cpu_plan_s']} s"
                      + (f"; {n - 1} bare puts {got['put_floor_ms']} ms"
                         if "put_floor_ms" in got else "")
                      + (f"; leader's watch {got['leader_watch']}" if got.get("leader_watch")
                         else ""), flush=True)

        def show_steady(i: int, backend: str, t: float | None) -> None:
            print(f"steady round {i + 1} {backend:4s} "
                  + (f"{1000 * t:.2f} ms/step" if t else "FAILED"), flush=True)

        if "steady" in parts:
            model = [*TINY, "--step-sleep", str(args.step_sleep)]
            steady = alternate(["tcp", "etcd"], args.rounds,
                               lambda backend, i: steady_step(backend, etcd.endpoint,
                                                              root / f"steady-{backend}-{i}",
                                                              args.steady_steps, model),
                               report=show_steady)
    finally:
        etcd.stop()

    def median(values: list[float | None]) -> float | None:
        """None if any try lost the job (or there was none)."""
        ok = [v for v in values if v is not None]
        return round(statistics.median(ok), 3) if ok and len(ok) == len(values) else None

    pairs = paired_ratios(steady["tcp"], steady["etcd"])
    overhead = round(100 * statistics.median(pairs), 2) if pairs else None
    spread = [round(100 * min(pairs), 2), round(100 * max(pairs), 2)] if pairs else None
    print(f"failover median: etcd {median(fail['etcd'])}s over {len(fail['etcd'])} tries, "
          f"tcpstore {median(fail['tcp'])} (null: the job is lost with node 0)")
    print(f"steady state at a {1000 * args.step_sleep:.0f} ms step: etcd costs {overhead}% "
          f"(paired rounds, spread {spread})")
    etcd_plan, tcp_plan = plan["etcd"], plan["tcp"]
    looks = {n: f["leader_look_requests"] for n, f in etcd_plan.items()}
    if len(set(looks.values())) > 1:
        raise SystemExit(f"an idle look's requests grow with the agents: {looks}")
    biggest = max(etcd_plan, key=int, default=None)
    emit({
        "etcd": {"failover_median_s": median(fail["etcd"]), "failover_s": fail["etcd"],
                 "plan_ms": {n: f["plan_ms"] for n, f in etcd_plan.items()},
                 "writes_ms": {n: f["writes_ms"] for n, f in etcd_plan.items()},
                 "planner_ms": {n: f["planner_ms"] for n, f in etcd_plan.items()},
                 "put_floor_ms": {n: f["put_floor_ms"] for n, f in etcd_plan.items()},
                 "idle_requests_per_agent_s": etcd_plan[biggest]["follower_requests_s"]
                 if biggest else None,
                 "leader_requests_s": etcd_plan[biggest]["leader_requests_s"] if biggest else None,
                 "idle_look_requests": looks,
                 "cpu_idle": {n: f["etcd_cpu_idle"] for n, f in etcd_plan.items()},
                 "cpu_plan_s": {n: f["etcd_cpu_plan_s"] for n, f in etcd_plan.items()},
                 "data_dir": "tmpfs"},
        "tcpstore": {"failover_median_s": median(fail["tcp"]),
                     "plan_ms": {n: f["plan_ms"] for n, f in tcp_plan.items()},
                     "writes_ms": {n: f["writes_ms"] for n, f in tcp_plan.items()},
                     "planner_ms": {n: f["planner_ms"] for n, f in tcp_plan.items()},
                     "idle_requests_per_agent_s": {n: f["follower_requests_s"]
                                                   for n, f in tcp_plan.items()}},
        "etcd_step_overhead_pct": overhead, "etcd_step_overhead_spread_pct": spread,
        "step_s": steady,
    })


if __name__ == "__main__":
    main()
