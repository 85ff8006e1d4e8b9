"""The control package's rules, in process: message types and codecs, and the rules that
keep the protocol in one place (no key built outside the schema, no arrow running back up).
The events' rules: tests/unit/test_event_schema.py. (Real stores:
tests/integration/test_control.py.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from unbroken.control.codec import decode
from unbroken.control.messages import (
    Fault,
    FaultKind,
)
from unbroken.control.worker_env import Role, WorkerEnv

SRC = Path(__file__).resolve().parents[2] / "src" / "unbroken"


def test_decoding_builds_only_declared_types():
    text = '{"kind": "crash", "rank": 1, "__class__": "os.system", "unknown": [1]}'
    fault = decode(Fault, text)
    assert fault == Fault(kind=FaultKind.CRASH, rank=1)
    with pytest.raises(ValueError):
        decode(Fault, '{"kind": "rm -rf"}')


def test_the_worker_environment_round_trips():
    env = WorkerEnv(rank=3, world_size=4, local_rank=1, attempt=2, control="tcp://127.0.0.1:4000",
                    in_place=True, slot=3, worker_id="3.1", joining=True,
                    role=Role.SPARE, run_dir="/tmp/x", heartbeat_file="/tmp/x/hb", agent_store=True)
    back = WorkerEnv.from_environ(env.to_environ())
    assert back == env
    plain = WorkerEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (plain.rank, plain.node_rank, plain.under_agent, plain.in_place) == (1, 1, False, False)


def _python_files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in (SRC / pkg).rglob("*.py")]


def test_no_store_key_is_built_outside_the_schema():
    key_shape = re.compile(r"""f?["'](a/|g/|unbroken/|claim/|lease/|ack/|news|current|result)""")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "control":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                    "get", "set", "add", "check", "compare_set", "wait"):
                for arg in node.args[:1]:
                    if isinstance(arg, (ast.Constant, ast.JoinedStr)) and key_shape.match(
                            ast.unparse(arg)):
                        offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("package, forbidden", [
    ("runtime", ("unbroken.launch",)),
    ("checkpoint", ("unbroken.launch", "unbroken.runtime")),
    ("control", ("unbroken.launch", "unbroken.runtime", "unbroken.checkpoint")),
])
def test_no_import_arrow_runs_back_up(package, forbidden):
    bad = [(p.name, m) for p in _python_files(package) for m in _imports(p)
           if m.startswith(forbidden)]
    assert bad == []


def test_a_watched_prefix_covers_exactly_the_keys_under_it():
    import base64

    from unbroken.control.etcd_watch import prefix_end, ranges
    from unbroken.control.schema import Watched

    assert prefix_end(b"a/0/") == b"a/00"  # '0' follows '/'
    (exact, under) = ranges("unbroken/run/", [Watched("leader"), Watched("a/0/", prefix=True)])
    assert base64.b64decode(exact["key"]) == b"unbroken/run/leader" and "range_end" not in exact
    start, end = (base64.b64decode(under[k]) for k in ("key", "range_end"))
    assert start <= b"unbroken/run/a/0/orders/1/x" < end
    assert not start <= b"unbroken/run/a/01/plan" < end  # attempt 1 is not attempt 0's


def test_a_follower_never_watches_the_leaders_inbox():
    """A recovery's N departures must not reach N followers (N^2 events): a follower's watch
    holds no queue the leader reads, and the leader's lease is in it once it is known."""
    from unbroken.control.messages import LeaderClaim
    from unbroken.control.schema import AttemptKeys, agent_lease, follower_watch, leader_watch

    keys = AttemptKeys(3)
    inbox = [keys.deaths.key, keys.gen(0).departures.key, keys.stalls.key, keys.joiners.key,
             keys.drains.key, keys.gen(0).nup.key, keys.news.key, agent_lease(5, "x").key]
    watched = follower_watch(3, 2, LeaderClaim(node=0, instance="i", term=0))
    for key in inbox:
        assert not any(key == w.key or (w.prefix and key.startswith(w.key)) for w in watched), key
    assert any(w.key == agent_lease(0, "i").key for w in watched)
    assert any(w.prefix and keys.orders(2).key + "/0" >= w.key for w in watched)
    leader = leader_watch(3)
    for key in inbox:
        assert any(w.prefix and key.startswith(w.key) for w in leader), key


