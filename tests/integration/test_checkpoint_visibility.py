"""A checkpoint_dir that is not shared by every node is refused before the first commit.

Rank 0 commits a checkpoint by renaming its own temporary directory; on each host's own disk
at the same path (a pod's emptyDir) that directory holds only its node's ranks' files, and
every save would "succeed" until the restart that needs one. The unit tests exercise the
decision (`unseen_files`) on a real directory; the job test runs two real agents as two
nodes, each in a working directory of its own, given the same relative checkpoint_dir
`ckpt`: the same string names a different disk on each node, as on two hosts.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from builders import file_reports, write_file
from conftest import SCRIPTS, finish, free_port, unbroken_cmd

from unbroken.checkpoint.layout import committed_checkpoints
from unbroken.checkpoint.loader import choose
from unbroken.checkpoint.persist import CheckpointDirNotShared, CheckpointWriteError, check_visible

CKPT_TRAIN = SCRIPTS / "ckpt_train.py"


LINE = "is not shared: rank 0 cannot see"


def test_other_ranks_files_unseen_is_not_shared_own_files_unseen_is_a_failed_save(tmp_path):
    write_file(tmp_path, "__0_0.distcp", 10)
    reports = file_reports({"__0_0.distcp": 10}, {"__1_0.distcp": 4}, {"__2_0.distcp": 4, "b": 1})
    t0 = time.monotonic()
    with pytest.raises(CheckpointDirNotShared) as caught:
        check_visible(tmp_path, reports, "/x", look_again=(0.05, 0.05))
    assert time.monotonic() - t0 >= 0.1  # looked again before deciding
    exc = caught.value
    assert (len(exc.unseen), exc.files) == (3, 3)
    assert exc.line() == (
        "unbroken: checkpoint_dir /x is not shared: rank 0 cannot see 3 of the 3 files other "
        "ranks wrote (e.g. rank 1's __1_0.distcp); checkpoint_dir must be storage every node "
        "can see (a shared filesystem or volume); no checkpoint is committed")
    reports = file_reports({"__0_0.distcp": 11})  # rank 0's own file changed after it was written
    with pytest.raises(CheckpointWriteError) as caught:
        check_visible(tmp_path, reports, "/x", look_again=())
    assert not isinstance(caught.value, CheckpointDirNotShared)


def _node(tmp_path: Path, port: int, node_rank: int) -> subprocess.Popen:
    """One node's agent, in a working directory of its own: `ckpt` is this node's disk."""
    cwd = tmp_path / f"node{node_rank}"
    cwd.mkdir()
    cmd = unbroken_cmd("run", "--run-dir", str(tmp_path / "run"), "--master-port", str(port),
                       "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
                       "--rdzv-id", "job", "--rdzv-timeout", "60", str(CKPT_TRAIN),
                       "--steps", "40", "--checkpoint-dir", "ckpt", "--checkpoint-every", "5",
                       "--step-sleep", "0.05")
    out = open(tmp_path / f"node{node_rank}.out", "w+b")  # noqa: SIM115 -- closed by finish()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                            start_new_session=True)
    proc.output_file = out  # type: ignore[attr-defined]
    return proc


def test_node_local_checkpoint_dirs_are_refused_once_said_and_training_finishes(tmp_path):
    port = free_port()
    leader, follower = _node(tmp_path, port, 0), _node(tmp_path, port, 1)
    r1, r0 = finish(follower, tmp_path / "run"), finish(leader, tmp_path / "run")
    assert r0.code == 0, r0.output
    assert r1.code == 0, r1.output
    output = r0.output + r1.output
    assert output.count(LINE) == 1, output
    line = next(x for x in output.splitlines() if LINE in x)
    assert line.endswith("rank 0 cannot see 1 of the 1 file other ranks wrote (e.g. rank 1's "
                         "__1_0.distcp); checkpoint_dir must be storage every node can see (a "
                         "shared filesystem or volume); no checkpoint is committed"), line
    assert f"checkpoint_dir {tmp_path / 'node0' / 'ckpt'} is not shared" in line
    said = r0.events("checkpoint_dir_not_shared")
    assert len(said) == 1 and said[0]["rank"] == 0, said
    assert (said[0]["unseen"], said[0]["files"]) == (1, 1)
    assert said[0]["examples"] == ["rank 1's __1_0.distcp"]
    assert not r0.events("checkpoint_saved")
    failed = r0.events("checkpoint_failed")
    refused = [e for e in failed if e["rank"] == 0]
    assert len(refused) >= 2, "a later save was not tried (and refused) too"
    assert all("is not shared" in e["error"] for e in refused)
    assert all("not shared" in e["error"] for e in failed if e["rank"] == 1)
    assert {e["rank"] for e in failed} == {0, 1}
    assert len({e["step"] for e in r0.events("step")}) == 40
    for node in ("node0", "node1"):
        ckpt = tmp_path / node / "ckpt"
        assert committed_checkpoints(ckpt) == [], node
        assert choose(ckpt, 0, None, lambda *a, **k: None) is None  # nothing a loader takes
        assert not list(ckpt.glob(".tmp-*")), f"{node}: a refused save was left behind"
