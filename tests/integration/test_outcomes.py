"""Honest outcomes: a job that cannot recover ends non-zero on every node, promptly, with a
line that says why. (Regression: with --max-restarts 0 the leader's lost worker made the
leader report success and the follower wait 120 s, then exit 0, at step 40 of 400.)"""

from __future__ import annotations

from conftest import EXAMPLE, MASTER_PORT, SCRIPTS, TINY, events_in, finish_on, start_on

EXAMPLE_ARGS = ["--steps", "400", *TINY]


def _two_nodes(hosts, *flags, script=None, args=None):
    """Two nodes on two hosts that share nothing (tests/netns.py), each with its own run dir."""
    procs = [start_on(hosts, k, "--nnodes", "2", "--node-rank", str(k), "--master-addr",
                      hosts.name(0), "--master-port", MASTER_PORT, "--nproc-per-node", "1",
                      "--rdzv-id", "job", "--node-timeout", "3", "--rdzv-timeout", "60", *flags,
                      script=script or EXAMPLE, args=args or EXAMPLE_ARGS)
             for k in (0, 1)]
    return [finish_on(hosts, k, p, timeout=180) for k, p in enumerate(procs)]


def _job_events(results, name=None):
    """Both nodes' events, merged."""
    return events_in([r.run_dir for r in results], name)


def _assert_failed_promptly(results, why: str, bound: float = 30.0) -> None:
    for r in results:
        assert r.code == 1, r.output
        assert "giving up after" in r.output and why in r.output, r.output
    events = _job_events(results)
    fault_t = min(e["t"] for e in events if e["event"] in ("fault_injected", "fault"))
    exits = [e for r in results for e in r.events("agent_exit")]  # each in its agent's run dir
    assert [e["node"] for e in exits] == [0, 1] and all(e["code"] == 1 for e in exits)
    assert max(e["t"] for e in exits) - fault_t < bound, [e["t"] - fault_t for e in exits]
    assert not [e for e in events if e["event"] == "training_done"], "nobody trained to the end"


def test_the_leaders_only_worker_lost_with_no_budget_fails_every_node(isolated_hosts):
    results = _two_nodes(isolated_hosts, "--max-restarts", "0", "--fault", "crash:rank=0,step=40")
    _assert_failed_promptly(results, "the restart budget of 0 is spent")
    assert "rank 0 crash" in results[1].output  # the follower names the fault too


def test_the_followers_only_worker_lost_with_no_budget_fails_every_node(isolated_hosts):
    results = _two_nodes(isolated_hosts, "--max-restarts", "0", "--fault", "crash:rank=1,step=40")
    _assert_failed_promptly(results, "the restart budget of 0 is spent")
    assert "rank 1 crash" in results[0].output


def test_a_slot_nothing_can_refill_under_wait_fails_at_once(isolated_hosts):
    """Budget left, but no spare and every replacement crashes: under `wait` nobody waits
    out --join-timeout (60 s) for a rank that cannot come back."""
    args = ["--steps", "400", "--step-sleep", "0.02", "--replacements-crash"]
    results = _two_nodes(isolated_hosts, "--max-restarts", "2", "--on-fault", "wait",
                         "--fault", "crash:rank=1,step=20", script=SCRIPTS / "ckpt_train.py",
                         args=args)
    _assert_failed_promptly(results, "the restart budget of 2 is spent")
    replacements = _job_events(results, "replacement_started")
    assert replacements == results[1].events("replacement_started")  # node 1's, for rank 1
    assert len(replacements) == 2, replacements  # the budget paid for two; the third fault ends it


def test_a_worker_that_fails_after_training_to_the_end_is_no_fault(tmp_path):
    """Every rank trained to the end and reported done; one then exits non-zero (a crash in
    its teardown). The job succeeded: nothing to recover, no budget spent."""
    from conftest import launch

    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "0",
                    script=SCRIPTS / "ckpt_train.py",
                    args=["--steps", "10", "--exit-code-after-training", "3"])
    assert result.code == 0, result.output
    assert [e["slot"] for e in result.events("exit_after_done")] == [1]
    assert not result.events("fault")
