"""The node agent: `unbroken run`. One per node; the node-0 agent is the leader.

Each attempt is one generation of worker processes. The leader opens it (`current`), every
agent joins, the leader publishes the plan (ranks, a fresh worker store), every agent starts
its workers and watches them. The first fault anyone sees is published once (compare-and-set)
and ends the attempt everywhere; the leader then opens the next attempt, until the restart
budget is spent. The agent never imports the user's code.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from unbroken.errors import PEER_ERROR_MARKERS, ControlPlaneError, ExitCode
from unbroken.launch.config import LaunchConfig
from unbroken.launch.control_store import ControlStore, connect_store, serve_store
from unbroken.launch.drain import CONTROL_FILE
from unbroken.launch.generations import GenerationPlanner
from unbroken.launch.hang_detector import HangDetector
from unbroken.launch.orphan_guard import OrphanGuard
from unbroken.launch.spare_board import SpareBoard, SpareBroker
from unbroken.launch.warm_pool import WarmPool, normal_priority
from unbroken.launch.worker_process import (
    WorkerProcess,
    describe_exit,
    open_pidfd,
    read_error,
    script_argv,
    signal_group,
    spawn,
    stop_workers,
    worker_command,
)
from unbroken.runtime.heartbeat import (
    PHASE_RECOVERY,
    PHASE_SPARE_READY,
    PHASE_TRAINING,
    HeartbeatReader,
)
from unbroken.telemetry.events import EVENTS_FILE, EventLog

_STORE_ERRORS = (RuntimeError, OSError)  # what a TCPStore call raises when the server is gone


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Finished(Exception):
    """The leader published the run's result."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result.get("status"))
        self.result = result


@dataclass
class Outcome:
    kind: str  # "done" or "fault"
    fault: dict[str, Any] | None = None


