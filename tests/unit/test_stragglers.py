"""The straggler detector as a pure function: synthetic step times in, actions out.

Every series is seeded (random.Random, or numpy's default_rng where a test needs millions of
draws): a step's nominal time is 1 s, with N(1, 0.03) noise; a slow rank's time is a factor
of that. Points are gathered every `batch` steps: the point at step s holds steps s-batch
to s-1.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from unbroken.runtime.anomalies.stragglers import (
    BASELINE_POINTS,
    ActionKind,
    Clear,
    Drain,
    Flag,
    JobSlow,
    Point,
    decide,
    initial,
    point_ratio,
    reset,
    summary,
)
from unbroken.runtime.config import StragglerConfig, StragglerRemedy

ON = StragglerConfig(enabled=True)
DRAIN = StragglerConfig(enabled=True, remedy=StragglerRemedy.DRAIN)


def times(seed, steps, world, slow=(), noise=0.03):
    """Per step, every rank's own time; `slow`: (rank, factor, from step, to step) each."""
    rng = random.Random(seed)
    rows = []
    for step in range(steps):
        row = [rng.gauss(1.0, noise) for _ in range(world)]
        for rank, factor, start, end in slow:
            if start <= step < end:
                row[rank] *= factor
        rows.append(row)
    return rows


