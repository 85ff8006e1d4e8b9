"""The events of what imports ahead of a worker: the node's fork server
(`runtime/fork_server.py`, source `fork_server`: `standby_imports`) and, in older runs' logs,
the warm interpreters it replaced (source `standby`: `standby_ready`, `standby_imports`,
`standby_taken`, no longer written). Not standby nodes (`--standby`): the names predate
the terms and keep their spelling."""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Warm interpreter events"


@event(Event.STANDBY_READY)
class WarmInterpreterReady(EventBody):
    """A warm interpreter (the event's name predates the term) imported torch."""

    pid: int = doc("its process id")
    warmup: float = doc("seconds to import torch, at low priority while training runs")


@event(Event.STANDBY_IMPORTS)
class WarmInterpreterImports(EventBody):
    """The node's fork server (source `fork_server`; before it, a warm interpreter, source
    `standby`: the event's name predates both) caught up with the node's list of modules the
    workers imported (`RUN_DIR/node_K/modules.json`); again whenever the list grows. Every
    worker forked from then on has them imported."""

    pid: int = doc("its process id")
    modules: int = doc("modules it has pre-imported so far, their own imports included")
    listed: int | None = optional(
        "names the list held when it caught up (read again just before this event): a "
        "reader that saw the list with this many names knows they are all dealt with")
    failed: list[str] = doc("listed modules that raised on import: skipped")
    refused: list[str] = doc("listed names not found as installed code")
    dropped: dict[str, list[str]] | None = optional(
        "listed modules whose import reads a rank's or job's variable (module -> the "
        "variables), found in a throwaway fork: never imported by the server, each worker "
        "imports them itself; left out when none did")
    duration: float = doc("seconds spent importing them")


@event(Event.STANDBY_TAKEN)
class WarmInterpreterTaken(EventBody):
    """A warm interpreter (the event's name predates the term) becomes a worker (`rank`,
    `attempt`: the worker it becomes)."""

    pid: int = doc("its process id")
    modules: int = doc("modules pre-imported")
    pending: list[str] = doc("listed modules not yet imported when it was taken: the script "
                             "imports them itself")
    failed: list[str] = doc("listed modules that raised on import")
    refused: list[str] = doc("listed names not found as installed code")
    dropped: dict[str, list[str]] | None = optional(
        "listed modules whose import reads a rank's or job's variable (module -> the "
        "variables), found in a throwaway fork: never imported by the server, each worker "
        "imports them itself; left out when none did")
