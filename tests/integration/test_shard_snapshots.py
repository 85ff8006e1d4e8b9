"""In-memory snapshots between two real processes: FSDP2 over gloo, the snapshot thread,
their pacer, and a buddy SIGKILLed in the middle of its send."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from datetime import timedelta

from conftest import free_port


def _worker(rank: int, port: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unbroken.runtime.sharded.shards import LocalShards
    from unbroken.runtime.sharded.snapshot_pacer import SnapshotPacer
    from unbroken.runtime.sharded.snapshots import PeerSnapshots

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 8)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    shards = LocalShards(model, [opt], {})
    snaps = PeerSnapshots(shards, replicas=1, every=5, record=lambda *a, **k: None)
    if rank == 1:  # the buddy dies mid-send: after its first chunk of step 10's round
        snaps.fault_point = lambda point, step: (
            os.kill(os.getpid(), signal.SIGKILL) if (point, step) == ("sent", 10) else None)
    snaps.use_group(dist.new_group(backend="gloo", timeout=timedelta(seconds=20)), rank, 2, 1)
    said: list = []
    # Made before the first update, as the engine makes it: AdamW's state does not exist yet.
    pacer = SnapshotPacer(snaps, available=2**40, record=said.append, say=lambda line: None)
    at_5 = None
    for step in range(1, 11):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            at_5 = [t.clone() for t in shards.tensors()]
        pacer.after_commit(step, last_step=100, step_seconds=0.1)  # step 5: agree, then take
        snaps.wait()
    # Rank 0: the round of step 10 failed, so no rank agreed it whole: rank 0's own copy
    # stays at step 5 (the only other copy of its shard was on the dead buddy), and of shard
    # 1 only the whole copy of step 5 is held. Load our copy of step 5 back: it must equal
    # the state we had then.
    snaps.restore(5)
    same = all(torch.equal(a, b) for a, b in zip(at_5, shards.tensors(), strict=True))
    config = [e for e in said if type(e).__name__ == "SnapshotConfig"]
    out.put({"holdings": sorted(snaps.holdings()), "failed": snaps.failed, "same": same,
             "config_bytes": [(c.shard_bytes, c.host_bytes) for c in config],
             "shard_bytes": shards.nbytes()})


def test_a_buddy_killed_mid_send_leaves_the_previous_copy_in_force():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    assert result["failed"], "the round with a dead buddy must fail"
    assert result["holdings"] == [(0, 5), (1, 5)], result
    assert result["same"]
    # The pacer said the size of the shards with the optimizer's state (3 x the parameters'
    # for AdamW), read when it decided, not when it was made; and every copy together is
    # 3 x that: one own copy (the checkpoint's too) and two of the buddy's.
    assert result["config_bytes"] == [(result["shard_bytes"], 3 * result["shard_bytes"])]