class Agent:
    def __init__(self, cfg: LaunchConfig, out: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self.out = out
        self.instance = uuid.uuid4().hex[:12]
        self.node_dir = Path(cfg.run_dir) / f"node_{cfg.node_rank}"
        self.events = EventLog(
            Path(cfg.run_dir) / EVENTS_FILE, source="agent", node=cfg.node_rank
        )
        self.workers: list[WorkerProcess] = []
        self._guard: OrphanGuard | None = None
        self._pool: WarmPool | None = None
        self._signal: int | None = None
        self._servers: list[Any] = []  # keeps per-attempt worker stores alive
        self._hb_stop = threading.Event()
        self._node_seen: dict[int, tuple[int, float]] = {}
        self._lost: set[int] = set()  # followers lost in the current attempt
        self.ctl: ControlStore | None = None
        self.control_port = cfg.master_port
        self._plan: dict[str, Any] | None = None  # the leader's current plan
        self._recovered = 0  # faults recovered in place (they spend the restart budget too)
        self._replacements = 0
        self._give_up = False
        self._hang_quiet_until = 0.0
        # Dead workers to replace: (worker, when it died, its peers' generation then).
        self._pending: list[tuple[WorkerProcess, float, int]] = []
        self.spares: list[WorkerProcess] = []  # hot spares of this node: warm, unassigned
        self._incarnations: dict[int, int] = {}  # slot -> its latest replacement's number
        self._targets_written: dict[int, Any] = {}  # pid -> the switch request it was given
        self._spares_started = 0  # numbers spare worker ids
        self._spare_failures = 0
        # A standby node runs only spares, as many as it has devices.
        self._spare_target = cfg.nproc_per_node if cfg.standby else cfg.spares
        self._board: SpareBoard | None = None
        self._broker: SpareBroker | None = None  # the leader's view of every node's spares
        self._released: set[int] = set()  # followers whose every rank was drained away

    # ---------------------------------------------------------------- entry point
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        cfg = self.cfg
        self.events.emit(
            "agent_start", run_id=cfg.run_id, pid=os.getpid(), nnodes=cfg.nnodes,
            nproc_per_node=cfg.nproc_per_node, max_restarts=cfg.max_restarts,
            script=cfg.script, args=cfg.script_args, faults=cfg.faults, instance=self.instance,
        )
        self.say(f"run {cfg.run_id}: events in {Path(cfg.run_dir) / EVENTS_FILE}")
        try:
            self._guard = OrphanGuard()
            if cfg.warm_restarts and not cfg.no_python:
                self._pool = WarmPool(cfg.nproc_per_node, self._standby_env(), self._guard)
            self._connect()
            code = self._lead() if cfg.is_leader else self._follow()
        except _Interrupted as exc:
            self.say(f"{exc}: stopping workers")
            self._stop_workers()
            self._publish_interrupt(exc.signum)
            code = 128 + exc.signum
        except ControlPlaneError as exc:
            self._stop_workers()
            self.events.emit("agent_error", error=str(exc))
            self.events.emit("agent_exit", code=int(exc.exit_code))
            raise
        finally:
            self._stop_workers()
            if self._pool is not None:
                self._pool.close()
            if self._guard is not None:
                self._guard.close()
            self._hb_stop.set()
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.events.emit("agent_exit", code=int(code))
        self.events.close()
        return int(code)

    def say(self, msg: str) -> None:
        print(f"[unbroken node {self.cfg.node_rank}] {msg}", file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise _Interrupted(self._signal)

    # ---------------------------------------------------------------- control plane
    def _connect(self) -> None:
        cfg = self.cfg
        if cfg.is_leader:
            store, self.control_port = serve_store(cfg.master_addr, cfg.master_port, cfg.rdzv_timeout)
            self._servers.append(store)  # control_port is the real one when --master-port was 0
            # Where `unbroken drain RUN_DIR` finds the job.
            control = Path(cfg.run_dir) / CONTROL_FILE
            control.parent.mkdir(parents=True, exist_ok=True)
            tmp = control.with_suffix(".tmp")
            tmp.write_text(json.dumps({"addr": cfg.master_addr, "port": self.control_port,
                                       "run_id": cfg.run_id}))
            tmp.replace(control)
        else:
            store = self._connect_with_retries()
        self.ctl = ControlStore(store, cfg.run_id)
        if not cfg.is_leader:
            threading.Thread(target=self._heartbeat_loop, daemon=True, name="agent-hb").start()

    def _connect_with_retries(self) -> Any:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.rdzv_timeout
        while True:
            self._check_signal()
            try:
                return connect_store(cfg.master_addr, cfg.master_port, timeout=2.0)
            except ControlPlaneError:
                if time.monotonic() > deadline:
                    raise

    def _heartbeat_loop(self) -> None:
        """Proves this agent alive to the leader; own connection, so a busy main loop can't stall it."""
        cfg = self.cfg
        try:
            ctl = ControlStore(connect_store(cfg.master_addr, cfg.master_port, 10.0), cfg.run_id)
            period = max(0.05, min(1.0, cfg.node_timeout / 5))
            while not self._hb_stop.wait(period):
                ctl.add(f"hb/{cfg.node_rank}/{self.instance}", 1)
        except (ControlPlaneError, *_STORE_ERRORS):
            return  # the main loop sees the lost store on its next call

    def _store(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except _STORE_ERRORS as exc:
            raise ControlPlaneError(
                f"lost the control store at {self.cfg.master_addr}:{self.cfg.master_port} "
                f"(node-0 agent gone?): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None

    def _get(self, key: str) -> Any:
        return self._store(self.ctl.get_json, key)

    def _set(self, key: str, value: Any) -> None:
        self._store(self.ctl.set_json, key, value)

    def _sleep(self, seconds: float = 0.02) -> None:
        time.sleep(seconds)
        self._check_signal()

    # ---------------------------------------------------------------- leader
    def _lead(self) -> int:
        cfg = self.cfg
        attempt = 0
        while True:
            t0 = time.monotonic()
            self._set("current", attempt)
            self._join(attempt)
            nodes = self._wait_joined(attempt)
            plan = self._make_plan(attempt, nodes)
            self._plan = plan
            self._set(f"a/{attempt}/plan", plan)
            self.events.emit(
                "rendezvous", attempt=attempt, world_size=plan["world_size"],
                duration=round(time.monotonic() - t0, 6), worker_port=plan["worker_port"],
            )
            outcome = self._run_attempt(attempt, plan)
            if outcome.kind == "done":
                self._set(f"a/{attempt}/done/{cfg.node_rank}", True)
                outcome = self._leader_wait_all_done(attempt, plan)
            if outcome.kind == "done":
                self._set("result", {"status": "success", "attempt": attempt})
                self.say(f"all {plan['world_size']} workers finished (attempts: {attempt + 1})")
                self._wait_acks(plan)
                return ExitCode.SUCCESS
            self._end_attempt(attempt, outcome.fault)
            self._wait_stopped(attempt, plan)
            self._release_worker_store()
            if self._give_up or attempt + self._recovered >= cfg.max_restarts:
                self._set("result", {"status": "failed", "fault": outcome.fault})
                self._report_failure(outcome.fault)
                self._wait_acks(plan)
                return ExitCode.WORKERS_FAILED
            attempt += 1
            self.events.emit("restart", attempt=attempt, restarts_left=cfg.max_restarts - attempt,
                             reason=outcome.fault.get("kind") if outcome.fault else None)
            self.say(f"restarting all workers: attempt {attempt} of at most {cfg.max_restarts + 1}")

    def _wait_joined(self, attempt: int) -> dict[int, dict[str, Any]]:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.rdzv_timeout
        told = False
        while True:
            nodes = {k: self._get(f"a/{attempt}/node/{k}") for k in range(cfg.nnodes)}
            if all(nodes.values()):
                return nodes
            if not told and time.monotonic() > deadline - cfg.rdzv_timeout + 3:
                missing = [k for k, v in nodes.items() if not v]
                self.say(f"waiting up to {cfg.rdzv_timeout:g}s for node(s) {missing} to join")
                told = True
            if time.monotonic() > deadline:
                missing = [k for k, v in nodes.items() if not v]
                raise ControlPlaneError(
                    f"node(s) {missing} did not join within {cfg.rdzv_timeout:g}s; start their "
                    f"agents with --nnodes {cfg.nnodes} and the same --master-addr/--master-port/--rdzv-id"
                )
            self._sleep()

    def _make_plan(self, attempt: int, nodes: dict[int, dict[str, Any]]) -> dict[str, Any]:
        store, worker_port = serve_store(self.cfg.master_addr, 0, self.cfg.rdzv_timeout)
        self._servers.append(store)
        offset, layout = 0, {}
        for k in range(self.cfg.nnodes):
            layout[str(k)] = {"offset": offset, "nproc": nodes[k]["nproc"],
                              "instance": nodes[k]["instance"]}
            offset += nodes[k]["nproc"]
        self._node_seen.clear()
        self._lost.clear()
        return {"attempt": attempt, "world_size": offset, "nodes": layout,
                "worker_port": worker_port}

    def _release_worker_store(self) -> None:
        """Close the ended attempt's worker store (the control store is _servers[0])."""
        del self._servers[1:]  # the last reference: the store closes its port

    def _check_nodes(self, attempt: int, plan: dict[str, Any]) -> dict[str, Any] | None:
        """A node_lost fault for the first follower whose agent stopped heartbeating."""
        now = time.monotonic()
        instances = {int(k): node["instance"] for k, node in plan["nodes"].items()}
        if self._broker is not None:
            instances.update(self._broker.standbys)
        for k, instance in instances.items():
            if k == self.cfg.node_rank or k in self._lost or k in self._released:
                continue
            count = self._store(self.ctl.add, f"hb/{k}/{instance}", 0)
            last = self._node_seen.get(k)
            if last is None or last[0] != count:
                self._node_seen[k] = (count, now)
            elif now - last[1] > self.cfg.node_timeout:
                if self._get(f"a/{attempt}/released/{k}"):
                    self._released.add(k)  # drained, then left on purpose
                    continue
                self._lost.add(k)
                detail = f"agent of node {k} silent for {now - last[1]:.1f}s"
                self.events.emit("node_lost", attempt=attempt, lost_node=k, detail=detail)
                self.say(f"node {k} lost: {detail}")
                return {"kind": "node_lost", "node": k, "rank": None, "detail": detail}
        return None

    def _replace_node(self, attempt: int, lost: dict[str, Any], planner: GenerationPlanner) -> bool:
        """Hand a lost node's ranks to ready spares elsewhere (a standby node), in place.

        Only when there is a ready spare for every rank it ran: a job that would shrink by
        a whole node restarts instead, and waits for the node to come back.
        """
        k = lost["node"]
        hosted = {wid: slot for wid, slot in self._broker.hosted(k).items() if wid in planner.members}
        if len(self._broker.ready(avoid={k})) < len(hosted):
            return False
        for wid, slot in sorted(hosted.items(), key=lambda item: item[1]):
            self._publish_death(attempt, {**lost, "rank": slot, "slot": slot, "wid": wid,
                                          "attempt": attempt, "t": time.time()})
        self.say(f"node {k} lost: its rank(s) {sorted(hosted.values())} go to spares in place")
        return True

    def _publish_death(self, attempt: int, fault: dict[str, Any]) -> None:
        """A member died: tell the leader's planner (in place), and record the fault."""
        index = self._store(self.ctl.add, f"a/{attempt}/deaths", 1) - 1
        self._set(f"a/{attempt}/death/{index}", fault)
        self._store(self.ctl.add, f"a/{attempt}/news", 1)
        self.events.emit("fault", **{k: v for k, v in fault.items() if k != "t"}, in_place=True)

    def _node_finished(self, attempt: int, k: int) -> bool:
        return (k in self._lost or k in self._released
                or bool(self._get(f"a/{attempt}/done/{k}")) or bool(self._get(f"a/{attempt}/released/{k}")))

    def _leader_wait_all_done(self, attempt: int, plan: dict[str, Any]) -> Outcome:
        # A standby node that took ranks over must finish them too.
        standbys = [k for k in (self._broker.standbys if self._broker else {})
                    if self._broker.hosted(k)]
        while True:
            fault = self._get(f"a/{attempt}/fault")
            if fault:
                return Outcome("fault", fault)
            if all(self._node_finished(attempt, int(k)) for k in [*plan["nodes"], *standbys]):
                return Outcome("done")
            lost = self._check_nodes(attempt, plan)
            if lost:
                return Outcome("fault", self._publish_fault(attempt, lost))
            self._sleep()

    def _wait_stopped(self, attempt: int, plan: dict[str, Any]) -> None:
        """Wait until every live follower has stopped its workers of this attempt."""
        deadline = time.monotonic() + self.cfg.kill_grace + self.cfg.node_timeout
        pending = {int(k) for k in plan["nodes"]} - {self.cfg.node_rank} - self._released
        if self._broker is not None:
            pending |= set(self._broker.standbys)
        while pending and time.monotonic() < deadline:
            pending = {k for k in pending if not self._get(f"a/{attempt}/stopped/{k}")}
            self._check_nodes(attempt, plan)
            pending -= self._lost
            if pending:
                self._sleep()

    def _wait_acks(self, plan: dict[str, Any]) -> None:
        """Keep the store up until the followers have read the result (bounded)."""
        deadline = time.monotonic() + 5.0
        followers = {int(k) for k in plan["nodes"]} - {self.cfg.node_rank} - self._released - self._lost
        if self._broker is not None:
            followers |= set(self._broker.standbys) - self._lost
        while followers and time.monotonic() < deadline:
            followers = {k for k in followers if not self._get(f"ack/{k}")}
            if followers:
                time.sleep(0.02)

    # ---------------------------------------------------------------- follower
    def _follow(self) -> int:
        seen = -1
        while True:
            try:
                attempt = self._wait_next_attempt(seen)
                seen = attempt
                self._join(attempt)
                plan = self._wait_plan(attempt)
                if plan is None:
                    continue
                outcome = self._run_attempt(attempt, plan)
                if outcome.kind == "done" and self._all_drained(attempt):
                    self._set(f"a/{attempt}/released/{self.cfg.node_rank}", True)
                    self.events.emit("node_drained", attempt=attempt)
                    self.say("every rank of this node moved to spares: leaving the job")
                    self._stop_workers()
                    return ExitCode.SUCCESS
                if outcome.kind == "done":
                    self._set(f"a/{attempt}/done/{self.cfg.node_rank}", True)
                    outcome = self._follower_wait(attempt)
                self._end_attempt(attempt, outcome.fault)
            except _Finished as fin:
                try:
                    self._set(f"ack/{self.cfg.node_rank}", True)
                except ControlPlaneError:
                    pass  # the leader has already gone; the result is what counts
                status = fin.result.get("status")
                if status == "success":
                    self.say("job finished")
                    return ExitCode.SUCCESS
                if status == "interrupted":
                    self.say("the node-0 agent was interrupted; stopping")
                    return 128 + int(fin.result.get("signal", signal.SIGTERM))
                self._report_failure(fin.result.get("fault"))
                return ExitCode.WORKERS_FAILED

    def _all_drained(self, attempt: int) -> bool:
        return bool(self.workers) and all(self._get(f"a/{attempt}/drained/{w.wid}") for w in self.workers)

    def _finished(self) -> None:
        result = self._get("result")
        if result:
            raise _Finished(result)

    def _wait_next_attempt(self, seen: int) -> int:
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        while True:
            self._finished()
            current = self._get("current")
            if current is not None and current > seen:
                return int(current)
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"the node-0 agent opened no new attempt within {self.cfg.rdzv_timeout:g}s"
                )
            self._sleep()

    def _wait_plan(self, attempt: int) -> dict[str, Any] | None:
        """The plan for this attempt, or None if it already runs without this agent."""
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        while True:
            self._finished()
            plan = self._get(f"a/{attempt}/plan")
            if plan is not None:
                if self.cfg.standby:
                    return plan  # not in the plan: its spares wait to be handed a rank
                mine = plan["nodes"].get(str(self.cfg.node_rank), {})
                return plan if mine.get("instance") == self.instance else None
            current = self._get("current")
            if current is not None and current > attempt:
                return None
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"no plan for attempt {attempt} within {self.cfg.rdzv_timeout:g}s")
            self._sleep()

    def _follower_wait(self, attempt: int) -> Outcome:
        while True:
            self._finished()
            fault = self._get(f"a/{attempt}/fault")
            if fault:
                return Outcome("fault", fault)
            self._sleep()

    # ---------------------------------------------------------------- both roles
    def _join(self, attempt: int) -> None:
        if self.cfg.standby:
            SpareBoard(self.ctl, attempt, self.cfg.node_rank).join_as_standby(self.instance)
            return
        info = {"nproc": self.cfg.nproc_per_node, "instance": self.instance, "pid": os.getpid(),
                "host": os.uname().nodename}
        self._store(self.ctl.first_json, f"a/{attempt}/node/{self.cfg.node_rank}", info)

    def _publish_fault(self, attempt: int, fault: dict[str, Any]) -> dict[str, Any]:
        fault = {**fault, "attempt": attempt, "t": time.time(), "reported_by": self.cfg.node_rank}
        won = self._store(self.ctl.first_json, f"a/{attempt}/fault", fault)
        if won.get("t") == fault["t"] and won.get("reported_by") == fault["reported_by"]:
            self.events.emit("fault", **{k: v for k, v in won.items() if k != "t"})
            where = f"rank {won['rank']}" if won.get("rank") is not None else f"node {won.get('node')}"
            self.say(f"fault: {where} {won['kind']}: {won['detail']}")
        return won

    def _publish_interrupt(self, signum: int) -> None:
        if self.ctl is None:
            return
        try:
            if self.cfg.is_leader:
                self.ctl.set_json("result", {"status": "interrupted", "signal": signum})
                if self._plan is not None:
                    self._wait_acks(self._plan)
            else:
                current = self.ctl.get_json("current")
                if current is not None:
                    self._publish_fault(current, {
                        "kind": "agent_stopped", "node": self.cfg.node_rank, "rank": None,
                        "detail": f"agent received {signal.Signals(signum).name}",
                    })
        except (ControlPlaneError, *_STORE_ERRORS):
            pass  # the leader is gone too; nothing left to tell

    def _end_attempt(self, attempt: int, fault: dict[str, Any] | None) -> None:
        t0 = time.monotonic()
        self._stop_workers()
        self._set(f"a/{attempt}/stopped/{self.cfg.node_rank}", True)
        self.events.emit("workers_stopped", attempt=attempt, duration=round(time.monotonic() - t0, 6),
                         reason=(fault or {}).get("kind"))

    def _stop_workers(self) -> None:
        for group in (self.workers, self.spares):
            if group:
                stop_workers(group, self.cfg.kill_grace)
                for w in group:
                    self._guard.forget(w.pid)
                    w.close()
        self.workers, self.spares = [], []

    def _spawn(self, attempt: int, plan: dict[str, Any]) -> None:
        attempt_dir = self.node_dir / f"attempt_{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        for stale in attempt_dir.glob("rank_*"):  # a reused run dir: old errors or beats would lie
            if stale.suffix != ".log":
                stale.unlink(missing_ok=True)
        if self.cfg.standby:
            return  # only spares
        node = plan["nodes"][str(self.cfg.node_rank)]
        for local_rank in range(node["nproc"]):
            rank = node["offset"] + local_rank
            self._spawn_worker(attempt, plan, rank, local_rank, f"{rank}.0", joining=False)

    def _spawn_worker(self, attempt: int, plan: dict[str, Any], rank: int, local_rank: int,
                      wid: str, joining: bool) -> WorkerProcess:
        """Start one worker (from a warm standby when there is one) and watch it."""
        cfg = self.cfg
        node = plan["nodes"][str(cfg.node_rank)]
        incarnation = wid.split(".")[1]
        name = f"rank_{rank}" if incarnation == "0" else f"rank_{rank}-r{incarnation}"
        base = self.node_dir / f"attempt_{attempt}" / name
        env = self._worker_env(attempt, plan, rank, local_rank, node["nproc"], base)
        env.update({"UNBROKEN_WORKER_ID": wid, "UNBROKEN_SLOT": str(rank),
                    "UNBROKEN_JOIN": "1" if joining else "0"})
        log = base.with_suffix(".log") if cfg.redirect else None
        argv = script_argv(cfg.script, cfg.script_args, cfg.module)
        proc = self._pool.take(env, argv, log) if self._pool is not None else None
        if proc is None:
            cmd = worker_command(cfg.script, cfg.script_args, cfg.module, cfg.no_python)
            proc = spawn(cmd, env, log)
            self._guard.watch(proc.pid)  # its process group: the worker and its children
        worker = WorkerProcess(
            rank=rank, local_rank=local_rank, proc=proc,
            heartbeat=HeartbeatReader(base.with_suffix(".hb")),
            hang=HangDetector(cfg.hang_timeout, cfg.startup_timeout),
            error_file=base.with_suffix(".error.json"), wid=wid,
        )
        worker.pidfd = open_pidfd(proc.pid)
        self.workers.append(worker)
        return worker

    # ---------------------------------------------------------------- hot spares
    def _spawn_spare(self, attempt: int, plan: dict[str, Any]) -> WorkerProcess:
        """A hot spare: the user's script in the spare role, warming up at idle priority."""
        cfg = self.cfg
        self._spares_started += 1
        wid = f"spare{cfg.node_rank}-{self._spares_started}"
        base = self.node_dir / f"attempt_{attempt}" / wid
        # On a standby node each spare has a device of its own; elsewhere spares share one.
        taken = {p.local_rank for p in (*self.spares, *self.workers) if p.proc.poll() is None}
        local_rank = (next((i for i in range(cfg.nproc_per_node) if i not in taken), 0)
                      if cfg.standby else 0)
        env = self._worker_env(attempt, plan, -1, local_rank, cfg.nproc_per_node, base)
        env.update({"UNBROKEN_WORKER_ID": wid, "UNBROKEN_SLOT": "-1", "UNBROKEN_JOIN": "1",
                    "UNBROKEN_ROLE": "spare"})
        log = base.with_suffix(".log") if cfg.redirect else None
        proc = spawn(worker_command(cfg.script, cfg.script_args, cfg.module, cfg.no_python), env, log)
        self._guard.watch(proc.pid)
        _idle_priority(proc.pid)
        spare = WorkerProcess(rank=-1, local_rank=local_rank, proc=proc,
                              heartbeat=HeartbeatReader(base.with_suffix(".hb")),
                              hang=HangDetector(cfg.hang_timeout, cfg.startup_timeout),
                              error_file=base.with_suffix(".error.json"), wid=wid)
        spare.pidfd = open_pidfd(proc.pid)
        self.spares.append(spare)
        self.events.emit("spare_started", wid=wid, pid=proc.pid)
        return spare

    def _tend_spares(self, attempt: int, plan: dict[str, Any], training: bool) -> None:
        """Replace spares that died; keep the pool at --spares once training runs."""
        for spare in [s for s in self.spares if s.proc.poll() is not None]:
            self.spares.remove(spare)
            self._guard.forget(spare.pid)
            error = read_error(spare.error_file)
            detail = f"{error['type']}: {error['message']}" if error else describe_exit(spare.proc.returncode)[1]
            self.events.emit("spare_lost", wid=spare.wid, exit_code=spare.proc.returncode, detail=detail)
            self.say(f"spare {spare.wid} failed ({detail})")
            spare.close()
            self._spare_failures += 1
        if not training or len(self.spares) >= self._spare_target:
            return
        if self._spare_failures > 3 * max(1, self._spare_target):
            return  # a script that cannot warm up as a spare: stop trying (said above)
        while len(self.spares) < self._spare_target:
            self._spawn_spare(attempt, plan)

    def _ready_spares(self) -> list[WorkerProcess]:
        ready = []
        for spare in self.spares:
            beat = spare.heartbeat.read()
            if spare.proc.poll() is None and beat is not None and beat.phase == PHASE_SPARE_READY:
                ready.append(spare)
        return ready

    def _promote(self, spare: WorkerProcess, slot: int, local_rank: int,
                 selector: selectors.BaseSelector, by: str = "agent") -> None:
        """Put a ready spare into a slot: the same rank, so nothing else moves."""
        self.spares.remove(spare)
        normal_priority(spare.pid)
        spare.rank, spare.local_rank = slot, local_rank
        spare.hang = HangDetector(self.cfg.hang_timeout, self.cfg.startup_timeout)
        spare.heartbeat.promote(slot)
        self.workers.append(spare)
        if spare.pidfd is not None:
            selector.register(spare.pidfd, selectors.EVENT_READ, spare)
        self.events.emit("spare_promoted", wid=spare.wid, slot=slot, pid=spare.pid, by=by)

    def _serve_board(self, board: SpareBoard, selector: selectors.BaseSelector) -> None:
        """Offer this node's ready spares and hosted members; promote what the leader asks."""
        ready = self._ready_spares()
        for request in board.requests() if self._spare_target else []:  # no spares, no requests
            spare = next((p for p in ready if p.wid == request["spare"]), None)
            if spare is None:  # died, or promoted here in the meantime: the planner's wait is bounded
                self.events.emit("spare_request_declined", wid=request["spare"], slot=request["slot"])
                continue
            ready.remove(spare)
            self._promote(spare, request["slot"], spare.local_rank, selector, by="leader")
        board.offer([p.wid for p in ready])
        board.host({w.wid: w.rank for w in self.workers if w.proc.returncode in (None, 0)})

    def _standby_env(self) -> dict[str, str]:
        """What a standby imports torch under: the workers' environment without rank or attempt."""
        env = dict(os.environ)
        env["UNBROKEN_AGENT_PID"] = str(os.getpid())
        env["UNBROKEN_RUN_DIR"] = str(Path(self.cfg.run_dir).resolve())
        env["UNBROKEN_NODE_RANK"] = str(self.cfg.node_rank)
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if self.cfg.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _maybe_fill_pool(self, spawned_at: float) -> None:
        """Warm the next attempt's workers once this attempt is training, not during its start-up."""
        pool = self._pool
        if pool is None or pool.full:
            return
        # Only once every worker has timed a step of this attempt: warming up during a
        # restart's resume would slow the very recovery the pool is there to speed up.
        training = all(w.hang.timed_steps > 0 for w in self.workers)
        no_heartbeats = all(w.hang.last_beat is None for w in self.workers)
        if training or (no_heartbeats and time.monotonic() - spawned_at > 10.0):
            started = pool.fill()
            if started:
                self.events.emit("standbys_started", count=started)

    def _worker_env(self, attempt: int, plan: dict[str, Any], rank: int, local_rank: int,
                    local_world: int, base: Path) -> dict[str, str]:
        cfg = self.cfg
        env = dict(os.environ)
        env.update({
            # The same variables torchrun sets, so unmodified torchrun scripts run as they are.
            "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(plan["world_size"]), "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(cfg.node_rank), "GROUP_WORLD_SIZE": str(cfg.nnodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(plan["world_size"]), "ROLE_NAME": "default",
            "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(plan["worker_port"]),
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            "TORCHELASTIC_RUN_ID": cfg.run_id,
            # Workers connect to the agent's fresh per-attempt store as clients; no worker hosts it.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": str(base.with_suffix(".torchelastic.json")),
            # unbroken's own: the runtime and fault injection read these.
            "UNBROKEN_RUN_ID": cfg.run_id, "UNBROKEN_RUN_DIR": str(Path(cfg.run_dir).resolve()),
            "UNBROKEN_NODE_RANK": str(cfg.node_rank), "UNBROKEN_ATTEMPT": str(attempt),
            "UNBROKEN_HEARTBEAT_FILE": str(base.with_suffix(".hb")),
            "UNBROKEN_ERROR_FILE": str(base.with_suffix(".error.json")),
            "UNBROKEN_AGENT_PID": str(os.getpid()),
            "UNBROKEN_CONTROL_ADDR": cfg.master_addr, "UNBROKEN_CONTROL_PORT": str(self.control_port),
            "UNBROKEN_FAULTS": cfg.faults,
            "UNBROKEN_IN_PLACE": "0" if cfg.on_fault == "restart" else "1",
            # A worker's own bound on waiting for a plan: past every bound of the leader's.
            "UNBROKEN_RECOVERY_TIMEOUT": str(2 * cfg.recovery_timeout + cfg.join_timeout),
        })
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if local_world > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: no oversubscription
        return env

    def _run_attempt(self, attempt: int, plan: dict[str, Any]) -> Outcome:
        """Start this node's workers and watch them until they all finish or a fault ends the attempt.

        Once every worker runs the resilient loop (its heartbeat names a generation), a
        worker's death no longer ends the attempt: it is published for the leader's
        `GenerationPlanner`, a replacement is started, and the survivors recover in place.
        """
        t0 = time.monotonic()
        self._pending.clear()  # replacements for an ended attempt's workers are not needed
        self._spawn(attempt, plan)
        self.events.emit("workers_started", attempt=attempt, duration=round(time.monotonic() - t0, 6),
                         pids={w.rank: w.pid for w in self.workers})
        if self.cfg.standby:
            self.say(f"attempt {attempt}: standing by with {self._spare_target} spare(s)")
        elif attempt == 0 or self.cfg.is_leader:
            ranks = [w.rank for w in self.workers]
            self.say(f"attempt {attempt}: started ranks {ranks[0]}-{ranks[-1]} of {plan['world_size']}")
        selector = selectors.DefaultSelector()
        for w in self.workers:
            if w.pidfd is not None:
                selector.register(w.pidfd, selectors.EVENT_READ, w)
        peer_errors_since: float | None = None
        multi = len(plan["nodes"]) > 1 or self.cfg.standby
        in_place = self.cfg.on_fault != "restart" and not self.cfg.no_python
        # Latched once every worker runs the resilient loop; a standby node has only spares.
        resilient = self.cfg.standby
        self._board = SpareBoard(self.ctl, attempt, self.cfg.node_rank) if in_place else None
        self._broker = (SpareBroker(self.ctl, attempt, [int(k) for k in plan["nodes"]])
                        if in_place and self.cfg.is_leader else None)
        self._released.clear()
        planner = self._planner(attempt, plan) if in_place and self.cfg.is_leader else None
        target = None
        try:
            while True:
                fast = planner is not None and planner.busy
                selector.select(timeout=0.002 if fast else self.cfg.monitor_interval)
                self._check_signal()
                if in_place and not resilient:
                    resilient = self._all_resilient()
                failed = []
                for w in list(self.workers):
                    rc = w.proc.poll()
                    if rc == 0:
                        if w.pidfd is not None and w.pidfd in selector.get_map():
                            selector.unregister(w.pidfd)
                    elif (rc is not None and rc != 0) or (rc is None and w.error_file.exists()):
                        if w.pidfd is not None and w.pidfd in selector.get_map():
                            selector.unregister(w.pidfd)  # or select() spins during the grace
                        if resilient:
                            self._worker_died(attempt, plan, w, selector)
                        else:
                            failed.append(w)  # raised: report now, not after interpreter teardown
                if failed:
                    # A peer's death reaches the survivors' sockets before the kernel lets us
                    # reap the dead process; give the root cause a moment to show itself.
                    if all(_blame(w) == _PEER_ERROR for w in failed):
                        peer_errors_since = peer_errors_since or time.monotonic()
                    if time.monotonic() - (peer_errors_since or 0.0) >= _ROOT_CAUSE_GRACE or any(
                            _blame(w) != _PEER_ERROR for w in failed):
                        return Outcome("fault", self._publish_fault(attempt, self._exit_fault(failed)))
                hung = self._find_hang()
                if hung is not None and not resilient:
                    return Outcome("fault", self._publish_fault(attempt, hung))
                if planner is not None and resilient:
                    verdict = planner.tick(self._max_step)
                    if verdict is not None:
                        self._recovered = planner.recovered
                        if verdict.action == "give_up":
                            self._give_up = True
                        return Outcome("fault", self._publish_fault(attempt, verdict.fault))
                    self._recovered = planner.recovered
                if resilient:
                    target = self._mirror_target(attempt, target, planner)
                    self._start_replacements(attempt, plan, selector)
                    if self._spare_target:
                        self._tend_spares(attempt, plan, self._training())
                    if self._board is not None:
                        self._store(self._serve_board, self._board, selector)
                if self._broker is not None and self._store(self._broker.refresh):
                    multi = True  # a standby node joined: watch it like the others
                if multi:
                    self._finished()
                    remote = self._get(f"a/{attempt}/fault")
                    if remote:
                        return Outcome("fault", remote)
                    if self.cfg.is_leader:
                        lost = self._check_nodes(attempt, plan)
                        if lost and not (planner is not None and resilient
                                         and self._replace_node(attempt, lost, planner)):
                            return Outcome("fault", self._publish_fault(attempt, lost))
                if self.cfg.standby and not self.workers:
                    pass  # a standby node is done when the ranks it took over are
                elif all(w.proc.returncode == 0 for w in self.workers):
                    self.events.emit("workers_done", attempt=attempt)
                    return Outcome("done")
                self._maybe_fill_pool(t0)
        finally:
            selector.close()

    # ---------------------------------------------------------------- in place
    def _planner(self, attempt: int, plan: dict[str, Any]) -> GenerationPlanner:
        cfg = self.cfg
        return GenerationPlanner(
            self.ctl, attempt, {f"{r}.0": r for r in range(plan["world_size"])},
            policy=cfg.on_fault, recovery_timeout=cfg.recovery_timeout,
            join_timeout=cfg.join_timeout, budget=cfg.max_restarts - attempt - self._recovered,
            record=self.events.emit, say=self.say, broker=self._broker,
        )

    def _training(self) -> bool:
        """Every worker is stepping (not starting or recovering): spares may warm up now."""
        if self.cfg.standby and not self.workers:
            return True  # nothing of the job's runs here: spares may warm up now
        beats = [w.heartbeat.read() for w in self.workers if w.proc.returncode is None]
        return bool(beats) and all(b is not None and b.phase == PHASE_TRAINING and b.step >= 0
                                   for b in beats)

    def _all_resilient(self) -> bool:
        beats = [w.heartbeat.read() for w in self.workers]
        return bool(beats) and all(b is not None and b.generation >= 0 for b in beats)

    def _max_step(self) -> int:
        steps = [b.step for w in self.workers
                 if w.proc.returncode is None and (b := w.heartbeat.read()) is not None]
        return max(steps, default=0)

    def _mirror_target(self, attempt: int, seen: Any, planner: GenerationPlanner | None) -> Any:
        """Hand the leader's switch request to this node's workers through their heartbeat page."""
        target = planner.target if planner is not None else self._get(f"a/{attempt}/target")
        if target is None:
            return target
        for w in self.workers:
            if self._targets_written.get(w.pid) == target:
                continue
            beat = w.heartbeat.read()
            # Not yet in a generation (a replacement, a promoted spare that has not read its
            # slot from this very field): it joins by plan; the request would only overwrite
            # the promotion. It gets the request once it is in.
            if beat is not None and beat.generation >= 0:
                w.heartbeat.set_target(target["gen"], target["step"])
                self._targets_written[w.pid] = target
        return target

    def _worker_died(self, attempt: int, plan: dict[str, Any], w: WorkerProcess,
                     selector: selectors.BaseSelector) -> None:
        """Publish a dead worker for the planner and start its replacement; peers go on."""
        # Its whole process group, its children included; it raised and is on its way out,
        # or it is already dead: either way, don't wait for it.
        signal_group(w.proc, signal.SIGKILL)
        try:
            w.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel; the orphan guard still holds its group
        fault = w.fault or self._exit_fault([w])
        fault = {**fault, "wid": w.wid, "slot": w.rank, "attempt": attempt, "t": time.time()}
        ready = self._ready_spares() if self._replacements < self.cfg.max_restarts else []
        spare = ready[0] if ready else None
        if spare is not None:
            fault["spare"] = spare.wid  # the planner waits for it instead of shrinking
            self._replacements += 1
            self._promote(spare, w.rank, w.local_rank, selector)
        self._publish_death(attempt, fault)
        self.say(f"fault: rank {w.rank} {fault['kind']}: {fault['detail']} (recovering in place)")
        self.workers.remove(w)
        self._guard.forget(w.pid)
        w.close()
        if spare is not None:
            return  # the spare took the slot; the pool refills once training runs again
        if self._replacements >= self.cfg.max_restarts:
            return  # the planner will give up or shrink; a crash loop must not spawn forever
        if self.cfg.standby:
            return  # a standby node starts no fresh workers: the leader finds another spare
        self._replacements += 1
        beats = [b for p in self.workers if (b := p.heartbeat.read()) is not None]
        self._pending.append((w, time.monotonic(), max((b.generation for b in beats), default=0)))

    def _start_replacements(self, attempt: int, plan: dict[str, Any],
                            selector: selectors.BaseSelector) -> None:
        """Start the replacements of dead workers once this node's survivors have switched.

        Under "shrink" nobody waits for a replacement, and on a busy machine its start-up
        (a script's imports, model build) would slow the survivors' recovery; so it starts
        when they are training again, or after `_REPLACEMENT_DELAY` at the latest. Under
        "wait" the survivors wait for it: it starts at once.
        """
        if not self._pending:
            return
        now = time.monotonic()
        beats = [w.heartbeat.read() for w in self.workers]
        for entry in list(self._pending):
            dead, since, gen = entry
            # The survivors are training in a generation newer than the one the death broke
            # (right after a death they still train in the old one, unaware of it).
            switched = all(b is not None and b.generation > gen and b.phase != PHASE_RECOVERY
                           for b in beats)
            if not (self.cfg.on_fault == "wait" or switched or now - since > _REPLACEMENT_DELAY):
                continue
            self._pending.remove(entry)
            # The slot's next incarnation (a promoted spare's wid names no slot).
            incarnation = self._incarnations.get(dead.rank, 0) + 1
            self._incarnations[dead.rank] = incarnation
            t0 = time.monotonic()
            new = self._spawn_worker(attempt, plan, dead.rank, dead.local_rank,
                                     f"{dead.rank}.{incarnation}", joining=True)
            if new.pidfd is not None:
                selector.register(new.pidfd, selectors.EVENT_READ, new)
            self.events.emit("replacement_started", slot=dead.rank, wid=new.wid, pid=new.pid,
                             duration=round(time.monotonic() - t0, 6),
                             after=round(now - since, 6))

    def _exit_fault(self, failed: list[WorkerProcess]) -> dict[str, Any]:
        """Describe the most likely culprit among workers that exited non-zero together."""
        w = min(failed, key=_blame)
        code = w.proc.returncode
        kind, detail = describe_exit(code) if code is not None else ("exception", "raised")
        fault: dict[str, Any] = {"kind": kind, "rank": w.rank, "node": self.cfg.node_rank,
                                 "pid": w.pid, "exit_code": code, "detail": detail}
        error = read_error(w.error_file)
        if error:
            fault.update(kind="exception", detail=f"{error['type']}: {error['message']}",
                         traceback=error["traceback"][-4000:])
        beat = w.heartbeat.read()
        if beat is not None:
            fault["step"] = beat.step
        return fault

    def _find_hang(self) -> dict[str, Any] | None:
        now = time.monotonic()
        if now < self._hang_quiet_until:
            return None  # peers of a worker just killed for hanging are still unblocking
        beating, overdue = [], []
        for w in self.workers:
            if w.proc.returncode is not None:
                continue
            beat = w.heartbeat.read()
            if beat is None:
                continue
            w.hang.observe(beat)
            beating.append(w)
            if w.hang.overdue(now) is not None:
                overdue.append(w)
        if not overdue:
            return None
        # Once anyone is overdue, its peers are usually blocked on the culprit (each worker's
        # timeout is calibrated on its own, so a victim can time out first). A stopped
        # process is the culprit; otherwise the overdue worker silent the longest.
        stopped = [w for w in beating if _is_stopped(w.pid)]
        w = stopped[0] if stopped else min(overdue, key=lambda w: w.hang.last_beat.monotonic)
        timeout = w.hang.overdue(now) or w.hang.step_timeout()
        beat = w.hang.last_beat
        os.kill(w.pid, signal.SIGKILL)  # reaped, with a bound, by stop_workers
        # Its peers were blocked on it and are as silent; once it is dead their collectives
        # fail at once. Give them that moment before judging them (recovering in place).
        self._hang_quiet_until = now + _HANG_QUIET
        w.fault = {"kind": "hang", "rank": w.rank, "node": self.cfg.node_rank, "pid": w.pid,
                "step": beat.step, "silent_for": round(now - beat.monotonic, 3),
                "hang_started": round(time.time() - (now - beat.monotonic), 6),
                "timeout": round(timeout, 3),
                "detail": f"no heartbeat for {now - beat.monotonic:.1f}s (timeout {timeout:.1f}s); killed"}
        return w.fault

    def _report_failure(self, fault: dict[str, Any] | None) -> None:
        fault = fault or {}
        where = f"rank {fault['rank']}" if fault.get("rank") is not None else f"node {fault.get('node')}"
        self.say(f"giving up after {self.cfg.max_restarts} restart(s): last fault was {where} "
                 f"{fault.get('kind')}: {fault.get('detail')}")
        if fault.get("traceback"):
            print(fault["traceback"].rstrip(), file=self.out, flush=True)


_ROOT_CAUSE_GRACE = 0.5  # seconds to wait for a root cause when only peer errors are seen
_HANG_QUIET = 3.0  # after a hang kill, seconds before another worker may be declared hung
def _idle_priority(pid: int) -> None:
    """A spare warms up on CPU that training leaves idle (SCHED_IDLE; needs root)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass  # not permitted: it warms up at normal priority


_REPLACEMENT_DELAY = 2.0  # "shrink": start a replacement by then even if survivors still switch
_PEER_ERROR = 2


def _blame(w: WorkerProcess) -> int:
    """0: killed by a signal (a root cause); 1: its own error; 2: an error caused by a peer."""
    if w.proc.returncode is not None and w.proc.returncode < 0:
        return 0
    error = read_error(w.error_file)
    if error is None:
        return 1 if w.proc.returncode not in (None, 0) else _PEER_ERROR
    tb = error.get("traceback", "")
    return _PEER_ERROR if any(m in tb for m in PEER_ERROR_MARKERS) else 1


def _is_stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
