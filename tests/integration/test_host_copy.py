"""One host copy of the state, three uses, between two real processes (FSDP2 over gloo):
the storage checkpoint persists from the snapshot round's own copy, and loads bit-identical
to one staged the old way; a rollback restores exactly the copy's step, RNG included."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
from conftest import free_port


def _model():
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _worker(rank: int, port: int, root: str, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.checkpoint.checkpointer import Checkpointer
    from unbroken.runtime.sharded.shards import LocalShards
    from unbroken.runtime.sharded.snapshot_pacer import SnapshotPacer
    from unbroken.runtime.sharded.snapshots import PeerSnapshots
    from unbroken.runtime.tracked import TrackedState

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    model, opt = _model()
    tracked = TrackedState(model, [opt], {})
    shards = LocalShards(model, [opt], {})
    snaps = PeerSnapshots(shards, replicas=1, every=5, record=lambda *a, **k: None)
    snaps.use_group(dist.new_group(backend="gloo", timeout=timedelta(seconds=20)), rank, 2, 1)
    pacer = SnapshotPacer(snaps, available=2**40, record=lambda e: None, say=lambda line: None)
    old_way = Checkpointer(f"{root}/old", group=dist.new_group(backend="gloo"))
    shared = Checkpointer(f"{root}/shared", group=dist.new_group(backend="gloo"))
    for ck in (old_way, shared):
        ck.protect(model, [opt])
    at_10 = rng_10 = None
    for step in range(1, 13):
        model(torch.randn(6, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.rand(3)  # the RNG moves on between steps
        if step == 10:
            at_10 = [t.clone() for t in shards.tensors()]
            rng_10 = torch.get_rng_state()
        image = pacer.after_commit(step, last_step=100, step_seconds=0.1,
                                   checkpoint_due=step == 10, checkpoint_every=10)
        if step == 10:  # one save from the round's own copy, one staged in buffers of its own
            assert image is not None
            assert shared.start(tracked.state_dict(10), 10, image=image)
            assert old_way.start(tracked.state_dict(10), 10)
        elif image is not None:
            raise AssertionError(f"a host copy was offered at step {step}, with no checkpoint")
    for ck in (old_way, shared):
        assert ck.wait(60)
    # How much the shared save's writer staged in buffers of its own: the small items only.
    own_staged = sorted("/" + "/".join(map(str, p)) for p in shared._staging.paths)
    old_staged = sorted("/" + "/".join(map(str, p)) for p in old_way._staging.paths)

    # Rollback: from step 12 back to the copy of step 10, with no storage read.
    moved = not all(torch.equal(a, b) for a, b in zip(at_10, shards.tensors(), strict=True))
    back_to = snaps.rollback()
    rolled = all(torch.equal(a, b) for a, b in zip(at_10, shards.tensors(), strict=True))
    rng_same = torch.equal(torch.get_rng_state(), rng_10)

    # Both checkpoints, loaded into fresh models: every tensor equal, to each other and to
    # the live state of step 10.
    loaded = []
    for ck_dir in ("old", "shared"):
        fresh, fresh_opt = _model()
        LocalShards(fresh, [fresh_opt], {}).prime()
        fresh_tracked = TrackedState(fresh, [fresh_opt], {})
        state = fresh_tracked.state_dict(0)
        step = Checkpointer(f"{root}/{ck_dir}", group=dist.new_group(backend="gloo"),
                            clean_stale=False).load_latest(state)
        fresh_tracked.restore(state)
        loaded.append((step, [t.clone() for t in LocalShards(fresh, [fresh_opt], {}).tensors()],
                       state["unbroken"]["rng_cpu"].clone()))
    (s_old, t_old, r_old), (s_shared, t_shared, r_shared) = loaded
    out.put({
        "rank": rank, "back_to": back_to, "moved": moved, "rolled": rolled,
        "rng_same": rng_same, "steps": (s_old, s_shared),
        "equal": len(t_old) == len(t_shared) and all(
            torch.equal(a, b) for a, b in zip(t_old, t_shared, strict=True)),
        "equal_live": all(torch.equal(a, b) for a, b in zip(t_shared, at_10, strict=True)),
        "rng_equal": torch.equal(r_old, r_shared),
        "own_staged": own_staged, "old_staged": old_staged,
        "holdings": sorted(snaps.holdings()),
    })
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("host-copy")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(root), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = sorted((out.get(timeout=180) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


def test_a_checkpoint_from_the_shared_copy_loads_bit_identical_to_one_staged_the_old_way(
        results):
    for r in results:
        assert r["steps"] == (10, 10)
        assert r["equal"] and r["equal_live"] and r["rng_equal"], r
    # The shared save copied no tensor of the model or the optimizer again: it staged in a
    # buffer of its own only the step and the RNG state; the old way, everything. Each
    # replicated tensor is staged by one rank only, its writer (`checkpoint/writers.py`).
    own = [name for r in results for name in r["own_staged"]]
    assert sorted(own) == ["/unbroken/rng_cpu", "/unbroken/step"], results
    # The old way: every rank stages its own shards (6 parameters and AdamW's 2 x 6 moments:
    # DTensors), and the 11 replicated plain tensors (BN's 3 buffers, AdamW's 6 step counts,
    # the step, the RNG state) are staged once in all, by their writers.
    old = [name for r in results for name in r["old_staged"]]
    assert len(set(old)) == 2 + 6 + 3 + 6 * 3, old
    assert len(old) == 2 * 18 + 11, old


def test_a_rollback_restores_exactly_the_state_of_the_copys_step(results):
    for r in results:
        assert r["moved"], "the state must have moved on from step 10 before the rollback"
        assert r["back_to"] == 10
        assert r["rolled"] and r["rng_same"], r
        # One own copy (of 10); the buddy's two (5 and 10), of which 5 goes at the next round.
        mine, theirs = r["rank"], 1 - r["rank"]
        assert r["holdings"] == sorted([(mine, 10), (theirs, 5), (theirs, 10)]), r


def test_a_replicated_rollback_restores_the_checkpoints_host_copy_not_storage(tmp_path):
    """The engine in-process (as tests/unit/test_engine.py drives it), with a real
    checkpointer: a replicated job's rollback copy is the checkpoint's staged copy, so there
    is no second copy and no storage read (the directory is emptied before the rollback)."""
    import shutil

    import torch
    from builders import Recorder
    from unit.test_engine import FakeMembership, _engine

    from unbroken.checkpoint.checkpointer import Checkpointer
    from unbroken.checkpoint.interval import Schedule

    membership, events = FakeMembership(), Recorder()
    ckpt = Checkpointer(tmp_path / "ckpt", record=events.emit, schedule=Schedule(every_steps=5))
    engine, _ = _engine(membership, events, checkpointer=ckpt)
    engine.tracked.optimizers[0].param_groups[0]["momentum"] = 0.9  # state to stage
    engine.start(8, build=None, shadow_step=lambda step, view: None)
    at_5 = rng_5 = None
    while (step := engine.begin()) is not None and step < 7:
        engine.enter(step)
        engine.view(torch.ones(2, 4)).sum().backward()
        engine.tracked.update()
        engine.commit(step)
        if engine.position.step == 5:  # committed step 5: the checkpoint's step
            at_5 = {k: v.clone() for k, v in engine.tracked.model.state_dict().items()}
            rng_5 = torch.get_rng_state()
    assert ckpt.wait(30)
    assert [e["step"] for e in events.named("checkpoint_saved")] == [5]
    shutil.rmtree(tmp_path / "ckpt")
    torch.rand(5)  # the RNG moves on
    assert engine.rollback("a loss spike") == 5
    assert engine.position.step == 5
    now = engine.tracked.model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in at_5.items())
    assert torch.equal(torch.get_rng_state(), rng_5)
    rolled, = events.named("rolled_back")
    assert (rolled["step"], rolled["from_step"], rolled["restored_from"]) == (5, 7, "host")
    assert not events.named("checkpoint_loaded")
    # The optimizer's state is its own again, not the staged copy's buffers (which the next
    # save overwrites, and which its writer reads while training goes on).
    staged = {t.data_ptr() for t in ckpt._staging._raws}
    live = [v for s in engine.tracked.optimizers[0].state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.numel()]
    assert live and not [v for v in live if v.data_ptr() in staged]
    engine.close()
