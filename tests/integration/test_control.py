"""The control package: typed messages over a real TCPStore on loopback, and the rules that
keep the protocol in one place (no key built outside the schema, no arrow running back up)."""

from __future__ import annotations

import time

import pytest
from conftest import wait_for

from unbroken.control.channel import Channel
from unbroken.control.etcd import EtcdBackend
from unbroken.control.messages import (
    AttemptPlan,
    Fault,
    FaultKind,
    GenPlan,
    Joiner,
    NodeLayout,
    Result,
    Status,
    SwitchTarget,
)
from unbroken.control.schema import RESULT, AttemptKeys, leader_watch
from unbroken.control.tcp import TcpBackend, serve_store


@pytest.fixture(params=["tcpstore", "etcd"])
def channel(request):
    """The same protocol over each backend: the embedded TCPStore and a real etcd."""
    if request.param == "etcd":
        yield Channel(EtcdBackend([request.getfixturevalue("etcd_endpoint")], "run"))
        return
    store, port = serve_store("127.0.0.1", 0, 10.0)
    yield Channel(TcpBackend(store, "run", "127.0.0.1", port))
    del store


def test_messages_round_trip_through_the_store_with_their_types(channel):
    keys = AttemptKeys(3)
    plan = AttemptPlan(attempt=3, world_size=4, worker_port=1234,
                       nodes={0: NodeLayout(0, 2, "a"), 1: NodeLayout(2, 2, "b")})
    channel.write(keys.plan, plan)
    assert channel.read(keys.plan) == plan  # int node keys and nested dataclasses come back
    fault = Fault(kind=FaultKind.HANG, rank=2, node=1, silent_for=1.5)
    channel.write(RESULT, Result(Status.FAILED, fault=fault, reason="why"))
    back = channel.read(RESULT)
    assert back.status is Status.FAILED and back.fault.kind is FaultKind.HANG and back.reason == "why"
    assert channel.read(keys.fault) is None


def test_compare_and_set_keeps_the_first_writer(channel):
    keys = AttemptKeys(0)
    first = channel.first(keys.fault, Fault(kind=FaultKind.CRASH, rank=1))
    second = channel.first(keys.fault, Fault(kind=FaultKind.EXIT, rank=2))
    assert first == second and second.rank == 1


def test_a_queue_append_is_read_in_order_and_notifies_the_planner(channel):
    keys = AttemptKeys(0)
    watches = isinstance(channel.backend, EtcdBackend)
    if watches:  # etcd: the planner's watch is its news
        channel.backend.watch(leader_watch(0))
        wait_for(lambda: channel.backend.changes() is not None and channel.backend.kv.mirror.live,
                 10, "the watch to start")
    before = channel.news(keys.news)
    assert before == (channel.backend.changes() if watches else 0)
    ids = [channel.append(keys.joiners, Joiner(f"{i}.1", i)) for i in range(3)]
    assert [channel.position(keys.joiners, rid) for rid in ids] == [0, 1, 2]
    if watches:
        wait_for(lambda: channel.news(keys.news) != before, 10, "the watch to see the appends")
        assert channel.count(keys.news) == 0  # no separate bump: the write is the news
    else:
        assert channel.count(keys.news) == 3  # one bump per notifying write, after it
    assert [j.slot for j in channel.entries(keys.joiners, 1)] == [1, 2]
    channel.bump(keys.gen(0).nready)  # not a notifying counter
    channel.bump(keys.gen(0).nup)
    assert channel.count(keys.news) == (0 if watches else 4)
    channel.backend.watch(None)


