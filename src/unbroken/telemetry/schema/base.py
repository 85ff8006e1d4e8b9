"""What every event is: a frozen dataclass, registered under its name, encoded as one JSON
object per line and decoded back into its class.

An event class is declared once, with `@event(Event.NAME)`; its docstring says when it is
written, and each field's `doc` says what it holds (docs/events.md is generated from them:
`python -m unbroken.telemetry.event_docs`). Its fields are keyword-only.

The contract of the encoding (`encode`, used by `EventLog.emit`):

- A record is `{"t": ..., "event": NAME, "v": SCHEMA_VERSION, <context>, <fields>}`: the
  writer's context (source, node, rank, attempt, slot) first, then the event's fields, so a
  field the event sets itself (a fault's `rank`) wins over the context.
- A field declared with a default is left out of the record while it holds that default
  (`optional`): absent, as before the schema. A field without one is always written, null
  included.
- `extra` (free keys: the metrics given to `run.log`) is written as top-level keys.

The contract of the decoding (`decode`), so that an older or newer log is still read:

- A record without `v` is of version 0 (written before the schema); it decodes the same.
- A field missing from the record takes its default, or None if it has none (an older
  writer that did not write it yet). Keys no field declares go into `extra`.
- A record whose `event` no class declares decodes as an `UnknownEvent` (a newer writer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, TypeVar

from unbroken.telemetry.event_names import Event, current

SCHEMA_VERSION = 1
"""The version each record carries in `v`. 0 (no `v`): written before the events had a
schema. Readers index records by key and skip keys they do not know, so the key is safe for
them; it is per record, not a header line, because many writers append to one log, and a log
rotates and is merged across nodes."""

VERSION_KEY = "v"
ENVELOPE = ("t", "event", VERSION_KEY)  # keys the log writes itself, on every record


def doc(text: str, default: Any = MISSING, *, key: str | None = None) -> Any:
    """A field with its documentation (and, if given, its default: the field is optional,
    left out of the record while it holds it). `key`: its key on disk, where that is not a
    Python name (`from`)."""
    return field(default=default, metadata={"doc": text, "key": key})


def optional(text: str) -> Any:
    """A field that most records leave out: None by default, and not written while None."""
    return doc(text, None)


@dataclass(frozen=True, kw_only=True)
class EventBody:
    """The fields every record may carry: the writer's context, set by the log (`EventLog`),
    or by an event that speaks of another process (a fault's `rank`)."""

    EVENT: ClassVar[Event]

    t: float | None = doc("wall-clock time the record was written (Unix seconds, microsecond "
                          "precision); set by the log", None)
    source: str | None = optional("`agent`, `worker`, `fork_server` (the node's fork "
                                  "server), or in older logs `standby` (a warm interpreter)")
    node: int | None = optional("the node rank of the writer")
    rank: int | None = optional("on worker events: the global rank")
    attempt: int | None = optional("on worker events: the attempt (restart count)")
    slot: int | None = optional(
        "on worker events: the worker's logical slot, its original rank, which a replacement "
        "inherits (in-place recovery renumbers `rank` in a shrunk generation; `slot` stays)")
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, metadata={
        "doc": "keys no field declares, written as top-level keys (a step's metrics)"})

    @property
    def event(self) -> str:
        """The event's name on disk."""
        return self.EVENT.value


E = TypeVar("E", bound=type[EventBody])
EVENT_TYPES: dict[str, type[EventBody]] = {}
"""Every event class, by its name on disk: each `Event` has exactly one. A class is here once
its module is imported; `schema.EVENT_TYPES`, this dict, imports them all first."""


def event(name: Event) -> Any:
    """Register the decorated class as the shape of the event `name` (once: a second class
    for one name is an error), as a frozen, keyword-only dataclass."""

    def register(cls: E) -> E:
        if name in EVENT_TYPES:
            raise TypeError(f"event {name!r} is declared twice: {EVENT_TYPES[name].__name__} "
                            f"and {cls.__name__}")
        cls = dataclass(frozen=True, kw_only=True)(cls)
        cls.EVENT = name
        EVENT_TYPES[name.value] = cls
        return cls

    return register


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(EventBody):
    """A record whose name no class declares (a newer writer): its keys are in `extra`."""

    raw_name: str = ""

    @property
    def event(self) -> str:
        return self.raw_name


def key_of(f: dataclasses.Field) -> str:
    """A field's key on disk."""
    return f.metadata.get("key") or f.name


def _keys(cls: type[EventBody]) -> dict[str, str]:
    """The class's keys on disk -> its field names (`extra` and `raw_name` left out)."""
    found = _KEYS.get(cls)
    if found is None:
        found = _KEYS[cls] = {key_of(f): f.name for f in dataclasses.fields(cls)
                              if f.name not in ("extra", "raw_name")}
    return found


_KEYS: dict[type, dict[str, str]] = {}


def encode(body: EventBody) -> dict[str, Any]:
    """The event's keys, `t` left out (the log sets it): required fields always, optional
    ones when they differ from their default, then `extra`. Values must be JSON data."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(body):
        if f.name in ("t", "extra"):
            continue
        value = getattr(body, f.name)
        if f.default is MISSING or value != f.default:
            out[key_of(f)] = value
    out.update(body.extra)
    return out


def decode(record: Mapping[str, Any]) -> EventBody:
    """The record as its event class (see the module's contract). Never raises for a
    record's content: an unknown name is an `UnknownEvent`."""
    name = record.get("event")
    cls = _class_of(current(name)) if isinstance(name, str) else None
    keys = _keys(cls or UnknownEvent)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in record.items():
        if key in keys:
            kwargs[keys[key]] = value
        elif key not in ENVELOPE:
            extra[key] = value
    if cls is None:
        return UnknownEvent(raw_name=str(name), extra=extra, **kwargs)
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            kwargs[f.name] = None  # an older writer did not write it
    return cls(extra=extra, **kwargs)


def _class_of(name: str) -> type[EventBody] | None:
    """The class of the event `name`; None if none declares it (a newer writer's event). The
    package imports its modules of classes on first use: if no class imported so far declares
    the name, they are all imported first."""
    cls = EVENT_TYPES.get(name)
    if cls is None:
        from unbroken.telemetry.schema import load_all  # the package, which imports this module

        load_all()
        cls = EVENT_TYPES.get(name)
    return cls


def version(record: Mapping[str, Any]) -> int:
    """The schema version a record was written with (0: before the schema)."""
    v = record.get(VERSION_KEY, 0)
    return v if isinstance(v, int) else 0


def decode_all(events: Iterable[Mapping[str, Any] | EventBody]) -> list[EventBody]:
    """Each record decoded (`decode`); an event already decoded is kept as it is."""
    return [e if isinstance(e, EventBody) else decode(e) for e in events]


Emit = Callable[[EventBody], Any]
"""Where a component sends its events: `EventLog.emit`, or a test's `list.append`."""
