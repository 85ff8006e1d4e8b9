"""Blips are not faults: a backend that rides out a lost control plane for a window.

`RetryingBackend` wraps a client. A call that finds the control plane unreachable is retried
with backoff (50 ms doubling to 1 s), on a fresh client each time (a TCPStore client whose
server went away is not reusable), until the control plane answers or `window` seconds have
passed since the first failure; only then does `StoreUnavailable` reach the caller. The
first failure and the return are reported once each (`on_lost`, `on_back`), so a blip is an
event, never silent.

A retried add whose first try reached the store but lost its reply is applied twice; the
protocol tolerates that for its counters (they wake readers, who then read the keys
themselves), and a network cut usually fails a call before it is sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed import Store

from unbroken.control.backend import Backend, StoreMisconfigured, StoreUnavailable

T = TypeVar("T")

DEFAULT_WINDOW = 30.0  # seconds: how long an agent rides out a lost control plane


class RetryingBackend:
    """`backend.Backend`, retried for `window` seconds on `StoreUnavailable`.

    `open_` makes a client (called again after each failure); `sleep` waits between tries
    and may raise to abandon the wait (an agent's SIGTERM); `same_store` is called with each
    new client, before the call it retries, and raises if the store it reached is not the
    one the job agreed on (a TCPStore that restarted with a new host: the job it held is
    gone, and nothing may be written into the next one's)."""

    def __init__(self, open_: Callable[[], Backend], window: float = DEFAULT_WINDOW,
                 on_lost: Callable[[str], None] | None = None,
                 on_back: Callable[[float], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep, first: Backend | None = None,
                 same_store: Callable[[Backend], None] | None = None) -> None:
        self._open = open_
        self._same_store = same_store or (lambda client: None)
        self.window = window
        self._on_lost = on_lost or (lambda error: None)
        self._on_back = on_back or (lambda outage: None)
        self._sleep = sleep
        self._client: Backend | None = first

    def stop_retrying(self) -> None:
        """From now on a failure is reported at once: the job has ended, and nothing is
        left to ride out (a follower's last word to a leader that may be gone)."""
        self.window = 0.0

    @property
    def client(self) -> Backend:
        if self._client is None:
            self._client = self._open()
        return self._client

    def _do(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.client, name)(*args)
        except StoreMisconfigured:
            raise  # no blip: retrying cannot help
        except StoreUnavailable as exc:
            return self._ride_out(name, args, exc)

    def _ride_out(self, name: str, args: tuple, first: StoreUnavailable) -> Any:
        started = time.monotonic()
        self._on_lost(str(first))
        pause, error = 0.05, first
        while time.monotonic() - started < self.window:
            self._sleep(min(pause, max(0.0, self.window - (time.monotonic() - started))))
            pause = min(1.0, pause * 2)
            self._client = None
            try:
                self._same_store(self.client)
                value = getattr(self.client, name)(*args)
            except StoreMisconfigured:
                raise
            except StoreUnavailable as exc:
                error = exc
                continue
            self._on_back(time.monotonic() - started)
            return value
        raise StoreUnavailable(f"{error} (still unreachable after {self.window:g}s of retries)")

    def get(self, key: str) -> str | None:
        return self._do("get", key)

    def get_many(self, keys: list[str]) -> list[str | None]:
        return self._do("get_many", keys)

    def set(self, key: str, value: str) -> None:
        self._do("set", key, value)

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        return self._do("compare_set", key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._do("add", key, amount)

    def increment(self, key: str) -> None:
        self._do("increment", key)

    def wait(self, keys: list[str], timeout: float) -> bool:
        return self._do("wait", keys, timeout)

    def delete_prefix(self) -> None:
        self._do("delete_prefix")

    def refresh_lease(self, key: str) -> None:
        self._do("refresh_lease", key)

    def lease_token(self, key: str) -> int:
        return self._do("lease_token", key)

    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        return self._do("rendezvous_store", prefix, timeout)

    def describe(self) -> str:
        return self.client.describe() if self._client is not None else "the control plane"
