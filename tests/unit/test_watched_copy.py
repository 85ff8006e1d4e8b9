"""The watched copy's revision bookkeeping (control/watched_copy.py), with no etcd and no
process: a stream is a script of what etcd's watch stream sends, in the order it may send
it. Above all: the copy holds every write before it says live (issue 41)."""

from __future__ import annotations

import random

import pytest

from unbroken.control.watched_copy import Change, Kv, WatchedCopy

LEASE, BUSY = 0, 1  # the two watches: an exact key, and a prefix


def put(key: str, revision: int, value: str) -> Change:
    return Change(key, revision, Kv(value.encode(), revision, revision))


def values(copy: WatchedCopy) -> dict[str, str]:
    return {k: kv.value.decode() for k, kv in copy.kvs.items()}


def test_a_reopen_after_a_partial_confirmation_holds_every_write_before_it_says_live():
    copy = WatchedCopy(2)
    assert copy.open() is None  # no read yet: from etcd's present revision
    assert copy.confirm(LEASE, 5) is False
    assert copy.confirm(BUSY, 5) is True  # the first read comes after the confirmations
    assert not copy.live
    copy.load({"lease": Kv(b"0", 2, 5)}, 5)
    assert copy.live and values(copy) == {"lease": "0"}

    copy.apply([put("lease", 6, "1")], 6)  # before the break
    copy.drop()
    assert not copy.live

    assert copy.open() == 7  # right after the newest revision seen
    assert copy.confirm(LEASE, 7) is False  # the gateway dropped the second create request
    copy.apply([put("lease", 8, "2")], 8)
    # b/x is written at 9, under the watch this stream never confirms: nothing delivers it
    copy.apply([put("lease", 10, "3")], 10)
    assert not copy.live
    copy.drop()  # CREATE_WAIT passed with no second confirmation

    assert copy.open() == 11
    assert copy.confirm(BUSY, 11) is False  # a confirmation is no catching up: b/x owed
    assert copy.confirm(LEASE, 11) is True  # whole, but past the last read: read first
    assert not copy.live and "b/x" not in copy.kvs
    copy.load({"lease": Kv(b"3", 2, 10), "b/x": Kv(b"1", 9, 9)}, 11)  # a write during it too
    assert copy.live and values(copy) == {"lease": "3", "b/x": "1"}

    # The unsynced watch now delivers what it owed, and the copy never steps back.
    copy.apply([put("b/x", 9, "1")], 11)
    copy.apply([put("lease", 12, "4")], 12)  # after it
    copy.apply([Change("b/x", 13, None)], 13)
    assert values(copy) == {"lease": "4"} and copy.revision == 13


def test_a_quiet_reopen_reads_nothing_and_a_busy_one_reads_once():
    copy = WatchedCopy(1)
    copy.open()
    assert copy.confirm(0, 3) is True
    copy.load({}, 3)
    copy.drop()
    assert copy.open() == 4
    assert copy.confirm(0, 3) is False and copy.live  # nothing since the read: synced
    copy.apply([put("k", 4, "a")], 4)
    copy.drop()
    assert copy.open() == 5
    assert copy.confirm(0, 4) is True and not copy.live  # a write since the read


def test_a_compaction_makes_the_next_stream_read_again():
    copy = WatchedCopy(1)
    copy.open()
    copy.confirm(0, 3)
    copy.load({"k": Kv(b"a", 2, 2)}, 3)
    copy.forget()
    assert not copy.live and copy.open() is None
    assert copy.confirm(0, 3) is True  # even with nothing written since


def test_events_at_or_below_the_read_are_skipped_and_a_foreign_watch_is_refused():
    copy = WatchedCopy(1)
    copy.open()
    copy.confirm(0, 9)
    copy.load({"k": Kv(b"new", 2, 8)}, 9)
    version = copy.version
    assert copy.apply([put("k", 4, "old")], 9) is False
    assert values(copy) == {"k": "new"} and copy.version == version
    with pytest.raises(ValueError, match="not one of this copy's 1"):
        copy.confirm(1, 9)
    with pytest.raises(ValueError, match="at least one watch"):
        WatchedCopy(0)


