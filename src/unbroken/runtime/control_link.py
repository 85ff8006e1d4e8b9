"""A worker's link to the control store: connected once, lazily, and its fault claims."""

from __future__ import annotations

import os
from collections.abc import Callable

from unbroken.control.address import ControlAddress, EtcdCredentials, open_backend
from unbroken.control.channel import Channel
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import fault_claim
from unbroken.control.signing import Signer
from unbroken.control.worker_env import WorkerEnv
from unbroken.telemetry import schema as ev


class ControlLink:
    """The control channel under `unbroken run` (None-free: only built when used), and the
    one-time claims that make an injected fault fire once per job."""

    def __init__(self, env: WorkerEnv, record: Callable[..., None]) -> None:
        self._env = env
        self._record = record
        self._channel: Channel | None = None
        self._claimed_here: set[str] = set()

    def channel(self) -> Channel:
        """The control channel, connected on first use (outages are events, not errors,
        until the retry window runs out)."""
        if self._channel is None:
            self._channel = self.open_channel()
        return self._channel

    def open_channel(self) -> Channel:
        """A control channel of its own, on a new connection: for a thread other than the
        main one (a channel is not shared between threads)."""
        env = self._env
        signer = Signer(bytes.fromhex(env.secret)) if env.secret else None
        address = ControlAddress.parse(env.control, EtcdCredentials.from_environ(os.environ))
        backend = RetryingBackend(
            lambda: open_backend(address, env.run_id, 30.0), window=env.retry_window,
            on_lost=lambda error: self._record(ev.ControlPlaneLost(error=error)),
            on_back=lambda outage: self._record(ev.ControlPlaneBack(outage=round(outage, 3))))
        return Channel(backend, signer, on_forged=lambda key, why: self._record(
            ev.ForgedMessage(key=key, reason=why)))

    def file_drain(self, slot: int) -> bool:
        """Ask the leader to move `slot` onto a ready spare (as `unbroken drain --rank`
        does); returns once filed, not when done: the outcome is the leader's events."""
        from unbroken.control.messages import DrainKind, DrainRequest
        from unbroken.control.schema import AttemptKeys

        self.channel().append(AttemptKeys(self._env.attempt).drains,
                              DrainRequest(DrainKind.RANK, slot))
        return True

    def claim_fault(self, key: str) -> bool:
        """True once per job for `key`: claimed in the control store under an agent, or
        once per process without one."""
        if self._env.under_agent:
            return self.channel().claim(fault_claim(key)) == 1
        if key in self._claimed_here:
            return False
        self._claimed_here.add(key)
        return True
