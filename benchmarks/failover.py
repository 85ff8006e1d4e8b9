"""The control plane on both backends, side by side in one run: the embedded TCPStore (held
by the node-0 agent) and etcd (a separate service, with an elected leader).

1. **Leader host lost.** Three agents on loopback (one worker each, the example GPT),
   trained past step 15; the leader's agent is SIGKILLed (its workers die with it, as with
   the host). The figure is the time from the kill to the first step completed by the job
   that goes on (a later attempt or generation), median of `--tries`. With the TCPStore the
   job is lost (the followers give up after their retry window): `null`.
2. **Planning latency** with 1, 8, 64 and 512 simulated agents: light processes that speak
   the protocol (each agent keeps its liveness lease and hosts one member), against the real
   `LeaseWatch` and `PlanExecutor` looking as the leader does (every 50 ms idle, 2 ms busy).
   A member dies; at the same instant every survivor writes its departure (as survivors
   whose collective failed do). The figure is the time from the death published to the
   next generation's plan written: `plan_ms`; `planner_ms` is the planner's own share,
   from the last departure written to the plan.
3. **Steady-state step overhead** of etcd: the same 2-node job with no faults on each
   backend, alternating rounds; median time between rank 0's steps.

    .venv/bin/python benchmarks/failover.py --tries 5

The last line printed is one JSON object with the figures (keys named in issue 11).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    EventTail,
    alternate,
    change_pct,
    emit,
    epoch,
    free_port,
    kill_everything,
    launch,
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
from unbroken.control.channel import Channel  # noqa: E402
from unbroken.control.lease import LeaseWatch  # noqa: E402
from unbroken.control.messages import Departure, Fault, FaultKind, LeaveReason  # noqa: E402
from unbroken.control.schema import AttemptKeys, agent_lease  # noqa: E402
from unbroken.control.signing import Signer  # noqa: E402
from unbroken.control.tcp import serve_store  # noqa: E402
from unbroken.launch.budget import RestartBudget  # noqa: E402
from unbroken.launch.plan_executor import PlanExecutor  # noqa: E402
from unbroken.launch.planner import PlannerConfig, initial_state  # noqa: E402

SECRET = b"b" * 32
LEASE_PERIOD = 2.0  # a follower's, at the default --node-timeout of 10 s


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
def _address(backend: str, endpoint: str) -> ControlAddress:
    return ControlAddress(BackendKind(backend), (endpoint,))


def _simulated_agents(backend: str, endpoint: str, run_id: str, nodes: list[int], dead: int,
                      go: mp.Event, done: mp.Queue, stop: mp.Event, ready: mp.Queue,
                      threads: int = 16) -> None:
    """Agents `nodes`, each with a lease and one member (`<node>.0`); on `go`, every one
    of them leaves generation 0 (the dead member excepted), `threads` at a time, each on a
    connection of its own, as agents on separate hosts would."""
    open_ = lambda: Channel(open_backend(_address(backend, endpoint), run_id, 10.0),  # noqa: E731
                            Signer(SECRET))
    ch = open_()
    g = AttemptKeys(0).gen(0)
    leavers = [k for k in nodes if k != dead]
    parts = [leavers[i::threads] for i in range(min(threads, len(leavers)))]
    channels = [open_() for _ in parts]
    for k in nodes:
        ch.backend.refresh_lease(agent_lease(k, f"sim{k}").key)
    ready.put(os.getpid())  # connected (not part of the latency measured)

    def leave(channel: Channel, part: list[int]) -> None:
        for k in part:
            channel.append(g.departures, Departure(wid=f"{k}.0", gen=0, step=10,
                                                  holds_state=True, reason=LeaveReason.PEER,
                                                  t=time.time()))

    next_refresh = 0.0
    left = False
    while not stop.is_set():
        if time.monotonic() >= next_refresh:
            for k in nodes:
                ch.backend.refresh_lease(agent_lease(k, f"sim{k}").key)
            next_refresh = time.monotonic() + LEASE_PERIOD
        if not left and go.wait(0.01):
            workers = [threading.Thread(target=leave, args=(c, p))
                       for c, p in zip(channels, parts, strict=True)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            done.put(time.time())
            left = True


def plan_latency(backend: str, endpoint: str, n: int, procs: int = 4) -> tuple[float, float]:
    """(fault published -> plan written, last departure -> plan written), in ms."""
    run_id = f"plan{n}-{time.monotonic_ns()}"
    served = None
    if backend == "tcp":
        served, port = serve_store("127.0.0.1", 0, 60)
        endpoint = f"127.0.0.1:{port}"
    ch = Channel(open_backend(_address(backend, endpoint), run_id, 10.0), Signer(SECRET))
    world = n + 1  # slot 0 on the leader's own node, slots 1..n on the simulated agents
    state = initial_state(0, world, {k: [k] for k in range(world)}, RestartBudget(10))
    executor = PlanExecutor(ch, state, PlannerConfig(), lambda *a, **k: None, lambda s: None)
    leases = LeaseWatch(ch.backend)
    ctx = mp.get_context("fork")
    go, stop, done, ready = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    groups = [list(range(1 + i, world, procs)) for i in range(min(procs, n))]
    children = [ctx.Process(target=_simulated_agents, args=(backend, endpoint, run_id, g, n,
                                                            go, done, stop, ready)) for g in groups]
    for c in children:
        c.start()
    keys = AttemptKeys(0)
    try:
        for _ in children:
            ready.get(timeout=120)
        watched = [agent_lease(k, f"sim{k}") for k in range(1, world)]
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:  # idle looks, as the leader makes them
            leases.silent_many(watched, time.monotonic())
            executor.look(lambda: 10, [], [])
            time.sleep(0.05)
        published = time.time()
        ch.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=n, slot=n, wid=f"{n}.0", node=n,
                                     attempt=0, in_place=True, t=published))
        go.set()
        ch.append(keys.gen(0).departures, Departure(wid="0.0", gen=0, step=10, holds_state=True,
                                                   reason=LeaveReason.PEER, t=time.time()))
        while executor.state.gen == 0:
            leases.silent_many(watched, time.monotonic())
            executor.look(lambda: 10, [], [])
            time.sleep(0.002 if executor.state.busy else 0.05)
        planned = time.time()
        last_left = max(done.get(timeout=60) for _ in children)
        return 1000 * (planned - published), 1000 * max(0.0, planned - last_left)
    finally:
        stop.set()
        for c in children:
            c.join(10)
        del served  # closes a TCPStore served here
        if backend == "etcd":
            ch.backend.delete_prefix()


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
    p.add_argument("--agents", default="1,8,64,512", help="simulated agent counts")
    p.add_argument("--rounds", type=int, default=3, help="steady-state rounds per backend")
    p.add_argument("--steady-steps", type=int, default=500)
    args = p.parse_args()
    root = temp_root("unbroken-failover-")  # a SIGTERM ends the agents and etcd (harness)
    etcd = start_etcd("127.0.0.1", root / "etcd")
    track(etcd.proc)
    try:
        def show_fail(i: int, backend: str, t: float | None) -> None:
            print(f"failover try {i + 1} {backend:4s} "
                  + (f"{t:.3f}s" if t is not None else "job lost"), flush=True)

        # The TCPStore loses the job every time: one try shows it.
        fail = alternate(["etcd", "tcp"], args.tries,
                         lambda backend, i: failover_once(backend, etcd.endpoint,
                                                          root / f"fail-{backend}-{i}"),
                         tries={"tcp": 1}, report=show_fail)
        plan: dict[str, dict[str, float | None]] = {"etcd": {}, "tcp": {}}
        planner: dict[str, dict[str, float | None]] = {"etcd": {}, "tcp": {}}
        for n in (int(x) for x in args.agents.split(",")):
            for backend in ("tcp", "etcd"):
                total, own = plan_latency(backend, etcd.endpoint, n)
                plan[backend][str(n)], planner[backend][str(n)] = round(total, 1), round(own, 1)
                print(f"planning {backend:4s} {n:4d} agents: fault -> plan {total:7.1f} ms "
                      f"(planner's own share {own:6.1f} ms)", flush=True)

        def show_steady(i: int, backend: str, t: float | None) -> None:
            print(f"steady round {i + 1} {backend:4s} "
                  + (f"{1000 * t:.2f} ms/step" if t else "FAILED"), flush=True)

        steady = alternate(["tcp", "etcd"], args.rounds,
                           lambda backend, i: steady_step(backend, etcd.endpoint,
                                                          root / f"steady-{backend}-{i}",
                                                          args.steady_steps),
                           reverse=False, report=show_steady)
    finally:
        etcd.stop()

    def median(values: list[float | None]) -> float | None:
        """None if any try lost the job (or there was none)."""
        ok = [v for v in values if v is not None]
        return round(statistics.median(ok), 3) if ok and len(ok) == len(values) else None

    tcp_ok = [t for t in steady["tcp"] if t is not None]
    etcd_ok = [t for t in steady["etcd"] if t is not None]
    tcp_step = statistics.median(tcp_ok) if tcp_ok else None
    etcd_step = statistics.median(etcd_ok) if etcd_ok else None
    overhead = change_pct(etcd_step, tcp_step) if tcp_step and etcd_step else None
    print(f"failover median: etcd {median(fail['etcd'])}s over {len(fail['etcd'])} tries, "
          f"tcpstore {median(fail['tcp'])} (null: the job is lost with node 0)")
    print(f"steady state: tcpstore {1000 * (tcp_step or 0):.2f} ms/step, etcd "
          f"{1000 * (etcd_step or 0):.2f} ms/step: etcd overhead {overhead}%")
    emit({
        "etcd": {"failover_median_s": median(fail["etcd"]), "failover_s": fail["etcd"],
                 "plan_ms": plan["etcd"], "planner_ms": planner["etcd"]},
        "tcpstore": {"failover_median_s": median(fail["tcp"]), "plan_ms": plan["tcp"],
                     "planner_ms": planner["tcp"]},
        "etcd_step_overhead_pct": overhead,
        "step_s": {"tcpstore": tcp_step, "etcd": etcd_step},
    })


if __name__ == "__main__":
    main()
