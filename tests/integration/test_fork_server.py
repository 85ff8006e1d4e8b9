"""The fork server's contract, seen from outside as a user's tools see a worker: its parent
is the agent, `ps` shows `python SCRIPT ARGS`, `/proc/PID/environ` holds its rank's
variables, it has its own session, honours its own `OMP_NUM_THREADS`, exits with its own
status, and dies with its agent; the server's death kills no worker.
(`runtime/fork_server.py`; speed: benchmarks/recovery.py, benchmarks/restart.py.)"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from conftest import SCRIPTS, alive, events_of, finish, start, wait_for

PROBE = SCRIPTS / "fork_probe.py"


def _probes(out: Path, ranks: int) -> dict[int, dict]:
    return wait_for(lambda: len(list(out.glob("rank*.json"))) == ranks and {
        int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")},
        120, f"{ranks} workers to report")


def _proc(pid: int, name: str) -> list[str]:
    return [x for x in Path(f"/proc/{pid}/{name}").read_bytes().split(b"\0") if x]


def _server_pid(agent: int) -> int | None:
    """The agent's fork server: its child whose command line says so."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"unbroken fork server" in (entry / "cmdline").read_bytes() and \
                        int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                    return int(entry.name)
            except (OSError, ValueError):
                continue
    return None


def test_a_forked_worker_looks_like_a_torchrun_worker(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "exit1").write_text("3")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = start(tmp_path / "run", "--nproc-per-node", "2", script=PROBE, args=[str(out)],
                 env=env)
    try:
        probes = _probes(out, 2)
        agent = events_of(tmp_path / "run", "agent_start")[0]["pid"]
        for rank, p in probes.items():
            assert p["torch_before"], "forked from a server that had imported torch"
            assert p["ppid"] == agent and p["sid"] == p["pid"]  # the agent's; its own session
            assert p["threads"] == 2  # its own OMP_NUM_THREADS
            assert p["argv"] == [str(PROBE), str(out)]
            cmdline = _proc(p["pid"], "cmdline")
            assert [c.decode() for c in cmdline[1:]] == [str(PROBE), str(out)], cmdline
            assert cmdline[0].decode().startswith("python")
            environ = set(_proc(p["pid"], "environ"))
            assert f"RANK={rank}".encode() in environ and b"WORLD_SIZE=2" in environ
            assert not any(e.startswith(b"UNBROKEN_FORK_PAD=") for e in environ)
        (out / "go").touch()
        result = finish(proc, tmp_path / "run")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.code != 0  # rank 1 exited 3, and the job had no restart to spend
    (fault,) = result.events("fault")
    assert fault["rank"] == 1 and fault["exit_code"] == 3, fault  # its own status


def test_the_servers_death_kills_no_worker(tmp_path):
    """The server SIGKILLed together with rank 1: rank 0 runs on, the agent says the server
    is lost when it asks it for rank 1's replacement, starts that replacement cold and a new
    server; the job recovers in place. The new server killed too, mid-job: the job ends."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = start(run_dir, "--nproc-per-node", "2", "--max-restarts", "2",
                 script=SCRIPTS / "ckpt_train.py",
                 args=["--steps", "300", "--step-sleep", "0.02", "--sleep-until", str(out / "go")])
    try:
        wait_for(lambda: len(events_of(run_dir, "step")) > 4, 120, "steps")
        agent = events_of(run_dir, "agent_start")[0]["pid"]
        first = wait_for(lambda: _server_pid(agent), 30, "the fork server")
        workers = events_of(run_dir, "workers_started")[0]["pids"]
        os.kill(first, signal.SIGKILL)
        os.kill(workers["1"], signal.SIGKILL)
        (lost,) = wait_for(lambda: events_of(run_dir, "fork_server_lost"), 60,
                           "the server's loss, found when the replacement is asked for")
        assert lost["pid"] == first and lost["restarted"] is True
        assert alive(workers["0"]), "the server's death killed a worker"
        second = wait_for(lambda: (p := _server_pid(agent)) != first and p, 60, "a new server")
        os.kill(second, signal.SIGKILL)
        (out / "go").touch()
        result = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.code == 0, result.output
    assert not result.events("restart")
    assert "fork server" in result.output and "its workers run on" in result.output
    (fault,) = result.events("fault")
    assert fault["exit_code"] == -signal.SIGKILL, fault  # the signal, as waitpid gave it


def _probe_once(tmp_path: Path, name: str, *flags: str) -> tuple[dict, str]:
    out, run_dir = tmp_path / name, tmp_path / f"{name}-run"
    out.mkdir()
    proc = start(run_dir, "--nproc-per-node", "1", *flags, script=PROBE, args=[str(out)])
    try:
        (p,) = _probes(out, 1).values()
        p["cmdline"] = [c.decode() for c in _proc(p["pid"], "cmdline")]
        (out / "go").touch()
        result = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.code == 0, result.output
    return p, result.output


def test_a_forked_worker_starts_as_fresh_as_a_cold_one_and_no_fork_server_starts_cold(tmp_path):
    """A cold worker (--no-fork-server: a fresh interpreter, said) and a forked one have the
    same signal dispositions and mask, open files (none of the server's: its event log is
    not inherited), umask, scheduling policy and nice value, and run as `__main__`."""
    cold, said = _probe_once(tmp_path, "cold", "--no-fork-server")
    assert "workers start as fresh interpreters (--no-fork-server)" in said
    assert not cold["torch_before"]
    assert cold["cmdline"][:4] == [sys.executable, "-u", "-m", "unbroken.worker"]
    forked, _ = _probe_once(tmp_path, "forked")
    assert forked["torch_before"]
    assert forked["fresh"] == cold["fresh"]
    assert cold["fresh"]["fds"] == ["0: std", "1: std", "2: std", "3: the run's event log"]


def test_killing_the_agent_kills_its_forked_workers_and_its_server(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = start(tmp_path / "run", "--nproc-per-node", "2", script=PROBE, args=[str(out)])
    probes = _probes(out, 2)
    agent = events_of(tmp_path / "run", "agent_start")[0]["pid"]
    server = _server_pid(agent)
    assert server is not None
    os.kill(agent, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid in [server, *(p["pid"] for p in probes.values())]:
        wait_for(lambda pid=pid: not alive(pid), 30, f"process {pid} to die with its agent")
