"""An agent's first contact with its job: everything between starting and holding a control
channel the job agreed to.

In order (`FirstContact.connect`): this agent's secret; the master address or the etcd
endpoints resolving (a pod's DNS record may come late); serving the TCPStore (node 0, or the
first to bind it when node ranks are assigned) or connecting to the store (retried until
--rdzv-timeout); the signing agreement with the job (`control.auth`), with etcd after
meeting an earlier job under the same id (`dead_job`); and a node rank in join order when
none was given. After an outage, `same_store` checks that the store reached again still
holds the job this agent agreed to.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from unbroken.control.address import (
    BackendKind,
    ControlAddress,
    address_toward,
    open_backend,
    unresolved,
)
from unbroken.control.auth import UNSIGNED_NOTICE, job_auth, mismatch
from unbroken.control.backend import Backend, StoreUnavailable
from unbroken.control.channel import Channel
from unbroken.control.messages import AuthRejection, JobAuth
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import AUTH_REJECTIONS, JOB_AUTH, NODE_RANKS, STANDBY_IDS, standby_id
from unbroken.control.signing import load_secret
from unbroken.control.tcp import TcpBackend, serve_store
from unbroken.errors import ConfigError, ControlPlaneError
from unbroken.launch import dead_job
from unbroken.launch.config import LaunchConfig
from unbroken.polling import poll_until
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EventLog


class FirstContact:
    """One agent's way into its job's control plane (see the module's docstring).

    `sleep` pauses and then checks for a signal, `check_signal` only checks (both raise to
    stop the agent); `on_lost` and `on_back` are told of a control-plane outage and its end.
    `connect` may rewrite `cfg.node_rank` (assigned ranks, standby ids) and `cfg.local_addr`.
    After it, `secret` is this agent's secret (None: unsigned) and `declared` the job's
    declaration this agent agreed to."""

    def __init__(self, cfg: LaunchConfig, events: EventLog, say: Callable[[str], None],
                 instance: str, sleep: Callable[..., None], check_signal: Callable[[], None],
                 on_lost: Callable[[str], None], on_back: Callable[[float], None]) -> None:
        self.cfg = cfg
        self.events = events
        self.say = say
        self.instance = instance
        self._sleep = sleep
        self._check_signal = check_signal
        self._on_lost = on_lost
        self._on_back = on_back
        self.secret: bytes | None = None
        self.declared: JobAuth | None = None  # the job's declaration, as agreed

    def connect(self) -> tuple[Backend, ControlAddress]:
        """The control store, and where the workers reach the control plane. The node-0
        agent serves the TCPStore; every other agent, and every agent with etcd, connects.
        The agent's secret is checked against the job's before anything else (`_agree`)."""
        cfg = self.cfg
        self.secret = self._own_secret()
        self._wait_resolvable(cfg.control_address(cfg.master_port))
        if cfg.elects and cfg.local_addr is None:
            # Where this agent serves the workers' store if it comes to lead: its address on
            # the route to etcd, which the other hosts reach too (loopback for a local etcd).
            cfg.local_addr = address_toward(cfg.etcd_endpoints[0])
        hosted = self._host_store()
        if hosted is None:
            address = cfg.control_address(cfg.master_port)
            backend: Backend = self._retrying(address, self._first_contact(address))
            self._agree(backend, declare=cfg.elects)
            if cfg.assign_rank:
                self._take_node_rank(backend)
        else:
            store, port = hosted
            address = cfg.control_address(port)
            backend = TcpBackend(store, cfg.run_id, cfg.master_addr, port)
            self._agree(backend, declare=True)
        return backend, address

    def _own_secret(self) -> bytes | None:
        """This agent's secret (`control.auth`): given, or on a one-node job its own; None
        on a multi-node job given none (it runs unsigned)."""
        cfg = self.cfg
        alone = cfg.single_node
        return load_secret(cfg.run_dir if alone else None, cfg.secret_file,
                           create=alone and cfg.is_leader)

    def _wait_resolvable(self, address: ControlAddress) -> None:
        """A master address or endpoint whose name does not resolve yet (a pod whose DNS
        record is not published) is retried until --rdzv-timeout, with one progress line;
        only then is it an error."""
        cfg = self.cfg
        missing: list[str] = []
        told = False

        def resolved() -> bool | None:
            nonlocal missing
            missing = unresolved(address.hosts)
            return None if missing else True

        def tell(_waited: float) -> None:
            nonlocal told
            if not told:
                self.say(f"waiting for {', '.join(missing)} to resolve (up to "
                         f"{cfg.rdzv_timeout:g}s)")
                told = True

        poll_until(resolved, cfg.rdzv_timeout, 0.25, on_wait=tell, sleep=self._sleep,
                   timeout_error=lambda: ControlPlaneError(
                       f"cannot resolve {', '.join(missing)} after {cfg.rdzv_timeout:g}s: check "
                       "--master-addr/--rdzv-endpoint (the name must resolve on every node)"))
        if told:
            self.say(f"{', '.join(address.hosts)} resolved")

    def _agree(self, backend: Backend, declare: bool) -> None:
        """Settle signing with the job (`control.auth`): the first agent declares it (the
        TCPStore's host always; with etcd whoever writes first), every other one reads the
        declaration and leaves, alone and at once, if its own differs."""
        cfg, plain = self.cfg, Channel(backend)  # unsigned: the declaration is what is checked
        mine = dataclasses.replace(job_auth(self.secret), incarnation=self.instance)
        if declare and cfg.elects:
            self._meet_earlier_job(backend)
            job = plain.first(JOB_AUTH, mine)
        elif declare:
            plain.write(JOB_AUTH, mine)
            job = mine
        else:
            job = poll_until(lambda: plain.read(JOB_AUTH), cfg.rdzv_timeout, 0.05,
                             sleep=self._sleep, timeout_error=lambda: ControlPlaneError(
                                 f"the control store at {cfg.master_addr}:{cfg.master_port} never "
                                 f"said how the job signs within {cfg.rdzv_timeout:g}s: is it an "
                                 "unbroken job's node 0?"))
        self.declared = job
        why = mismatch(job, mine)
        if why is not None:
            self.events.emit(ev.AgentRejected(reason=why, host=os.uname().nodename))
            try:
                plain.append(AUTH_REJECTIONS, AuthRejection(
                    node=cfg.node_rank, host=os.uname().nodename, reason=why))
            except ControlPlaneError:
                pass  # the job is out of reach: this agent's own line is what matters
            raise ConfigError(why)
        if not mine.signed:
            self.events.emit(ev.ControlUnsigned())
            self.say(UNSIGNED_NOTICE)

    def _meet_earlier_job(self, backend: Backend) -> None:
        """With etcd, before declaring: keys already under this id are a live job's (join it)
        or a dead one's (`dead_job`): refused with one line, or, with --continue-dead-job,
        cleared by exactly one agent so that the job starts afresh under the same id."""
        cfg = self.cfg
        found = backend.get(JOB_AUTH.key)
        if found is None:
            return
        if not dead_job.is_reset(found):
            silent = dead_job.judge(backend, dead_job.window(cfg.etcd.leader_timeout), self._sleep)
            if silent is None:  # alive; or another agent began to clear it meanwhile
                if dead_job.is_reset(backend.get(JOB_AUTH.key)):
                    dead_job.wait_cleared(backend, cfg.rdzv_timeout, self._sleep)
                return
            self.events.emit(ev.DeadJobFound(silent=round(silent, 1),
                             cont=cfg.etcd.continue_dead_job))
            if not cfg.etcd.continue_dead_job:
                raise dead_job.DeadJob(cfg.run_id, silent)
            if dead_job.clear(backend, found, self.instance):
                self.events.emit(ev.DeadJobCleared())
                self.say(f"cleared the keys of a dead job under --rdzv-id {cfg.run_id} (silent "
                         f"{silent:.0f}s): continuing it afresh")
                return
        dead_job.wait_cleared(backend, cfg.rdzv_timeout, self._sleep)

    def _host_store(self) -> tuple[Any, int] | None:
        """With the TCPStore: serve it if this agent is node 0, or, when node ranks are
        assigned (torchrun's c10d rendezvous), if it can bind the endpoint first; that agent
        is node 0. None: connect to the store as a client."""
        cfg = self.cfg
        if cfg.elects or cfg.standby or not (cfg.is_leader or cfg.assign_rank):
            return None
        if not cfg.assign_rank or cfg.is_host:
            return serve_store(cfg.master_addr, cfg.master_port, cfg.rdzv_timeout)
        if cfg.is_host is False:
            cfg.node_rank = -1  # ranked once connected
            return None
        try:
            return serve_store(cfg.master_addr, cfg.master_port, cfg.rdzv_timeout)
        except (ControlPlaneError, ConfigError):  # another agent serves it, or another host's
            cfg.node_rank = -1
            return None

    def _take_node_rank(self, backend: Backend) -> None:
        """The next node rank in join order: 1, 2, ... behind the TCPStore's host; with
        etcd 0, 1, ... (the first to claim stands first for leadership). A standby node
        claims a standby id instead (`schema.standby_id`), which no job node ever has."""
        if self.cfg.standby:
            self.cfg.node_rank = standby_id(self.cfg.nnodes, Channel(backend).claim(STANDBY_IDS))
            self.events.context["node"] = self.cfg.node_rank
            self.say(f"joined as standby node {self.cfg.node_rank}")
            return
        claim = Channel(backend).claim(NODE_RANKS)
        self.cfg.node_rank = claim if not self.cfg.elects else claim - 1
        self.events.context["node"] = self.cfg.node_rank
        self.say(f"joined as node {self.cfg.node_rank}")

    def _first_contact(self, address: ControlAddress) -> Backend:
        """The first connection: retried until --rdzv-timeout (node 0 may start later)."""
        last: list[StoreUnavailable] = []

        def contact() -> Backend | None:
            self._check_signal()
            try:
                return open_backend(address, self.cfg.run_id, 2.0)
            except StoreUnavailable as e:
                if address.kind == BackendKind.ETCD:
                    raise  # etcd is up before the job: a wrong endpoint is said at once
                last[:] = [e]
                return None

        return poll_until(contact, self.cfg.rdzv_timeout, 0.1, sleep=self._sleep,
                          timeout_error=lambda: last[0])  # the store's own last word

    def _retrying(self, address: ControlAddress, first: Backend | None = None) -> RetryingBackend:
        """A client that rides out a blip of the control plane (--control-retry-window)."""
        return RetryingBackend(lambda: open_backend(address, self.cfg.run_id, 2.0),
                               window=self.cfg.retry_window, on_lost=self._on_lost,
                               on_back=self._on_back, sleep=self._sleep, first=first,
                               same_store=self.same_store)

    def same_store(self, client: Backend) -> None:
        """After an outage: the store reached again must hold the declaration this agent
        agreed to (its incarnation). A TCPStore whose host was replaced (node 0's pod
        recreated) holds another job's, or none yet: this agent's job ended with the old
        store, and it leaves (exit 3) so that its node restarts into the new one."""
        if self.declared is None:
            return
        raw = client.get(JOB_AUTH.key)
        if raw is not None and dead_job.is_reset(raw):
            return  # another agent clears a dead job: not this one's (it is alive)
        found = None if raw is None else Channel(client).read(JOB_AUTH)
        if found is None or found.incarnation != self.declared.incarnation:
            raise ControlPlaneError(
                "the control store came back without this job: its host restarted (node 0's "
                "agent was replaced) and the job now forming there is another; leaving so "
                "that this node restarts and joins it")
