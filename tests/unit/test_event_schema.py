"""Every event is declared once, as a dataclass (`telemetry.schema`); docs/events.md is
generated from them; records encode and decode, old and unknown ones included."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from unbroken.telemetry import schema
from unbroken.telemetry.event_docs import render
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EventLog, read_events

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "unbroken"
OLD_LOG = Path(__file__).parent / "fixtures" / "old_run" / "events.jsonl"


def test_docs_events_md_is_generated_from_the_event_classes():
    """Stale? Regenerate: python -m unbroken.telemetry.event_docs > docs/events.md"""
    assert (ROOT / "docs" / "events.md").read_text() == render(), (
        "docs/events.md is stale: run `python -m unbroken.telemetry.event_docs > "
        "docs/events.md`")


def test_every_event_name_has_exactly_one_class_with_documented_fields():
    assert sorted(schema.EVENT_TYPES) == sorted(e.value for e in Event)
    for name, cls in schema.EVENT_TYPES.items():
        assert cls.EVENT == name and cls.__doc__, name
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{name}.{f.name} has no doc"
    with pytest.raises(TypeError, match="declared twice"):
        schema.base.event(Event.STEP)(type("Again", (schema.EventBody,), {}))


def test_no_event_field_shadows_the_writers_context():
    """The fields every record has (`EventBody`'s: `source`, `t`, ...) keep one meaning: an
    event that declared its own `source` (a rolled_back's `host`) would overwrite who wrote
    the record."""
    base = {f.name: f.metadata.get("doc") for f in dataclasses.fields(schema.EventBody)}
    # Workers write these sections with their own node, rank and slot in every record.
    workers = {cls for module in (schema.worker, schema.checkpoint, schema.anomaly)
               for cls in vars(module).values() if isinstance(cls, type)}
    clashes = [f"{name}.{f.name}" for name, cls in schema.EVENT_TYPES.items()
               for f in dataclasses.fields(cls)
               if f.metadata.get("doc") != base.get(f.name, f.metadata.get("doc"))
               and (f.name in ("t", "source", "extra") or cls in workers)]
    assert clashes == []


def test_no_module_emits_a_name_that_is_not_declared():
    literal = re.compile(r"""\b(emit|record)\(\s*["']""")
    assert [p.name for p in SRC.rglob("*.py") if literal.search(p.read_text())] == []


def test_an_event_instance_is_written_with_the_schema_version(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", source="worker", node=0, rank=1, attempt=0,
                   slot=1)
    log.emit(schema.Step(step=3, duration=0.25, gen=2, extra={"loss": 1.5}))
    log.emit(schema.CheckpointFailed(step=4, error="boom"))  # optional fields left out
    log.emit(schema.Drained(rank=2, from_="0.0", to="spare0-1", gen=3, switch_s=0.5))
    log.close()
    step, failed, drained = read_events(tmp_path / "events.jsonl")
    assert {k: v for k, v in step.items() if k != "t"} == {
        "event": "step", "v": schema.SCHEMA_VERSION, "source": "worker", "node": 0, "rank": 1,
        "attempt": 0, "slot": 1, "step": 3, "duration": 0.25, "gen": 2, "loss": 1.5}
    assert "final" not in failed and "stall" not in failed
    assert drained["from"] == "0.0" and drained["rank"] == 2  # the event's rank wins
    back = schema.decode(step)
    assert isinstance(back, schema.Step) and back.loss == 1.5 and back.gen == 2
    assert schema.decode(drained).from_ == "0.0"
    with pytest.raises(TypeError):
        log.emit(schema.Phase(name="eval", step=1, duration=0.1), step=2)


def test_an_old_log_decodes_and_encodes_back_to_its_records():
    """A log written before the schema (no `v`): every record decodes into its class, with
    no key left over, and encodes back to the same record."""
    records = read_events(OLD_LOG)
    assert {schema.version(r) for r in records} == {0}
    for record in records:
        body = schema.decode(record)
        assert not isinstance(body, schema.UnknownEvent), record["event"]
        again = {"t": body.t, "event": body.event, **schema.encode(body)}
        assert again == record
        if not isinstance(body, schema.Step):
            assert body.extra == {}, record["event"]


def test_missing_and_unknown_keys_and_names_are_tolerated():
    old = schema.decode({"t": 1.0, "event": "training_done", "step": 5})  # no gen, no pid
    assert old == schema.TrainingDone(t=1.0, step=5)
    short = schema.decode({"t": 1.0, "event": "rendezvous", "attempt": 0})
    assert short.world_size is None  # a field an older writer did not write
    newer = schema.decode({"t": 2.0, "event": "rendezvous", "attempt": 0, "world_size": 4,
                           "duration": 0.1, "worker_port": 1, "v": 7, "color": "red"})
    assert newer.world_size == 4 and newer.extra == {"color": "red"}
    unknown = schema.decode({"t": 3.0, "event": "from_the_future", "node": 1, "x": [1]})
    assert isinstance(unknown, schema.UnknownEvent)
    assert (unknown.event, unknown.node, unknown.extra) == ("from_the_future", 1, {"x": [1]})
    json.dumps(schema.encode(newer))  # plain JSON data


def test_a_published_fault_fits_the_fault_events():
    """The agents write `ev.Fault(**fault.event_fields())`: every field of the control
    message (but its time) must be a field of the event."""
    from unbroken.control.messages import Fault, FaultKind

    message = {f.name for f in dataclasses.fields(Fault)} - {"t"}
    for cls in (schema.Fault, schema.ExitAfterDone):
        assert message <= {f.name for f in dataclasses.fields(cls)}
    fault = Fault(FaultKind.CRASH, "killed", rank=1, node=0, pid=7, attempt=0, t=5.0)
    record = schema.encode(schema.Fault(**fault.event_fields()))
    assert record == {"kind": "crash", "detail": "killed", "rank": 1, "node": 0, "pid": 7,
                      "attempt": 0}
    assert json.loads(json.dumps(record)) == record


def test_the_package_says_which_module_declares_each_class():
    """`schema.CLASSES` is how `schema.X` finds X's module without importing the others: a
    class added to a module of events is added there too."""
    for module in schema.SECTIONS:
        declared = [name for name, value in vars(module).items() if isinstance(value, type)
                    and value.__module__ == module.__name__ and not name.startswith("_")]
        short = module.__name__.rsplit(".", 1)[1]
        assert schema.CLASSES[short] == tuple(declared), (
            f"schema.CLASSES[{short!r}] must list {module.__name__}'s classes, in order")
    assert [m.__name__.rsplit(".", 1)[1] for m in schema.SECTIONS] == list(schema.CLASSES)
    for names in schema.CLASSES.values():
        for name in names:
            assert getattr(schema, name).__name__ == name


def test_importing_the_package_imports_no_module_of_event_classes():
    """Workers and agents import the package; each builds only the classes it names."""
    tree = ast.parse((SRC / "telemetry" / "schema" / "__init__.py").read_text())
    imported = [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in tree.body if isinstance(node, ast.Import)
                 for alias in node.names]
    ours = {m for m in imported if m and m.startswith("unbroken.")}
    assert ours == {"unbroken.telemetry.schema", "unbroken.telemetry.schema.base"}
    from_package = [alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    and node.module == "unbroken.telemetry.schema" for alias in node.names]
    assert from_package == ["base"]


def test_renamed_events_are_read_under_their_names_now():
    """The fixture's log predates the renames (`standby_*` for what are now `warm_*` events):
    read, every record carries the name now, and a raw old record decodes to its class."""
    from unbroken.telemetry.event_names import RENAMED, Event

    raw = [json.loads(line)["event"] for line in OLD_LOG.read_text().splitlines()]
    old = [name for name in raw if name in RENAMED]
    assert {"standby_ready", "standby_taken", "standbys_started"} <= set(old)
    read = [r["event"] for r in read_events(OLD_LOG)]
    assert not set(read) & set(RENAMED) and read.count("warm_started") == raw.count("standbys_started")
    assert not set(RENAMED) & {e.value for e in Event}  # an old name never names a new event
    body = schema.decode({"t": 1.0, "event": "standby_imports", "pid": 7, "modules": 3,
                          "failed": [], "refused": [], "duration": 0.5})
    assert isinstance(body, schema.WarmInterpreterImports) and body.event == "warm_imports"
    assert body.extra == {}
