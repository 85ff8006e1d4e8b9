"""The pure parts of sharded recovery: which step a new generation resumes from and where
each shard comes from (`shard_plan`), the buddy ring, the snapshot interval, and the
double buffers that keep the newest whole snapshot. No processes."""

from __future__ import annotations

from unbroken.runtime.sharded.host_copy import Copy, auto_every, buddies, host_bytes, writable
from unbroken.runtime.sharded.shard_plan import (
    Holding,
    ShardPlan,
    Transfer,
    Unrecoverable,
    plan_shards,
)


def _fsdp_after_death(dead: int, live_step: int, snap_step: int, world: int = 4) -> list[Holding]:
    """FSDP over `world` ranks, rank `dead` replaced by a newcomer holding nothing; every
    survivor holds its live state, its own snapshot and its left neighbour's snapshot."""
    out = []
    for m in range(world):
        if m == dead:
            continue
        out.append(Holding(m, m, live_step, live=True))
        out.append(Holding(m, m, snap_step, live=False))
        out.append(Holding(m, (m - 1) % world, snap_step, live=False))
    return out


def test_fsdp_rolls_back_to_the_snapshot_and_the_newcomer_gets_it_from_the_buddy():
    plan = plan_shards([0, 1, 2, 3], _fsdp_after_death(dead=1, live_step=12, snap_step=10))
    assert plan == ShardPlan(step=10, restore=frozenset({0, 2, 3}),
                             transfers=(Transfer(src=2, dst=1, live=False),), rolled_back=True)


def test_hsdp_takes_the_live_replica_and_nobody_rolls_back():
    # 2 x 2: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1; rank 1 is new.
    holdings = [Holding(m, m % 2, 12, live=True) for m in (0, 2, 3)]
    holdings += [Holding(m, m % 2, 10, live=False) for m in (0, 2, 3)]
    plan = plan_shards([0, 1, 0, 1], holdings)
    assert plan == ShardPlan(step=12, restore=frozenset(),
                             transfers=(Transfer(src=3, dst=1, live=True),), rolled_back=False)


def test_a_shard_with_no_copy_anywhere_is_unrecoverable_and_says_which():
    holdings = [h for h in _fsdp_after_death(dead=1, live_step=12, snap_step=10)
                if h.member != 2]  # rank 2, the buddy of 1, is gone too
    result = plan_shards([0, 1, 2, 3], holdings)
    assert isinstance(result, Unrecoverable)
    assert "shard(s) [1] have no copy left" in result.reason


def test_copies_at_different_steps_only_are_unrecoverable_and_say_the_steps():
    holdings = [Holding(0, 0, 12, True), Holding(1, 1, 10, False)]
    result = plan_shards([0, 1], holdings)
    assert isinstance(result, Unrecoverable)
    assert "shard 0: steps [12]" in result.reason and "shard 1: steps [10]" in result.reason


def test_nothing_held_is_unrecoverable():
    assert isinstance(plan_shards([0, 1], []), Unrecoverable)


def test_the_newest_common_step_wins_over_an_older_snapshot():
    holdings = _fsdp_after_death(dead=1, live_step=12, snap_step=10)
    holdings += [Holding(m, s, 5, False) for m in (0, 2, 3) for s in range(4)]
    assert plan_shards([0, 1, 2, 3], holdings).step == 10


def test_senders_take_turns_and_live_senders_come_first():
    # Two newcomers (1 and 3) for shard 1 under 4 x 1 HSDP-like replication.
    holdings = [Holding(0, 1, 7, live=True), Holding(2, 1, 7, live=True),
                Holding(0, 1, 5, live=False)]
    plan = plan_shards([1, 1, 1, 1], holdings)
    assert plan.step == 7
    assert plan.transfers == (Transfer(0, 1, True), Transfer(2, 3, True))
    assert plan.restore == frozenset()


def test_a_survivor_that_lost_its_live_state_restores_its_own_snapshot():
    holdings = [Holding(0, 0, 10, False), Holding(1, 1, 10, False), Holding(1, 1, 11, True)]
    plan = plan_shards([0, 1], holdings)
    assert plan.step == 10 and plan.restore == frozenset({0, 1}) and plan.rolled_back


