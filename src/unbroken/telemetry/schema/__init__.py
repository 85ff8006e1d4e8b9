"""Every event of the run's log, as a frozen dataclass declared once (`base` says how they are
encoded and decoded). Emit one with `EventLog.emit(schema.Restart(attempt=1, ...))`; read one
back with `decode(record)`.

The classes are grouped by who writes them; each group is a section of docs/events.md.
"""

from unbroken.telemetry.schema import agent, checkpoint, recovery, warm, worker
from unbroken.telemetry.schema.agent import *  # noqa: F403
from unbroken.telemetry.schema.base import (
    EVENT_TYPES,
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
from unbroken.telemetry.schema.checkpoint import *  # noqa: F403
from unbroken.telemetry.schema.recovery import *  # noqa: F403
from unbroken.telemetry.schema.warm import *  # noqa: F403
from unbroken.telemetry.schema.worker import *  # noqa: F403

SECTIONS = (agent, recovery, worker, checkpoint, warm)
"""The modules of event classes, in the order docs/events.md lists them."""

__all__ = ["EVENT_TYPES", "Emit", "SCHEMA_VERSION", "SECTIONS", "VERSION_KEY", "EventBody",
           "UnknownEvent", "decode", "decode_all", "encode", "version"]
