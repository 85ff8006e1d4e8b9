"""The control plane's scale properties on real stores (a real etcd, a real TCPStore), through
a proxy that loses what a blip loses (tests/proxy.py): a retried write counts once and
leaves no gap; a watch that lost its place to compaction reads everything again; a watch
stream that confirms only some of its watches is opened again; a deposed
leader's write is refused; an idle look costs the same at 8 agents as at 64."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import wait_for
from proxy import Proxy

from unbroken.control.backend import Fenced
from unbroken.control.channel import Channel
from unbroken.control.etcd import EtcdBackend
from unbroken.control.etcd_watch import CREATE_WAIT
from unbroken.control.lease import LeaseWatch
from unbroken.control.messages import Fault, FaultKind, LeaderClaim, Result, Status
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import (
    LEADER,
    RESULT,
    AttemptKeys,
    Watched,
    agent_lease,
    fault_claim,
    leader_watch,
)
from unbroken.control.tcp import TcpBackend, serve_store


@pytest.fixture(params=["tcpstore", "etcd"])
def through_proxy(request):
    """(a channel whose store is reached through a proxy, the proxy, a direct channel)."""
    if request.param == "etcd":
        endpoint = request.getfixturevalue("etcd_endpoint")
        host, port = endpoint.split(":")
        proxy = Proxy((host, int(port)))
        backend = RetryingBackend(lambda: EtcdBackend([proxy.endpoint], "run", 2.0), window=10)
        yield Channel(backend), proxy, Channel(EtcdBackend([endpoint], "run"))
        proxy.close()
        return
    store, port = serve_store("127.0.0.1", 0, 10.0)
    proxy = Proxy(("127.0.0.1", port))
    backend = RetryingBackend(lambda: TcpBackend.connect("127.0.0.1", proxy.port, "run", 5.0),
                              window=10)
    yield Channel(backend), proxy, Channel(TcpBackend(store, "run", "127.0.0.1", port))
    proxy.close()
    del store


def _deaths(channel: Channel) -> list[int | None]:
    return [d and d.rank for d in channel.entries(AttemptKeys(0).deaths, 0)]


def test_an_append_whose_reply_was_lost_is_retried_and_counted_once(through_proxy):
    channel, proxy, direct = through_proxy
    deaths = AttemptKeys(0).deaths
    channel.append(deaths, Fault(kind=FaultKind.CRASH, rank=0))
    # etcd: the next put is the entry itself; TCPStore: the fill of slot 1.
    tcp = isinstance(direct.backend, TcpBackend)
    proxy.drop_reply(f"{deaths.key}/1".encode() if tcp else b"/v3/kv/put")
    rid = channel.append(deaths, Fault(kind=FaultKind.CRASH, rank=1))
    assert proxy.dropped == 1  # the write reached the store; its answer did not
    channel.append(deaths, Fault(kind=FaultKind.CRASH, rank=2))
    assert _deaths(direct) == [0, 1, 2]  # no double entry, no gap
    assert direct.position(deaths, rid) == 1 if not tcp else channel.position(deaths, rid) == 1


def test_a_claim_whose_reply_was_lost_counts_once_on_etcd(etcd_endpoint):
    host, port = etcd_endpoint.split(":")
    proxy = Proxy((host, int(port)))
    try:
        channel = Channel(RetryingBackend(lambda: EtcdBackend([proxy.endpoint], "run", 2.0),
                                          window=10))
        claim = fault_claim("once")
        proxy.drop_reply(b"/v3/kv/put")
        assert channel.claim(claim) == 1
        assert proxy.dropped == 1
        assert channel.claim(claim) == 2  # the retried first claim was not counted twice
        assert channel.count(claim) == 2
    finally:
        proxy.close()


def test_a_watch_that_lost_its_place_to_compaction_reads_everything_again(etcd_endpoint):
    host, port = etcd_endpoint.split(":")
    proxy = Proxy((host, int(port)))
    direct = EtcdBackend([etcd_endpoint], "run")
    watcher = EtcdBackend([proxy.endpoint], "run", 2.0)
    try:
        direct.set("w/a", "1")
        watcher.watch([Watched("w/", prefix=True)])
        mirror = watcher.kv.mirror
        wait_for(lambda: mirror.live, 10, "the watch to start")
        direct.set("w/b", "2")
        wait_for(lambda: mirror.get("w/b") not in (None, False), 10, "the change to arrive")
        proxy.cut()  # a partition: the stream breaks, the copy stops answering
        wait_for(lambda: not mirror.live, 20, "the watch to notice the cut")
        direct.set("w/c", "3")
        direct.kv.write([{"request_delete_range": {"key": direct.kv.path("w/a")}}], "w/a")
        revision = int(direct.kv.call("kv/range", {"key": direct.kv.path("w/c")})["header"]["revision"])
        direct.kv.call("kv/compaction", {"revision": str(revision)})
        proxy.mend()
        wait_for(lambda: mirror.live and mirror.resyncs == 1, 30, "a full re-read")
        before = watcher.kv.requests
        assert watcher.get_many(["w/a", "w/b", "w/c"]) == [None, "2", "3"]
        assert watcher.kv.requests == before  # answered by the copy: no request
        direct.set("w/d", "4")  # and it follows changes again
        wait_for(lambda: watcher.get("w/d") == "4", 10, "the watch to resume")
    finally:
        watcher.watch(None)
        proxy.close()


def test_a_watch_stream_that_confirms_only_some_watches_is_opened_again(etcd_endpoint):
    """etcd's gateway may stop reading a watch request's body once it replies: the stream
    then confirms only its first watch, whose events keep it busy (a leader's lease). It is
    opened again once CREATE_WAIT passes with no confirmation; its confirmations show a
    write since the copy's read, so the copy reads again before it says live, and the write
    made while the first stream was partial is in it from that moment (issue 41)."""
    host, port = etcd_endpoint.split(":")
    proxy = Proxy((host, int(port)))
    direct = EtcdBackend([etcd_endpoint], "run")
    watcher = EtcdBackend([proxy.endpoint], "run", 2.0)
    stop = threading.Event()

    def busy() -> None:  # the first watch's key changes every 0.2 s, as a lease does
        i = 0
        while not stop.is_set():
            direct.set("lease/busy", str(i))
            i += 1
            stop.wait(0.2)

    beats = threading.Thread(target=busy, daemon=True)
    beats.start()
    try:
        proxy.first_line_only(b"/v3/watch")
        watcher.watch([Watched("lease/busy"), Watched("b/", prefix=True)])
        mirror = watcher.kv.mirror
        direct.set("b/x", "1")  # under the watch the first stream never confirms
        wait_for(lambda: mirror.live, 10 * CREATE_WAIT, "the stream opened again, all confirmed")
        before = watcher.kv.requests
        assert mirror.reconnects >= 1 and "confirmed 1 of 2 watches, then none" in str(mirror.last_error)
        assert mirror.reads == 1  # after the reopen's confirmations: one read, never two
        assert watcher.get("b/x") == "1"  # from the copy, which missed nothing
        assert watcher.kv.requests == before

        # Again once the copy has read and been live: a blip, the reopened stream partial
        # again, and a write under the unconfirmed watch while it is.
        reconnects = mirror.reconnects
        proxy.first_line_only(b"/v3/watch")
        proxy.cut()
        proxy.mend()
        wait_for(lambda: mirror.reconnects > reconnects and proxy.withholding is None,
                 10 * CREATE_WAIT, "the stream opened again, its body cut to one watch")
        direct.set("b/y", "2")
        wait_for(lambda: mirror.live, 10 * CREATE_WAIT, "the stream opened again, all confirmed")
        before = watcher.kv.requests
        assert mirror.reads == 2  # the lease moved since the first read: read again
        assert watcher.get("b/y") == "2" and watcher.get("b/x") == "1"
        assert watcher.kv.requests == before
    finally:
        stop.set()
        beats.join(5)
        watcher.watch(None)
        proxy.close()


def test_a_deposed_leaders_write_is_refused_and_changes_nothing(etcd_endpoint):
    old = Channel(EtcdBackend([etcd_endpoint], "run"))
    new = Channel(EtcdBackend([etcd_endpoint], "run"))
    first = LeaderClaim(node=0, instance="a", term=0)
    assert old.first(LEADER, first) == first
    old.fence_on(LEADER, first)
    old.write(RESULT, Result(Status.FAILED))  # while it leads, it writes
    assert new.replace(LEADER, first, LeaderClaim(node=1, instance="b", term=1))
    new.backend.set(RESULT.key, "")
    with pytest.raises(Fenced, match="another agent leads now"):
        old.write(RESULT, Result(Status.SUCCESS))
    with pytest.raises(Fenced):
        old.append(AttemptKeys(0).deaths, Fault(kind=FaultKind.CRASH, rank=0))
    with pytest.raises(Fenced):
        old.first(AttemptKeys(0).fault, Fault(kind=FaultKind.CRASH, rank=0))
    assert new.backend.get(RESULT.key) == ""
    assert new.entries(AttemptKeys(0).deaths, 0) == []
    assert new.read(AttemptKeys(0).fault) is None


def _idle_look_requests(endpoint: str, agents: int, looks: int = 20) -> int:
    """The requests the leader's looks make while nothing happens, with `agents` agents
    holding leases: its watch answers the lease silences, the claim check and the inbox."""
    run = f"idle{agents}"
    holders = EtcdBackend([endpoint], run)
    for k in range(agents):
        holders.refresh_lease(agent_lease(k, f"i{k}").key)
    leader = EtcdBackend([endpoint], run)
    leader.watch(leader_watch(0))
    wait_for(lambda: leader.kv.mirror.live, 10, "the leader's watch")
    channel = Channel(leader)
    leases = LeaseWatch(leader, confirm_after=5.0)
    watched = [agent_lease(k, f"i{k}") for k in range(agents)]
    keys = AttemptKeys(0)
    leases.silent_many(watched, time.monotonic())
    before = leader.kv.requests
    for _ in range(looks):
        leases.silent_many(watched, time.monotonic())
        channel.read(LEADER)
        channel.news(keys.news)
        channel.entries(keys.standbys, 0)
        channel.entries(keys.deaths, 0)
    made = leader.kv.requests - before
    leader.watch(None)
    return made


@pytest.mark.serial  # measures time: alone, never beside another test
def test_an_idle_look_costs_the_same_at_8_agents_as_at_64(etcd_endpoint):
    assert _idle_look_requests(etcd_endpoint, 8) == _idle_look_requests(etcd_endpoint, 64) == 0
