"""The warm standbys' events: interpreters that import torch ahead of a restart."""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event

SECTION = "Standby events"


@event(Event.STANDBY_READY)
class StandbyReady(EventBody):
    """A warm standby imported torch."""

    pid: int = doc("its process id")
    warmup: float = doc("seconds to import torch, at low priority while training runs")


@event(Event.STANDBY_IMPORTS)
class StandbyImports(EventBody):
    """The standby caught up with the node's list of modules the workers imported
    (`RUN_DIR/node_K/modules.json`); again whenever the list grows."""

    pid: int = doc("its process id")
    modules: int = doc("modules this standby has pre-imported so far, their own imports "
                       "included")
    failed: list[str] = doc("listed modules that raised on import: skipped")
    refused: list[str] = doc("listed names not found as installed code")
    duration: float = doc("seconds spent importing them")


@event(Event.STANDBY_TAKEN)
class StandbyTaken(EventBody):
    """A standby becomes a worker (`rank`, `attempt`: the worker it becomes)."""

    pid: int = doc("its process id")
    modules: int = doc("modules pre-imported")
    pending: list[str] = doc("listed modules not yet imported when it was taken: the script "
                             "imports them itself")
    failed: list[str] = doc("listed modules that raised on import")
    refused: list[str] = doc("listed names not found as installed code")