def test_a_slot_taken_but_never_filled_is_skipped_after_a_while(monkeypatch):
    """The TCPStore's queue: the state a writer leaves when the reply of its slot's add was
    lost and its retry took another slot. Readers wait HOLE_AFTER, then tombstone the slot
    and move past it; a writer merely slow to fill it finds it taken and takes another."""
    from unbroken.control import tcp

    monkeypatch.setattr(tcp, "HOLE_AFTER", 0.3)
    store, port = serve_store("127.0.0.1", 0, 10.0)
    channel = Channel(TcpBackend(store, "run", "127.0.0.1", port))
    keys = AttemptKeys(0)
    channel.backend.add(f"{keys.deaths.key}/n", 1)  # slot 0 taken, never filled
    channel.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=1))
    assert channel.entries(keys.deaths, 0) == []  # slot 0 may still be filled
    time.sleep(0.4)
    assert [d and d.rank for d in channel.entries(keys.deaths, 0)] == [None, 1]
    channel.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=2))
    assert [d and d.rank for d in channel.entries(keys.deaths, 0)] == [None, 1, 2]
    del store


def test_concurrent_adds_are_atomic_and_each_learns_its_own_position(channel):
    """Queue indexes and one-time claims rely on every concurrent adder getting a different
    value (etcd's tally counters once gave several adders the same one)."""
    from concurrent.futures import ThreadPoolExecutor

    counter = AttemptKeys(0).gen(0).nready
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: channel.bump(counter), range(40)))
    assert channel.count(counter) == 40
    claim = AttemptKeys(0).gen(0).nup
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: channel.claim(claim), range(40)))
    assert sorted(got) == list(range(1, 41))
    joiners = AttemptKeys(0).joiners
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda i: channel.append(joiners, Joiner(f"{i}.1", i)), range(24)))
    assert sorted(channel.position(joiners, rid) for rid in ids) == list(range(24))
    assert sorted(j.slot for j in channel.entries(joiners, 0)) == list(range(24))


def test_a_process_group_forms_over_the_backends_rendezvous_store(channel, tmp_path):
    """Two processes rendezvous a gloo group through `rendezvous_store` and all-reduce."""
    import subprocess
    import sys

    from conftest import REPO

    backend = channel.backend
    spec = (f"EtcdBackend({backend.endpoints!r}, 'run')" if isinstance(backend, EtcdBackend)
            else f"TcpBackend.connect('127.0.0.1', {backend.port}, 'run', 10)")
    code = f"""
import sys, torch, torch.distributed as dist
from unbroken.control.etcd import EtcdBackend
from unbroken.control.tcp import TcpBackend
rank = int(sys.argv[1])
store = {spec}.rendezvous_store("g/1/pg/", 30)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
t = torch.tensor([rank + 1.0]); dist.all_reduce(t); print(int(t.item()))
dist.destroy_process_group()
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == ["3", "3"]


def test_an_unreachable_etcd_is_one_clear_error():
    from conftest import free_port

    from unbroken.control.backend import StoreUnavailable

    backend = EtcdBackend([f"127.0.0.1:{free_port()}"], "run", timeout=1.0)
    with pytest.raises(StoreUnavailable, match="cannot reach etcd at .*is etcd running"):
        backend.get("current")


def test_signed_messages_reject_forgeries_and_replays(channel):
    from unbroken.control.signing import Signer

    keys = AttemptKeys(0)
    reported = []
    signed = Channel(channel.backend, Signer(b"k" * 32), lambda key, why: reported.append(key))
    signed.write(keys.target, SwitchTarget(gen=1, step=5))
    assert signed.read(keys.target) == SwitchTarget(gen=1, step=5)
    channel.write(keys.target, SwitchTarget(gen=9, step=0))  # unsigned: a forger's
    assert signed.read(keys.target) is None and signed.read(keys.target) is None
    assert reported == [keys.target.key]  # reported once, not at every look
    other = Channel(channel.backend, Signer(b"x" * 32))  # the wrong secret
    other.write(keys.target, SwitchTarget(gen=2, step=0))
    assert signed.read(keys.target) is None
    # A validly signed message copied to another key is rejected there too.
    signed.write(keys.gen(1).plan, GenPlan(gen=1, members=["0.0"]))
    channel.backend.set(keys.gen(2).plan.key, channel.backend.get(keys.gen(1).plan.key))
    assert signed.read(keys.gen(2).plan) is None
    # A forged entry in a queue stands as None, so that readers move past it.
    channel.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=0))
    signed.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=1))
    assert [d and d.rank for d in signed.entries(keys.deaths, 0)] == [None, 1]