class _Leases:
    """A store of lease tokens: what `LeaseWatch` reads, and how often, copy or fresh."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.stale: dict[str, int] = {}  # what a frozen copy would answer
        self.reads = self.fresh_reads = 0

    def get_many(self, keys, fresh=False):
        self.reads += 1
        self.fresh_reads += fresh
        source = self.tokens if fresh else {**self.tokens, **self.stale}
        return [str(source.get(k, 0)) for k in keys]


def test_a_silence_seen_in_a_frozen_copy_is_read_again_before_it_counts():
    from unbroken.control.lease import LeaseWatch
    from unbroken.control.schema import agent_lease

    store, lease = _Leases(), agent_lease(1, "a")
    watch = LeaseWatch(store, pause_limit=100, confirm_after=5.0)
    store.tokens[lease.key] = store.stale[lease.key] = 1
    assert watch.silent_for(lease, 0.0) == 0.0
    store.tokens[lease.key] = 2  # refreshed; the copy still says 1
    assert watch.silent_for(lease, 4.0) == 4.0 and store.fresh_reads == 0
    assert watch.silent_for(lease, 6.0) == 0.0 and store.fresh_reads == 1  # moved after all
    store.stale[lease.key] = 2  # the copy catches up
    assert watch.silent_for(lease, 7.0) == 1.0


def test_leases_are_read_at_most_every_so_often_and_their_clocks_run_between():
    from unbroken.control.lease import LeaseWatch
    from unbroken.control.schema import agent_lease

    store, leases = _Leases(), [agent_lease(k, "a") for k in range(3)]
    watch = LeaseWatch(store, pause_limit=100, every=0.5)
    assert watch.silent_many(leases, 0.0) == [0.0, 0.0, 0.0]
    assert watch.silent_many(leases, 0.3) == [0.3, 0.3, 0.3] and store.reads == 1
    store.tokens[leases[1].key] = 7
    assert watch.silent_many(leases, 0.6) == [0.6, 0.0, 0.6] and store.reads == 2


def test_a_quiet_agent_polls_the_tcpstore_less_the_more_nodes_share_it():
    from unbroken.launch.config import LaunchConfig

    def poll(nnodes: int, backend: str = "tcp") -> float:
        cfg = LaunchConfig(script="x.py")
        cfg.nnodes = nnodes
        if backend == "etcd":
            from unbroken.control.address import BackendKind
            cfg.backend = BackendKind.ETCD
        return cfg.quiet_poll

    assert poll(2) == 0.0 and poll(25) == 0.0  # every look, as before
    assert poll(100) == 0.2 and poll(2048) == 0.5  # a bounded load on the one store
    assert poll(2048, "etcd") == 0.25


def test_a_generations_rendezvous_clears_torchs_exception_dump_key_at_the_store_root():
    """torch's NCCL heartbeat monitor polls `exception_dump` at the root of the store under
    every prefix: a key one generation's failure left would kill every later process. The
    TCP backend's rendezvous store deletes it there first, and nothing of the job's keys."""
    import torch.distributed as dist

    from unbroken.control.tcp import TORCH_DUMP_KEY, rendezvous_on

    store = dist.HashStore()
    store.set("unbroken/job/kept", "1")
    store.set(TORCH_DUMP_KEY, b"\x07\x00\x00\x00")
    gen = rendezvous_on(store, "unbroken/job/g/1/pg/")
    assert not store.check([TORCH_DUMP_KEY]) and store.check(["unbroken/job/kept"])
    gen.set("x", "1")
    assert gen.check(["x"]) and not store.check(["x"])  # the generation's keys are prefixed
    rendezvous_on(store, "unbroken/job/g/2/pg/")  # nothing to delete: no error
