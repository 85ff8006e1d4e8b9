"""The event log, in process: a full disk drops (and counts) events but never raises, and
readers read the rotated files as one log. (Concurrent writers in real processes, forks
and a real full file system: tests/integration/test_event_log.py.)
"""

from __future__ import annotations

import pytest

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import (
    DEFAULT_MAX_BYTES,
    EVENTS_FILE,
    MAX_BYTES_ENV,
    EventLog,
    event_files,
    max_bytes_from_env,
    read_events,
)

DROP_NOTICE = "dropping events and counting them"


def test_each_file_stays_within_a_check_of_the_bound(tmp_path):
    """Two writers, interleaved in one thread so that the test is deterministic: every
    rotated file is past the bound by at most what the writers append between checks."""
    path, max_bytes, keep = tmp_path / EVENTS_FILE, 8192, 1000
    a, b = (EventLog(path, max_bytes=max_bytes, keep=keep, source=s) for s in "ab")
    check = max_bytes // 8  # each writer checks after this many bytes of its own
    for i in range(2000):
        a.emit(Event.STEP, step=i, pad="x" * (i % 40))
        b.emit(Event.STEP, step=i, pad="x" * (i % 40))
    a.close()
    b.close()
    files = event_files(tmp_path)
    line = 120  # longer than any line here
    # Both appended up to a check since the last check that found the file small; then the
    # one that did not rotate appends up to one check more before it sees the new file.
    assert all(max_bytes <= f.stat().st_size <= max_bytes + 3 * (check + line)
               for f in files[:-1])
    assert files[-1].stat().st_size < max_bytes + 3 * (check + line)
    assert len(files) > 30 and a.dropped == b.dropped == 0  # ~350 KB past an 8 KB bound
    events = read_events(path)
    for s in "ab":
        assert [e["step"] for e in events if e["source"] == s] == list(range(2000))


def test_read_events_reads_a_rotated_log_oldest_first(tmp_path):
    log = tmp_path / EVENTS_FILE

    def put(name: str, *lines: str) -> None:
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))

    put(f"{EVENTS_FILE}.10", '{"t": 1, "event": "a"}', '{"t": 2, "event": "b"}')
    put(f"{EVENTS_FILE}.2", '{"t": 3, "event": "c"}', '{"t": 5, "event": "e"}')
    put(f"{EVENTS_FILE}.1", '{"t": 4, "event": "d"}', '{"t": 6, "eve', '[1, 2]')  # torn, junk
    put(EVENTS_FILE, '{"t": 7, "event": "f"}', '{"t": 7, "event": "g"}', '{"t": 8, "ev')
    put(f"{EVENTS_FILE}.lock")
    put(f"{EVENTS_FILE}.0", '{"t": 0, "event": "not a rotated file"}')
    put(f"{EVENTS_FILE}.tmp", '{"t": 0, "event": "nor this"}')
    assert [p.name for p in event_files(tmp_path)] == [
        f"{EVENTS_FILE}.10", f"{EVENTS_FILE}.2", f"{EVENTS_FILE}.1", EVENTS_FILE]
    assert [e["event"] for e in read_events(log)] == ["a", "b", "c", "d", "e", "f", "g"]
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / "nothing" / EVENTS_FILE)


def test_max_bytes_comes_from_the_environment_once(monkeypatch, capsys):
    try:
        for value, expected in (("", DEFAULT_MAX_BYTES), ("12345", 12345), ("64K", 65536),
                                ("2MiB", 2 * 2**20), ("1g", 2**30)):
            monkeypatch.setenv(MAX_BYTES_ENV, value)
            max_bytes_from_env.cache_clear()
            assert max_bytes_from_env() == expected
        assert capsys.readouterr().err == ""
        for bad in ("lots", "0", "-5", "1.5M"):
            monkeypatch.setenv(MAX_BYTES_ENV, bad)
            max_bytes_from_env.cache_clear()
            assert max_bytes_from_env() == DEFAULT_MAX_BYTES
            assert max_bytes_from_env() == DEFAULT_MAX_BYTES  # parsed (and said) once
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and MAX_BYTES_ENV in err[0] and repr(bad) in err[0], err
    finally:
        monkeypatch.delenv(MAX_BYTES_ENV)
        max_bytes_from_env.cache_clear()


def test_a_failing_write_drops_and_counts_and_says_so_once(capsys):
    log = EventLog("/dev/full", source="agent")  # every write: ENOSPC
    records = [log.emit(Event.STEP, step=i) for i in range(5)]
    assert [r["step"] for r in records] == list(range(5)) and records[0]["source"] == "agent"
    assert log.dropped == 5
    log.close()
    log.close()
    assert log.emit(Event.STEP, step=5)["step"] == 5  # after close: nothing written, no raise
    err = capsys.readouterr().err.splitlines()
    assert err == ["unbroken: event log /dev/full: No space left on device; " + DROP_NOTICE,
                   "unbroken: 5 event(s) could not be written to /dev/full (disk full?)"]
