"""Every event of the run's log, as a frozen dataclass declared once (`base` says how they are
encoded and decoded). Emit one with `EventLog.emit(schema.Restart(attempt=1, ...))`; read one
back with `decode(record)`.

The classes are grouped by who writes them; each group is a section of docs/events.md.

Each group's module is imported when one of its classes is first named: `schema.Step` imports
`schema.worker` and no other. Building a dataclass costs about half a millisecond, and every
worker and agent imports this package, but a worker writes only worker and checkpoint events.
`EVENT_TYPES` and `SECTIONS` import every group, and so does `decode` of a name that no class
imported so far declares. `CLASSES` says which module declares each class (a class added to a
module is added there too: tests/unit/test_event_schema.py checks them against each other).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from unbroken.telemetry.schema import base
from unbroken.telemetry.schema.base import (
    SCHEMA_VERSION,
    VERSION_KEY,
    Emit,
    EventBody,
    UnknownEvent,
    decode,
    decode_all,
    encode,
    version,
)

if TYPE_CHECKING:  # what a type checker sees: every class, as if imported here
    from unbroken.telemetry.schema import (  # noqa: F401
        agent,
        anomaly,
        checkpoint,
        recovery,
        warm,
        watched,
        worker,
    )
    from unbroken.telemetry.schema.agent import *  # noqa: F403
    from unbroken.telemetry.schema.anomaly import *  # noqa: F403
    from unbroken.telemetry.schema.base import EVENT_TYPES
    from unbroken.telemetry.schema.checkpoint import *  # noqa: F403
    from unbroken.telemetry.schema.recovery import *  # noqa: F403
    from unbroken.telemetry.schema.warm import *  # noqa: F403
    from unbroken.telemetry.schema.watched import *  # noqa: F403
    from unbroken.telemetry.schema.worker import *  # noqa: F403

    SECTIONS: tuple[ModuleType, ...]
    """The modules of event classes, in the order docs/events.md lists them (`load_all()`)."""

CLASSES: dict[str, tuple[str, ...]] = {
    "agent": (
        "AgentStart", "HealthChecked", "Rendezvous", "ClockOffset", "WorkersStarted", "WarmInterpretersStarted", "ForkServerLost",
        "WorkersStopped", "WorkersDone", "Restart", "Notice", "NodeDrained", "ControlUnsigned",
        "DeadJobFound", "DeadJobCleared", "NodeReturned", "AgentRejected", "ForgedMessage",
        "LeaseLost", "ControlPlaneLost", "ControlPlaneBack", "LeaderElected",
        "LeadHandedOver", "LeadHandoverBlocked", "LeaderSteppedDown", "LeaderDeposed", "NodeSet", "NodeTakenOver",
        "NodeQuarantined", "AgentError", "AgentExit", "EventsDropped"),
    "recovery": (
        "FaultFields", "Fault", "ExitAfterDone", "NodeLost", "SpareStarted", "SparesOffered",
        "SparePromoted", "SpareAssigned", "SpareRequestDeclined", "SpareLost", "DrainStarted",
        "DrainRefused", "Drained", "ReplacementStarted", "DeparturesSent", "StallReported", "Stall",
        "HangBlamed", "GenPlan", "GenUp", "RecoveryFallback"),
    "worker": (
        "WorkerStart", "Resume", "Step", "StepFailed", "GenLeave", "SwitchFailed", "GenSwitch",
        "InPlaceUnavailable", "LoaderPositioned", "LoaderMarkUnpublished", "JoinerUnused",
        "SpareReady", "ShardSync", "SnapshotConfig",
        "SnapshotsRefused", "AbortOnNotice", "Phase", "FlightRecorderDumped", "FaultInjected", "TrainingDone",
        "StepDropped", "MicroBatchesReplayed", "RolledBack"),
    "checkpoint": (
        "CheckpointInterval", "CheckpointSaved", "CheckpointFailed", "CheckpointDirNotShared",
        "CheckpointDeferred", "CheckpointStuck", "CheckpointLoaded", "CheckpointInvalid"),
    "anomaly": (
        "AnomalyConfig", "AnomalyFound", "AnomalyClassified", "StepSkipped", "AnomalyLimit",
        "SdcCheck", "SdcMismatch", "SdcSettled", "StragglerFlagged", "StragglerRemedied",
        "StragglerCleared", "JobSlow"),
    "warm": ("WarmInterpreterReady", "WarmInterpreterImports", "WarmInterpreterTaken"),
    "watched": ("ScriptWatched", "ScriptSteps", "ScriptSave", "ScriptSaveWait", "ScriptLoad"),
}
"""Each module of event classes (`schema.<name>`), in the order docs/events.md lists them, and
the public classes it declares."""

_HOME = {cls: module for module, names in CLASSES.items() for cls in names}


@functools.cache
def load_all() -> tuple[ModuleType, ...]:
    """Every module of event classes, imported (once), in `CLASSES`' order: afterwards
    `EVENT_TYPES` holds every event."""
    return tuple(importlib.import_module(f"{__name__}.{module}") for module in CLASSES)


def __getattr__(name: str) -> Any:
    """A class, or a module of them, imported on first use (then bound here: looked up once)."""
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    elif name in CLASSES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name == "SECTIONS":
        value = load_all()
    elif name == "EVENT_TYPES":
        load_all()
        value = base.EVENT_TYPES
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME, *CLASSES, "EVENT_TYPES", "SECTIONS"})


__all__ = ["EVENT_TYPES", "Emit", "SCHEMA_VERSION", "SECTIONS", "VERSION_KEY", "EventBody",
           "UnknownEvent", "decode", "decode_all", "encode", "load_all", "version"]
