"""The events of what imports ahead of a worker: the node's fork server
(`runtime/fork_server.py`, source `fork_server`: `warm_imports`) and, in older runs' logs,
the warm interpreters it replaced (source `standby`: `warm_ready`, `warm_imports`,
`warm_taken`, no longer written). Older logs call them `standby_ready`, `standby_imports`
and `standby_taken`; they are read under the names here (`event_names.RENAMED`): "standby"
now means a standby node (`--standby`) only."""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Warm interpreter events"


@event(Event.WARM_READY)
class WarmInterpreterReady(EventBody):
    """A warm interpreter imported torch (older logs: `standby_ready`)."""

    pid: int = doc("its process id")
    warmup: float = doc("seconds to import torch, at low priority while training runs")


@event(Event.WARM_IMPORTS)
class WarmInterpreterImports(EventBody):
    """The node's fork server (source `fork_server`; before it, a warm interpreter, source
    `standby`; older logs: `standby_imports`) caught up with the node's list of modules the
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


@event(Event.WARM_TAKEN)
class WarmInterpreterTaken(EventBody):
    """A warm interpreter becomes a worker (`rank`, `attempt`: the worker it becomes; older
    logs: `standby_taken`)."""

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