def test_buddies_form_a_ring_across_nodes():
    # 2 nodes x 2: rank r's snapshot goes to the same local rank on the other node.
    assert [buddies(r, 4, 2, 1) for r in range(4)] == [([2], [2]), ([3], [3]), ([0], [0]),
                                                       ([1], [1])]
    # 3 nodes x 2, two replicas: both other nodes.
    assert buddies(0, 6, 2, 2) == ([2, 4], [4, 2])
    # One node: the next rank (there is no other node).
    assert buddies(3, 4, 4, 1) == ([0], [2])
    # More replicas than other ranks: each once, never ourselves.
    assert buddies(0, 2, 1, 3) == ([1], [1])


def test_the_interval_keeps_a_round_within_one_percent_of_step_time():
    assert auto_every(0.1, 1.0) == 10
    assert auto_every(0.001, 1.0) == 1
    assert auto_every(0.5, 0.02) == 2500
    assert auto_every(0.1, 0.0) == 1


def test_the_interval_is_never_longer_than_the_checkpoint_interval():
    # A restart from storage must never redo fewer steps than an in-place recovery.
    assert auto_every(0.23, 1.0, cap=20) == 20
    assert auto_every(0.1, 1.0, cap=20) == 10
    assert auto_every(0.5, 0.02, cap=1) == 1


def test_host_memory_is_one_own_copy_and_two_per_buddy():
    # Today's 5 x shard with one replica (a checkpoint's staging buffers, two own buffers,
    # two of the buddy's) is 3 x: the checkpoint persists from the own copy.
    assert host_bytes(100, 0) == 100
    assert host_bytes(100, 1) == 300
    assert host_bytes(100, 2) == 500


def test_a_round_never_overwrites_the_newest_whole_snapshot():
    pair = [Copy(step=10), Copy(step=5)]
    assert writable(pair) is pair[1]
    pair[1].step = -1  # being filled: a half-received copy is never whole
    assert writable(pair) is pair[1]  # a failed round's buffer is reused, 10 survives
    pair = [Copy(step=-1), Copy(step=-1)]
    assert writable(pair) is pair[0]


def test_snapshots_that_do_not_fit_in_host_memory_are_refused_with_the_figures():
    from unbroken.runtime.sharded.host_copy import refusal

    mib = 2**20
    assert refusal(200 * mib, 1, 1000 * mib) is None  # 600 MiB of 1000: fits
    why = refusal(400 * mib, 1, 1000 * mib)  # 1200 MiB of 1000
    assert why is not None and "1200 MiB" in why and "1000 MiB is available" in why
    assert "(1 + 2 x 1 replica(s)) x 400 MiB" in why and "storage checkpoint" in why


def test_a_layout_aligns_every_tensor_so_any_dtype_views_it_in_place():
    import torch

    from unbroken.checkpoint.host_buffer import ALIGN, Layout
    from unbroken.runtime.generations.state_sync import byte_view
    from unbroken.runtime.sharded.host_copy import chunks

    tensors = [torch.arange(3, dtype=torch.int8), torch.zeros(0), torch.randn(5, 7),
               torch.tensor(3.0, dtype=torch.float64), torch.arange(4, dtype=torch.int64)]
    layout = Layout.of(tensors)
    assert layout.sizes == (3, 0, 140, 8, 32)
    assert all(o % ALIGN == 0 for o in layout.offsets)
    assert layout.total == 64 + 0 + 192 + 64 + 64
    flat = torch.zeros(layout.total, dtype=torch.uint8)
    for dst, t in zip(layout.slices(flat), tensors, strict=True):
        dst.copy_(byte_view(t))
    back = [raw.view(t.dtype).view(t.shape)  # no clone: every offset is aligned
            for raw, t in zip(layout.slices(flat), tensors, strict=True)]
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))
    assert back[2].data_ptr() == flat.data_ptr() + layout.offsets[2]
    # The exchange's messages: the same pieces on both sides, none empty.
    assert [p.numel() for p in chunks(layout.slices(flat))] == [3, 140, 8, 32]
