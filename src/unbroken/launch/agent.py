"""The node agent: `unbroken run`. One per node; the node-0 agent is the leader.

This module only sets the agent up and picks its role: it makes first contact with the job
(`first_contact.FirstContact`: serves or connects to the control store, agrees on signing),
keeps this agent's liveness lease, handles SIGINT/SIGTERM, and turns the role's end
into an exit code. The roles are `leader.Leader` and `follower.Follower`; both watch their
node's processes through `attempt.AttemptWatch` and `supervisor.NodeSupervisor`. The agent
never imports the user's code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from unbroken.control.address import ControlAddress, open_backend
from unbroken.control.backend import Fenced
from unbroken.control.channel import Channel
from unbroken.control.messages import Fault
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import STANDBY_IDS, agent_lease, standby_id
from unbroken.control.signing import Signer
from unbroken.control.worker_env import WorkerEnv, node_dir
from unbroken.errors import ControlPlaneError, ExitCode
from unbroken.launch import returning
from unbroken.launch.attempt import AttemptWatch
from unbroken.launch.config import LaunchConfig
from unbroken.launch.drain import CONTROL_FILE
from unbroken.launch.election import FIRST_CLAIM_WAIT, Deposed, Elected, Election, HandedOver
from unbroken.launch.failure_report import root_cause_report
from unbroken.launch.first_contact import FirstContact
from unbroken.launch.follower import Follower
from unbroken.launch.leader.leader import Leader
from unbroken.launch.node_telemetry import check_node, start_event_copy, start_node_metrics
from unbroken.launch.workers.fork_client import ForkServer
from unbroken.launch.workers.orphan_guard import OrphanGuard
from unbroken.launch.workers.supervisor import NodeSupervisor
from unbroken.launch.workers.worker_spawn import launcher_defaults, nccl_overrides
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EVENTS_FILE, EventLog
from unbroken.telemetry.node_export import NodeTelemetry


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Agent:
    def __init__(self, cfg: LaunchConfig, out: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self.out = out
        self.instance = uuid.uuid4().hex[:12]
        self.events = EventLog(Path(cfg.run_dir) / EVENTS_FILE, source="agent", node=cfg.node_rank)
        self._signal: int | None = None
        self._handoff_until: float | None = None  # SIGTERM: ranks moving to spares until then
        self._lease_stop = threading.Event()
        self.role: Leader | Follower | None = None
        self._secret: bytes | None = None  # as found at first contact; None: unsigned
        self._kept: object = None  # a handed-over lead's worker store, open until the end
        self.metrics: NodeTelemetry | None = None  # the node's /metrics (--metrics-port)

    def run(self, restore_signals: bool = True) -> int:
        """Run this node's part of the job to its end; returns the agent's exit code.
        `restore_signals`: put the previous SIGINT/SIGTERM handlers back on the way out.
        A process that exits right after (the CLI) passes False, so that a signal after the
        job's outcome is known (a pod of a finished Job ended by Kubernetes as its node
        exits) cannot turn a success into 143: the outcome stands, the signal is noted."""
        handled = self.cfg.signals or (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        cfg = self.cfg
        self.events.emit(ev.AgentStart(
            run_id=cfg.run_id, pid=os.getpid(), nnodes=cfg.nnodes,
            nproc_per_node=cfg.nproc_per_node, max_restarts=cfg.recovery.max_restarts,
            script=cfg.script, args=cfg.script_args, faults=cfg.faults, instance=self.instance,
        ))
        self.say(f"run {cfg.run_id}: events in {Path(cfg.run_dir) / EVENTS_FILE}")
        for line in nccl_overrides(cfg):
            self.say(line)
        if (refused := check_node(cfg, self.events, self.say)) is not None:
            self.events.emit(ev.AgentExit(code=int(refused), events_dropped=self.events.dropped))
            self.events.close()
            for s, handler in previous.items() if restore_signals else ():
                signal.signal(s, handler)
            return refused
        guard, forks, sup = OrphanGuard(), None, None
        code: int | None = None  # None in the finally: leaving by an exception
        self.metrics = start_node_metrics(cfg, self.events, self.say)
        copy = start_event_copy(cfg, self.events, self.instance, self.say)
        try:
            channel, address = self._connect()
            self._return_as_standby(channel)
            # After the connection: a node rank given in join order is known by now. Not with
            # --virtual-local-rank: a library that touches CUDA at import would see every device.
            forks = self._fork_server(guard)
            sup = NodeSupervisor(cfg, self.events, self.say, guard, forks, address, self._secret)
            watch = AttemptWatch(cfg, channel, sup, self.events, self.say, self._check_signal)
            election = None
            leads = cfg.is_leader
            if cfg.elects:
                election = Election(channel, cfg.node_rank, self.instance, cfg.etcd.leader_timeout,
                                    min(FIRST_CLAIM_WAIT, cfg.rdzv_timeout))
                # A standby node does not stand at start (the job's nodes lead first) but
                # watches the leader as every follower does, and can take over.
                leads = not cfg.standby and election.stand(first=cfg.is_leader).instance \
                    == self.instance
                if leads and not cfg.is_leader:
                    self.say(f"node 0 did not claim the lead within {election.first_wait:g}s: "
                             f"node {cfg.node_rank} leads the job")
            args = (cfg, channel, watch, self.events, self.instance, self._sleep,
                    self._report_failure, election, self.metrics)
            code = self._play(Leader if leads else Follower, args)
            if self._handoff_until and code == ExitCode.DRAINED:
                self.say("SIGTERM: this node's ranks moved to spares; the job goes on without it")
                code = 128 + signal.SIGTERM
        except _Interrupted as exc:
            self.say(f"{exc}: stopping workers")
            held = sup is not None and bool(sup.workers)
            if sup is not None:
                sup.stop_all()
            self._publish_interrupt(exc.signum, held)
            code = 128 + exc.signum
        except ControlPlaneError as exc:
            if sup is not None:
                sup.stop_all()
            if isinstance(exc, (Deposed, Fenced)):
                self.events.emit(ev.LeaderDeposed(error=str(exc)))
            self.events.emit(ev.AgentError(error=str(exc)))
            self.events.emit(ev.AgentExit(code=int(exc.exit_code),
                             events_dropped=self.events.dropped))
            raise
        finally:
            self._lease_stop.set()  # first: a lease refresh racing shutdown would look lost
            if sup is not None:
                sup.close()
            if forks is not None:
                forks.close()
            guard.close()
            if self.metrics is not None:
                self.metrics.close()
            for s, handler in previous.items() if restore_signals else ():
                signal.signal(s, handler)
            if code is None:
                if copy is not None:
                    copy.close()
                self.events.close()  # reports the events a full disk cost
        if self._signal is not None and code != 128 + self._signal:
            self.say(f"signal {self._signal} came after the job's end: exit {code} stands")
        self.events.emit(ev.AgentExit(code=int(code), events_dropped=self.events.dropped))
        if copy is not None:
            copy.close()  # after the agent's last event
        self.events.close()
        return int(code)

    def _play(self, role: type[Leader] | type[Follower], args: tuple[Any, ...]) -> int:
        """Run the agent's role to the job's end, switching roles where leadership moves:
        a follower that wins an election leads from where it was; a leader that handed its
        lead over (to drain its own node) follows its attempt on (`HandedOver`; what it
        hands back, the attempt's worker store, is kept open until the agent ends)."""
        change: Elected | HandedOver | None = None
        while True:
            self.role = role(*args)
            if self.metrics is not None:
                self.metrics.export.set_role("leader" if role is Leader else
                                             "standby" if self.cfg.standby else "follower")
            try:
                if isinstance(self.role, Leader):
                    return self.role.run(takeover=change if isinstance(change, Elected) else None)
                return self.role.run(handed=change if isinstance(change, HandedOver) else None)
            except Elected as elected:
                role, change = Leader, elected
            except HandedOver as handed:
                self._kept = handed.keep
                role, change = Follower, handed

    def _return_as_standby(self, channel: Channel) -> None:
        """A node whose job went on without it (`returning`: a recreated pod) joins as a
        standby node, under a standby id of its own, holding spares for the next loss."""
        cfg = self.cfg
        if cfg.standby or not cfg.in_place or cfg.single_node or cfg.joins_freely:
            return
        if not returning.went_on_without(channel, cfg.node_rank, cfg.nnodes,
                                         2 * cfg.node_timeout + 5, self._sleep):
            return
        old = cfg.node_rank
        cfg.node_rank = standby_id(cfg.nnodes, channel.claim(STANDBY_IDS))
        cfg.standby = True
        self.events.context["node"] = cfg.node_rank
        self.events.emit(ev.NodeReturned(returned_node=old, standby_node=cfg.node_rank))
        self.say(f"node {old}'s ranks went on elsewhere while it was away: rejoining as standby "
                 f"node {cfg.node_rank}")

    def say(self, msg: str) -> None:
        print(f"[unbroken node {self.cfg.node_rank}] {msg}", file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    def _check_signal(self) -> None:
        """Called at every look: a signal stops the agent (`_Interrupted`), except a first
        SIGTERM while this node trains in place, which is a notice (a pod deletion, a spot
        reclaim): the role asks for the node's ranks to move to ready spares, and the agent
        goes on until they have (the role then returns) or --shutdown-timeout passes."""
        signum = self._signal
        if signum is None:
            return
        if signum == signal.SIGTERM and self.role is not None:
            if self._handoff_until is None:
                self._handoff_until = time.monotonic() + self.cfg.kill_grace
                self.events.emit(ev.Notice(signal="SIGTERM", grace=self.cfg.kill_grace))
                if self.role.hand_off():
                    return
                self._handoff_until = 0.0
            elif time.monotonic() < self._handoff_until and self.role.hand_off_pending():
                return
        raise _Interrupted(signum)

    def _sleep(self, seconds: float = 0.02) -> None:
        time.sleep(seconds)
        self._check_signal()

    # ---------------------------------------------------------------- control plane
    def _forged(self, key: str, why: str) -> None:
        """A control message that fails its signature check: rejected, and reported."""
        self.events.emit(ev.ForgedMessage(key=key, reason=why))
        self.say(f"rejected a forged control message at {key} ({why})")

    def _connect(self) -> tuple[Channel, ControlAddress]:
        """The control channel, and where the workers reach the control plane: the first
        contact with the job (`first_contact.FirstContact`: the store served or reached, the
        signing agreed, the node rank taken). Every agent keeps a liveness lease from here on."""
        contact = FirstContact(self.cfg, self.events, self.say, self.instance, self._sleep,
                               self._check_signal, self._control_lost, self._control_back)
        backend, address = contact.connect()
        self._secret = contact.secret
        self._write_control_file(address)
        threading.Thread(target=self._keep_lease, args=(address,), daemon=True,
                         name="agent-lease").start()
        signer = Signer(self._secret) if self._secret is not None else None
        return Channel(backend, signer, self._forged), address

    def _control_lost(self, error: str) -> None:
        self.events.emit(ev.ControlPlaneLost(error=error))
        self.say(f"lost the control plane ({error}); retrying for up to "
                 f"{self.cfg.retry_window:g}s")

    def _control_back(self, outage: float) -> None:
        self.events.emit(ev.ControlPlaneBack(outage=round(outage, 3)))
        self.say(f"the control plane is back after {outage:.1f}s")
        if self.role is not None:
            self.role.outage_ended = True

    def _write_control_file(self, address: ControlAddress) -> None:
        """Where `unbroken drain RUN_DIR` finds the job, on this agent's host (every agent
        writes one: the address is the job's, whichever node leads)."""
        control = Path(self.cfg.run_dir) / CONTROL_FILE
        control.parent.mkdir(parents=True, exist_ok=True)
        tmp = control.with_suffix(".tmp")
        creds = {k: v for k, v in dataclasses.asdict(address.credentials).items() if v}
        tmp.write_text(json.dumps({"control": address.text(), "run_id": self.cfg.run_id,
                                   "etcd": creds}))
        tmp.replace(control)

    def _keep_lease(self, address: ControlAddress) -> None:
        """Proves this agent alive, on a connection of its own, so that a busy main loop
        cannot stall it. A lost control plane is retried for the window (a blip is an event,
        not a death); past it, the lease is given up as an event, and the main loop, whose
        own calls fail the same way, ends the agent."""
        cfg = self.cfg
        backend = RetryingBackend(lambda: open_backend(address, cfg.run_id, 2.0),
                                  window=cfg.retry_window)
        last = 0.0
        while not self._lease_stop.wait(0.05):
            # The period follows the role: an agent that starts to lead refreshes faster at once.
            if time.monotonic() - last < cfg.lease_period(self._leads()):
                continue
            try:  # under the node's id now: a returning node becomes a standby node
                backend.refresh_lease(agent_lease(cfg.node_rank, self.instance).key)
            except ControlPlaneError as exc:
                if not self._lease_stop.is_set():  # not the job's own end
                    self.events.emit(ev.LeaseLost(error=str(exc)))
                return
            last = time.monotonic()

    def _leads(self) -> bool:
        """Leading, or maybe about to (node 0 stands first): a leader's lease is watched closely."""
        return isinstance(self.role, Leader) or (self.role is None and self.cfg.is_leader)

    def _publish_interrupt(self, signum: int, held_ranks: bool) -> None:
        if self.role is None:
            return
        try:
            self.role.interrupted(signum, held_ranks)
        except ControlPlaneError:
            pass  # the leader is gone too; nothing left to tell

    def _report_failure(self, fault: Fault | None, reason: str | None) -> None:
        where = (f"{fault.where()} {fault.kind.value}: {fault.detail}" if fault is not None
                 else "none")
        self.say(f"giving up after {self.cfg.recovery.max_restarts} restart(s): "
                 f"{reason or 'failed'}; "
                 f"last fault was {where}")
        print(root_cause_report(self.cfg.script, fault), file=self.out, flush=True)

    def _fork_server(self, guard: OrphanGuard) -> ForkServer | None:
        """The node's fork server, started now (its imports overlap the rendezvous), or None
        where workers start cold (said): `--no-fork-server`, `--no-python` (no interpreter of
        ours), `--virtual-local-rank` (a preimport touching CUDA would see every device)."""
        cfg = self.cfg
        why = ("--no-fork-server" if not cfg.recovery.fork_server else
               "--no-python" if cfg.no_python else
               "--virtual-local-rank" if cfg.virtual_local_rank else None)
        if why is not None:
            self.say(f"workers start as fresh interpreters ({why})")
            return None
        node = node_dir(Path(cfg.run_dir).resolve(), cfg.node_rank)
        return ForkServer(self._server_env(), node, guard, self.say, self.events.emit)

    def _server_env(self) -> dict[str, str]:
        """What the fork server imports torch under: the workers' environment without rank
        or attempt."""
        env = dict(os.environ)
        env.update(WorkerEnv(agent_pid=os.getpid(), run_dir=str(Path(self.cfg.run_dir).resolve()),
                             node_rank=self.cfg.node_rank).server_environ())
        return launcher_defaults(env, self.cfg)
