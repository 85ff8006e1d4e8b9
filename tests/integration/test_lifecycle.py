"""The agent's life: torchrun compatibility, clean stops, bad input, no orphans."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from conftest import (
    EXAMPLE,
    REPO,
    SCRIPTS,
    TINY,
    alive,
    assert_gave_up,
    events_of,
    finish,
    free_port,
    launch,
    start,
    unbroken_cmd,
    wait_for,
)


def test_plain_torchrun_script_runs_unmodified(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = launch(tmp_path / "run", "--nproc-per-node", "3", script=SCRIPTS / "plain_torchrun.py",
                    args=[str(out_dir), "--flag-for-the-script"])
    assert result.code == 0, result.output
    records = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, rec in enumerate(records):
        assert rec["RANK"] == str(rank) and rec["LOCAL_RANK"] == str(rank)
        assert rec["WORLD_SIZE"] == "3" and rec["LOCAL_WORLD_SIZE"] == "3"
        assert rec["GROUP_RANK"] == "0" and rec["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert rec["MASTER_ADDR"] == "127.0.0.1"
        assert rec["sum"] == 6.0  # 1 + 2 + 3: a real all-reduce over the group
        assert rec["argv"] == [str(out_dir), "--flag-for-the-script"]


def test_script_failing_at_import_stops_after_the_budget(tmp_path):
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "2",
                    script=SCRIPTS / "broken_import.py", timeout=180)
    assert_gave_up(result, 2, "ModuleNotFoundError: No module named 'this_module_does_not_exist'", 3)


def test_killing_the_agent_leaves_no_worker_or_child_alive(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", "--redirects", "3", "--log-dir",
                 str(tmp_path / "logs"), script=SCRIPTS / "sleeper.py")
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 60, "workers to start")
    workers = list(started[0]["pids"].values())
    def children_of_workers():
        logs = sorted(tmp_path.glob("logs/*/attempt_0/*/stdout.log"))
        pids = [int(t.split()[1]) for log in logs for t in log.read_text().splitlines()
                if t.startswith("child ")]
        return pids if len(pids) == 2 else None

    children = wait_for(children_of_workers, 60, "both workers to spawn a child")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in workers + children:
        wait_for(lambda pid=pid: not alive(pid), 10, f"process {pid} to die with its agent")


def test_sigterm_stops_workers_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", args=["--steps", "100000", *TINY])
    wait_for(lambda: events_of(run_dir, "step"), 90, "training to start")
    workers = events_of(run_dir, "workers_started")[0]["pids"].values()
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, run_dir, timeout=30)
    assert result.code == 143, result.output
    assert all(not alive(pid) for pid in workers)
    assert result.events("agent_exit")[-1]["code"] == 143


def test_a_sigterm_once_the_job_has_ended_does_not_change_its_exit_code(tmp_path):
    """A Job's other pods are ended (SIGTERM) as soon as one succeeds: a signal that comes
    while the agent exits after a success must leave its code 0 (CI once saw 143 here)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", script=SCRIPTS / "plain_torchrun.py",
                 args=[str(tmp_path)])
    wait_for(lambda: b"workers finished" in open(proc.output_file.name, "rb").read()
             or proc.poll() is not None, 120, "the job's end")
    while proc.poll() is None:  # from the outcome on, until the process is gone
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.002)
    result = finish(proc, run_dir, timeout=30)
    assert result.code == 0, result.output
    assert result.events("agent_exit")[-1]["code"] == 0


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(unbroken_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _one_line_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert res.returncode == code, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # one clear line, no traceback
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_drain_that_cannot_reach_its_job_is_one_line_and_exit_3():
    """(Every mistake found before anything starts: tests/unit/test_cli_errors.py.)"""
    port = free_port()  # nobody listens there
    _one_line_error(_cli("drain", "--master-port", str(port), "--rdzv-id", "x", "--rank", "0"),
                    3, "cannot reach")


def test_port_in_use_is_reported(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _cli("run", "--run-dir", str(tmp_path / "run"), "--master-port", str(port),
                   str(EXAMPLE), *TINY)
    assert res.returncode == 3, res
    assert f"port {port} on 127.0.0.1 is already in use" in res.stderr
    assert "Traceback" not in res.stderr


def test_module_mode(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    res = subprocess.run(
        unbroken_cmd("run", "--standalone", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2",
                     "-m", "plain_torchrun", str(out_dir)),
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads((out_dir / "rank1.json").read_text())["sum"] == 3.0


def test_runs_without_a_launcher(tmp_path):
    """The example (and the worker API) also runs as a plain single process."""
    res = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "5", *TINY,
                          "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ckpt" / "step_000000005" / "manifest.json").is_file()


def test_reused_run_dir_does_not_replay_old_faults(tmp_path):
    run_dir = tmp_path / "run"
    first = launch(run_dir, "--nproc-per-node", "2", "--on-fault", "restart",
                   "--fault", "exception:rank=1,step=3",
                   args=["--steps", "6", *TINY])
    assert first.code == 1
    assert (run_dir / "node_0" / "attempt_0" / "rank_1.error.json").exists(), first.output
    second = launch(run_dir, "--nproc-per-node", "2", args=["--steps", "6", *TINY])
    assert second.code == 0, second.output
    assert len(second.events("fault")) == 1  # only the first run's


def test_the_worker_api_under_torchrun_resumes_after_a_restart(tmp_path):
    """Under plain torchrun (its one agent store for every restart), `unbroken.init()`
    rendezvouses under a prefix of its own per restart, even with UNBROKEN_RUN_DIR set for
    events (regression: a restart read the dead workers' addresses and hung)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.1",
           str(EXAMPLE), "--steps", "400", *TINY]
    env = {**os.environ, "UNBROKEN_RUN_DIR": str(run_dir)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=REPO, start_new_session=True)
    try:
        wait_for(lambda: any(e["step"] >= 5 for e in events_of(run_dir, "step")), 120,
                 "training to reach step 5")
        victim = next(e["pid"] for e in events_of(run_dir, "worker_start") if e["rank"] == 1)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: any(e["attempt"] == 1 for e in events_of(run_dir, "step")), 120,
                 "the restarted workers to train")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_forged_control_messages_are_rejected_and_reported(tmp_path):
    """Someone who can reach the store but has not the job's secret writes a death and the
    plan of the next generation. Both are rejected and reported: the leader's planner does
    not act on the death, and when a real fault comes, the survivors never follow the forged
    plan (which would have excluded rank 0)."""
    from unbroken.control.address import ControlAddress, open_backend
    from unbroken.control.channel import Channel
    from unbroken.control.messages import Fault, FaultKind, GenPlan
    from unbroken.control.schema import AttemptKeys

    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", "--max-restarts", "3",
                 "--fault", "crash:rank=1,step=60", args=["--steps", "100", *TINY])
    wait_for(lambda: any(e["step"] >= 5 for e in events_of(run_dir, "step")), 120, "step 5")
    control = json.loads((run_dir / "control.json").read_text())
    forger = Channel(open_backend(ControlAddress.parse(control["control"]), control["run_id"]))
    keys = AttemptKeys(0)
    forged_id = forger.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=0, slot=0, wid="0.0",
                                                 node=0, attempt=0, in_place=True, detail="forged"))
    forger.write(keys.gen(1).plan, GenPlan(gen=1, members=["1.0"]))
    forger.write(keys.latest_gen, 1)
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    forged = {e["key"] for e in result.events("forged_message")}
    # The forged death is read at once. The forged `gen` is read (and rejected) only if a
    # survivor looks before the leader writes the real generation over it, which a loaded
    # machine may reorder; either way no survivor follows the forged plan (asserted below).
    death = keys.deaths.entry_key(forged_id)  # an entry's signature binds its request id
    assert death in forged and forged <= {death, "a/0/gen"}, forged
    assert [(f["kind"], f["rank"]) for f in result.events("fault")] == [("crash", 1)]
    assert result.events("gen_plan")[0]["members"] == ["0.0"]
    first = next(e["pid"] for e in result.events("worker_start") if e["slot"] == 0)
    assert any(e["slot"] == 0 and e["pid"] == first for e in result.events("training_done"))