def run(rows, config=ON, state=None, first=0, slots=None, nodes=None):
    """Feed `rows` (steps from `first`) point by point: [(step, actions)] and the last state."""
    world = len(rows[0])
    slots = tuple(range(world)) if slots is None else slots
    nodes = tuple(s // 2 for s in slots) if nodes is None else nodes
    state = initial(config) if state is None else state
    out = []
    b = config.batch
    for j in range(len(rows) // b):
        own = tuple(zip(*rows[j * b:(j + 1) * b], strict=True))
        state, actions = decide(state, Point(first + (j + 1) * b, slots, nodes, own), config)
        out.extend((first + (j + 1) * b, a) for a in actions)
    return out, state


def only(out, kind):
    return [a for _, a in out if isinstance(a, kind)]


# 1, 2: a sustained 1.5x slowdown is flagged within 25 steps (+ a batch) of its onset

@pytest.mark.parametrize("world", [4, 2])
def test_a_sustained_one_and_a_half_times_slowdown_is_flagged_soon_after_its_onset(world):
    delays, onsets = [], []
    for seed in range(50):
        out, _ = run(times(seed, 400, world, slow=[(world - 1, 1.5, 100, 400)]))
        flag, = only(out, Flag)
        assert [type(a) for _, a in out] == [Flag]  # no other slot, no Drain, no JobSlow
        assert flag.slot == world - 1 and flag.node == (world - 1) // 2
        assert abs(flag.ratio - 1.5) < 0.2 and abs(flag.own_s / flag.peers_s - flag.ratio) < 1e-9
        assert not flag.drain and flag.reason == "remedy report"
        delays.append(flag.step - 100)
        onsets.append(flag.since_step - 100)
    assert max(delays) <= 25 + ON.batch, delays
    assert max(abs(o) for o in onsets) <= 10, onsets
    # measured: 4 points (4 k = 0.81, just over 0.8) or 5 when noise dips; the onset exact
    assert set(delays) == {20, 25} and set(onsets) == {0}, (delays, onsets)


def test_an_onset_inside_a_batch_is_flagged_as_soon():
    out, _ = run(times(7, 400, 4, slow=[(1, 1.5, 102, 400)]))
    flag, = only(out, Flag)
    assert flag.slot == 1 and flag.step - 102 <= 25 and abs(flag.since_step - 102) <= 10


def test_two_ranks_see_each_other_as_the_slow_one_sees_it():
    fast, slow = point_ratio([(1.0, 1.0, 1.0), (1.5, 1.5, 1.5)])
    assert slow == pytest.approx(1.5) and fast == pytest.approx(1 / 1.5)
    assert point_ratio([(1.0, 9.0, 1.0)]) == [1.0]  # no peers
    # leave-one-out medians: the slow rank does not lift its own reference
    assert point_ratio([(1.0,), (1.0,), (2.0,), (1.0,)]) == [1.0, 1.0, 2.0, 1.0]


# 3: 1.2x, from birth or later, is never flagged

@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("start", [0, 100])
def test_a_one_point_two_times_slower_rank_is_never_flagged(world, start):
    for seed in range(5):
        out, _ = run(times(seed, 2000, world, slow=[(0, 1.2, start, 2000)]))
        assert out == []


def test_mildly_heterogeneous_ranks_are_never_flagged():
    out, _ = run(times(3, 2000, 8, slow=[(r, 1 + 0.03 * r, 0, 2000) for r in range(8)]))
    assert out == []


# 4: jitter gives no flag

def jitter_flags(seed, series, p, config, steps=2000, world=4):
    """Flags over `series` seeded series where each rank-step is hit, with probability p, by
    an extra sleep uniform in (0, 3) x the step (so up to 4x its time)."""
    rng = np.random.default_rng(seed)
    b = config.batch
    points = steps // b
    slots, nodes = tuple(range(world)), tuple(r // 2 for r in range(world))
    flags = 0
    for _ in range(series // 50):  # 50 series at a time
        x = rng.normal(1.0, 0.03, (50, points * b, world))
        x += (rng.random(x.shape) < p) * rng.uniform(0.0, 3.0, x.shape)
        grouped = x.reshape(50, points, b, world).transpose(0, 1, 3, 2).tolist()
        for one in grouped:
            state = initial(config)
            for j, rows in enumerate(one):
                state, actions = decide(state, Point((j + 1) * b, slots, nodes,
                                                     tuple(map(tuple, rows))), config)
                flags += sum(a.kind == ActionKind.FLAG for a in actions)
    return flags


def test_sparse_jitter_gives_no_flag():
    """p = 0.05, the default config (batch 5): 300 series of 2000 steps x 4 ranks here, not
    1000, so that the unit tier runs in seconds. Measured outside the tier: 0 flags over
    1000 series for each of the seeds 0, 1, 3, 4 and 5."""
    assert jitter_flags(seed=1, series=300, p=0.05, config=ON) == 0


def test_dense_jitter_needs_a_batch_of_nine():
    """p = 0.2: 300 series with batch 9 give no flag (measured outside the tier: 2 flags
    over 5000 series, seeds 2 to 6, each 3 batches in a row with 5 of 9 steps hit); 100
    series with the default batch of 5 give flags (83 over 1000 series, seed 3)."""
    assert jitter_flags(seed=3, series=300, p=0.2, config=replace(ON, batch=9)) == 0
    assert jitter_flags(seed=3, series=100, p=0.2, config=ON) > 0


# 5: warm-up and reset

def test_nothing_is_updated_during_warm_up():
    state = initial(ON)
    rows = times(0, 5 * ON.warmup, 4, slow=[(2, 3.0, 0, 100)])
    out, after = run(rows, state=state)
    assert out == [] and after.tracks == {} and after.warmup_left == 0
    assert after.last_step == 5 * ON.warmup


def test_a_reset_restarts_warm_up_and_forgets_every_cusum_but_the_last_drain():
    out, state = run(times(0, 200, 4, slow=[(1, 1.5, 50, 200)]), config=DRAIN)
    drain, = only(out, Drain)
    assert state.tracks[1].flagged and state.tracks[1].cusum > 0 and state.last_drain == drain.step
    state = reset(state, DRAIN)
    assert state == replace(initial(DRAIN), last_drain=drain.step)
    # the slow rank is still slow: nothing during warm-up, then every CUSUM starts at 0
    out, state = run(times(1, 5 * (DRAIN.warmup + 1), 4, slow=[(1, 1.5, 0, 100)]),
                     config=DRAIN, state=state, first=200)
    assert out == []
    assert state.tracks[1].cusum == pytest.approx(math.log(1.5) / 2, abs=0.05)
    assert all(t.cusum == 0 for s, t in state.tracks.items() if s != 1)


# 6: cooldown

def test_two_flags_within_the_cooldown_give_one_drain():
    # slot 1 slow from step 100: flagged and drained; the drain switches (a reset) and a
    # spare on node 7 takes slot 1; then slot 3 slows from step 150
    out, state = run(times(0, 125, 4, slow=[(1, 1.5, 100, 125)]), config=DRAIN)
    first, = only(out, Flag)
    assert first.drain and only(out, Drain) == [Drain(slot=1, step=first.step)]
    state = reset(state, DRAIN)
    out, state = run(times(1, 400, 4, slow=[(3, 1.5, 25, 400)]), config=DRAIN, state=state,
                     first=125, nodes=(0, 7, 1, 1))
    second, = only(out, Flag)
    assert second.slot == 3 and second.step - first.step < DRAIN.cooldown
    assert not second.drain and second.reason.startswith("cooldown")
    # the cooldown delays its drain, it does not forget it
    drain, = only(out, Drain)
    assert drain.slot == 3 and drain.step == first.step + DRAIN.cooldown


def test_one_drain_a_point_the_slowest():
    out, state = run(times(0, 300, 4, slow=[(0, 1.8, 100, 300), (2, 1.9, 100, 300)]),
                     config=DRAIN)
    flags = only(out, Flag)
    assert [f.slot for f in flags] == [0, 2] and flags[0].step == flags[1].step
    assert flags[1].drain and not flags[0].drain and flags[0].reason.startswith("one drain")
    assert only(out, Drain) == [Drain(slot=2, step=flags[1].step)]


# 7: clear after the slowdown ends

def test_a_flag_clears_after_the_slowdown_ends():
    delays = []
    for seed in range(20):
        out, state = run(times(seed, 1000, 4, slow=[(2, 1.5, 100, 600)]))
        assert [(type(a), a.slot) for _, a in out] == [(Flag, 2), (Clear, 2)]
        clear, = only(out, Clear)
        delays.append(clear.step - 600)
        assert not state.tracks[2].flagged
    assert max(delays) <= 40, delays  # the CUSUM's cap: at most 1.2 to come down, 0.2 a point


# 8: the whole job slows: JobSlow, no Flag

def test_every_rank_slowing_together_is_a_job_slowdown_not_a_straggler():
    onset = 5 * (ON.warmup + BASELINE_POINTS) + 100
    out, state = run(times(0, 1200, 4, slow=[(r, 1.5, onset, 900) for r in range(4)]))
    job, = only(out, JobSlow)
    assert [type(a) for _, a in out] == [JobSlow]
    assert 0 < job.step - onset <= 30 and job.ratio == pytest.approx(1.5, abs=0.05)
    assert not state.job_slow  # re-armed once every rank was back to its baseline


def test_one_rank_alone_has_only_its_own_history():
    out, _ = run(times(0, 600, 1, slow=[(0, 1.5, 300, 600)]))
    assert [type(a) for _, a in out] == [JobSlow]


def test_one_slow_rank_is_not_a_job_slowdown():
    out, _ = run(times(0, 800, 2, slow=[(1, 1.5, 300, 800)]))
    assert [type(a) for _, a in out] == [Flag]


# membership, purity, contracts

def test_a_slot_that_leaves_is_forgotten_and_a_new_or_moved_one_starts_at_zero():
    out, state = run(times(0, 150, 4, slow=[(3, 1.5, 50, 150)]))
    assert state.tracks[3].flagged
    rows = times(1, 5, 4)
    own = tuple(zip(*rows, strict=True))
    state, actions = decide(state, Point(155, (0, 1, 2, 4), (0, 0, 5, 2), own), ON)
    assert actions == () and set(state.tracks) == {0, 1, 2, 4}
    moved, new, kept = state.tracks[2], state.tracks[4], state.tracks[0]
    assert moved.node == 5 and moved.history == (sorted(own[2])[2],) and moved.baseline is None
    assert new.cusum == 0 and new.history == (sorted(own[3])[2],)
    assert kept.baseline is not None and kept.history == ()


def test_decide_is_a_pure_function():
    rows = times(0, 300, 4, slow=[(0, 1.5, 100, 300)])
    a, sa = run(rows, config=DRAIN)
    b, sb = run(rows, config=DRAIN)
    assert a == b and sa == sb
    point = Point(305, (0, 1, 2, 3), (0, 0, 1, 1), ((1.6,),) + ((1.0,),) * 3)
    assert decide(sa, point, DRAIN) == decide(sa, point, DRAIN)


@pytest.mark.parametrize("point", [
    Point(5, (), (), ()),
    Point(5, (0, 1), (0,), ((1.0,), (1.0,))),
    Point(5, (0, 0), (0, 0), ((1.0,), (1.0,))),
    Point(5, (0, 1), (0, 0), ((1.0,), ())),
])
def test_a_malformed_point_is_refused(point):
    with pytest.raises(ValueError):
        decide(replace(initial(ON), warmup_left=0), point, ON)


def test_the_summary_is_one_line():
    assert summary(ON) == ("stragglers: CUSUM on own step time vs peers, every 5 steps, tuned "
                           "for 1.5x, flag at 0.8 and >= 1.25x, warm-up 4 points; remedy report")
    assert summary(DRAIN).endswith("remedy drain (cooldown 200 steps)")
    assert summary(StragglerConfig()) == "stragglers: off"
