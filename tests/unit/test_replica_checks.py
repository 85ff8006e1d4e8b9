"""The replica checks' executor: when a check is due, and what a verdict makes a rank raise."""

from __future__ import annotations

from unbroken.errors import JobStopped, SdcGuilty
from unbroken.runtime.anomalies.replica_checks import ReplicaChecks, ReplicaVerdict
from unbroken.runtime.anomalies.replicas import Pending, ReplicaState
from unbroken.runtime.config import SdcConfig


def test_a_disputed_step_is_checked_again_whatever_k_became():
    checks = ReplicaChecks(SdcConfig(enabled=True, every=50), emit=lambda e: None)
    assert not checks.due(15, at_copy=False) and checks.due(50, at_copy=False)
    assert checks.due(15, at_copy=True)  # before a copy, always
    checks.state = ReplicaState(last_verified=10, pending=Pending(
        step=15, slots=(0, 1), classes=(0,), sums=((1, 1), (2, 2))))
    assert checks.due(15, at_copy=False) and not checks.due(14, at_copy=False)
    checks.now = True  # after a finding its rerun did not reproduce
    assert checks.due(14, at_copy=False)


def test_k_follows_the_mean_of_the_recent_checks():
    """The budget is about the checks' total time: their mean, not their slowest (one late
    gather would hold K at the cap) nor their median (which under-counts slow gathers)."""
    checks = ReplicaChecks(SdcConfig(enabled=True), emit=lambda e: None)
    checks.seconds = [0.5] + [0.001] * 9 + [0.011]  # the oldest, out of the last 20: forgotten
    checks.seconds = [0.5] * 5 + checks.seconds[1:] * 2  # 25 checks; the 5 slow ones oldest
    assert checks._proposal(step_time=0.1, copy_every=None) == 4  # 2 ms / (0.5 % of 100 ms)


def test_what_a_verdict_makes_a_rank_raise():
    assert ReplicaVerdict(clean=True).error(0, 5, restored=True) is None
    blamed = ReplicaVerdict(clean=False, rollback=True, replace_me=True)
    assert isinstance(blamed.error(2, 15, restored=True), SdcGuilty)
    assert ReplicaVerdict(clean=False, rollback=True).error(0, 15, restored=True) is None
    nowhere = ReplicaVerdict(clean=False, rollback=True).error(0, 15, restored=False)
    assert isinstance(nowhere, JobStopped) and "checkpoint_dir" in str(nowhere)
    stop = ReplicaVerdict(clean=False, stop="apart").error(0, 15, restored=True)
    assert isinstance(stop, JobStopped) and str(stop) == "apart"