# ------------------------------------------------------------ against a model of etcd
class ModelEtcd:
    """etcd's watch semantics that the copy relies on, and no more: one revision counter;
    a watch created with a start revision in the past is confirmed at once and sends what
    it missed later; each watch sends its own events in order; a confirmation carries the
    current revision; the gateway may drop create requests past the first."""

    KEYS = {"lease": LEASE, "b/x": BUSY, "b/y": BUSY}

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.rev = 1
        self.history: list[tuple[int, str, str | None]] = []
        self.state: dict[str, str] = {}

    def write(self) -> None:
        self.rev += 1
        key = self.rng.choice(sorted(self.KEYS))
        value = None if self.rng.random() < 0.2 else str(self.rev)
        self.history.append((self.rev, key, value))
        if value is None:
            self.state.pop(key, None)
        else:
            self.state[key] = value

    def read(self) -> tuple[dict[str, Kv], int]:
        return {k: Kv(v.encode(), 0, 0) for k, v in self.state.items()}, self.rev

    def at(self, revision: int) -> dict[str, str]:
        """The keys' values at `revision`."""
        state: dict[str, str] = {}
        for r, key, value in self.history:
            if r > revision:
                break
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        return state

    def holds_every_write_up_to(self, held: dict[str, str], revision: int) -> bool:
        """`held` has, for each key, its value at `revision` or one written after it."""
        then = self.at(revision)
        for key in self.KEYS:
            later = {v for r, k, v in self.history if k == key and r > revision}
            if held.get(key) != then.get(key) and held.get(key) not in later:
                return False
        return True


def _drive(seed: int) -> int:
    rng = random.Random(seed)
    etcd = ModelEtcd(rng)
    copy = WatchedCopy(2)
    checks = 0
    for _stream in range(12):
        start = copy.open()
        open_rev = etcd.rev
        # per watch: the revision it sends from, and whether its confirmation was dropped
        send_from = {w: (etcd.rev + 1 if start is None else start) for w in (LEASE, BUSY)}
        dropped = rng.random() < 0.3
        unconfirmed = [LEASE] + ([] if dropped else [BUSY])
        rng.shuffle(unconfirmed)
        confirmed: list[int] = []
        for _step in range(rng.randint(3, 25)):
            choice = rng.random()
            if choice < 0.35:
                etcd.write()
            elif choice < 0.6 and unconfirmed:
                watch = unconfirmed.pop()
                confirmed.append(watch)
                confirmed_at = etcd.rev
                if copy.confirm(watch, confirmed_at):
                    copy.load(*etcd.read())
                if copy.live:
                    checks += 1
                    # Live: every write up to a revision read after the open is held.
                    read_after_open = max(copy.loaded, confirmed_at)
                    assert read_after_open >= open_rev
                    assert etcd.holds_every_write_up_to(values(copy), read_after_open), (
                        f"live at {read_after_open}, yet a write is missing: "
                        f"{values(copy)} against {etcd.at(read_after_open)}")
            elif confirmed:
                watch = rng.choice(confirmed)  # one batch of one watch, in its order
                batch = [(r, k, v) for r, k, v in etcd.history
                         if ModelEtcd.KEYS[k] == watch and r >= send_from[watch]]
                batch = batch[:rng.randint(1, 3)]
                if batch:
                    send_from[watch] = batch[-1][0] + 1
                    copy.apply([Change(k, r, None if v is None else Kv(v.encode(), r, r))
                                for r, k, v in batch], etcd.rev)
        if copy.live and not unconfirmed:
            for watch in (LEASE, BUSY):  # let every watch send what it owes
                batch = [(r, k, v) for r, k, v in etcd.history
                         if ModelEtcd.KEYS[k] == watch and r >= send_from[watch]]
                copy.apply([Change(k, r, None if v is None else Kv(v.encode(), r, r))
                            for r, k, v in batch], etcd.rev)
            assert values(copy) == etcd.state
            checks += 1
        copy.drop()
    return checks


@pytest.mark.parametrize("seed", range(200))
def test_the_copy_against_a_model_of_etcd_never_says_live_while_missing_a_write(seed):
    assert _drive(seed) > 0
