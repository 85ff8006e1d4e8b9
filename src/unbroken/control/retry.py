"""Blips are not faults: a backend that rides out a lost control plane for a window.

`RetryingBackend` wraps a client. A call that finds the control plane unreachable is retried
with backoff (50 ms doubling to 1 s), on a fresh client each time (a TCPStore client whose
server went away is not reusable), until the control plane answers or `window` seconds have
passed since the first failure; only then does `StoreUnavailable` reach the caller. The
first failure and the return are reported once each (`on_lost`, `on_back`), so a blip is an
event, never silent.

A retry repeats the call with the same arguments, so the request id an add or an append
carries (made once, by `channel`, above this layer) is the same on every try: on etcd a
retry whose first try was applied counts once; on the TCPStore a queue entry is written
once and a lost slot is skipped by readers, while a plain counter's add may count twice
(docs/design-notes.md, "Request ids"). The watch and the fence of the client are set again
on each fresh client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed import Store

from unbroken.control.backend import Backend, StoreMisconfigured, StoreUnavailable
from unbroken.control.schema import Watched

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
        self._watched: list[Watched] | None = None  # set again on every fresh client
        self._fence: tuple[str, str] | None = None

    def stop_retrying(self) -> None:
        """From now on a failure is reported at once: the job has ended, and nothing is
        left to ride out (a follower's last word to a leader that may be gone)."""
        self.window = 0.0

    @property
    def client(self) -> Backend:
        if self._client is None:
            client = self._open()
            if self._fence is not None:
                client.fence(*self._fence)
            if self._watched is not None:
                client.watch(self._watched)
            self._client = client
        return self._client

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.watch(None)
        self._client = None

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
            self._drop_client()
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

    def get(self, key: str, fresh: bool = False) -> str | None:
        return self._do("get", key, fresh)

    def get_many(self, keys: list[str], fresh: bool = False) -> list[str | None]:
        return self._do("get_many", keys, fresh)

    def set(self, key: str, value: str) -> None:
        self._do("set", key, value)

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        return self._do("compare_set", key, expected, desired)

    def add(self, key: str, amount: int, request_id: str | None = None) -> int:
        return self._do("add", key, amount, request_id)

    def increment(self, key: str, request_id: str | None = None) -> None:
        self._do("increment", key, request_id)

    def notify(self, key: str) -> None:
        self._do("notify", key)

    def append(self, queue: str, request_id: str, value: str) -> None:
        self._do("append", queue, request_id, value)

    def read_queue(self, queue: str, start: int) -> list[tuple[str | None, str | None]]:
        return self._do("read_queue", queue, start)

    def position(self, queue: str, request_id: str) -> int:
        return self._do("position", queue, request_id)

    def watch(self, watched: list[Watched] | None) -> None:
        self._watched = None if watched is None else list(watched)
        self._do("watch", self._watched)


    def changes(self) -> int | None:
        return self.client.changes()

    def wait_change(self, seen: int | None, timeout: float) -> None:
        self.client.wait_change(seen, timeout)

    def fence(self, key: str | None, value: str | None) -> None:
        self._fence = None if key is None or value is None else (key, value)
        self.client.fence(key, value)

    def wait(self, keys: list[str], timeout: float) -> bool:
        return self._do("wait", keys, timeout)

    def delete_prefix(self) -> None:
        self._do("delete_prefix")

    def refresh_lease(self, key: str) -> None:
        self._do("refresh_lease", key)


    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        return self._do("rendezvous_store", prefix, timeout)

    def describe(self) -> str:
        return self.client.describe() if self._client is not None else "the control plane"
