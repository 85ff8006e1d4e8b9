"""The warm interpreters' events: interpreters that import torch ahead of a restart
(`launch/workers/warm_pool.py`). Not standby nodes (`--standby`). The events' names, and the
`standby` source their records carry, predate the term and keep their spelling."""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event

SECTION = "Warm interpreter events"


@event(Event.STANDBY_READY)
class WarmInterpreterReady(EventBody):
    """A warm interpreter (the event's name predates the term) imported torch."""

    pid: int = doc("its process id")
    warmup: float = doc("seconds to import torch, at low priority while training runs")


@event(Event.STANDBY_IMPORTS)
class WarmInterpreterImports(EventBody):
    """A warm interpreter (the event's name predates the term) caught up with the node's list
    of modules the workers imported (`RUN_DIR/node_K/modules.json`); again whenever the list
    grows."""

    pid: int = doc("its process id")
    modules: int = doc("modules this warm interpreter has pre-imported so far, their own "
                       "imports included")
    failed: list[str] = doc("listed modules that raised on import: skipped")
    refused: list[str] = doc("listed names not found as installed code")
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
