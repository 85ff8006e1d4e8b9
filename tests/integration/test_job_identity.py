"""A job id meets the keys of a dead job (etcd outlives its agents): the new job is told so in
one line, with the two ways on, never "another secret" (launch/dead_job.py). With
--continue-dead-job exactly one agent clears the keys and the job continues from its
checkpoints: shown as pods, by a JobSet restart (tests/integration/test_pods.py).

The nodes share nothing but etcd and the checkpoint volume: each has its own working and run
directory (on loopback: the test is about the control plane, not the network).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import SCRIPTS, events_of, finish, free_port, processes_mentioning, start, wait_for

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")


def _job(tmp_path, endpoint: str, tag: str, secret: str, *flags: str, steps: int,
         pace: str | None = None) -> list:
    key = tmp_path / f"secret-{tag}"
    key.write_text(secret)
    pacing = ("--step-sleep", "0.05", "--sleep-until", pace) if pace else ()
    return [start(tmp_path / f"{tag}-node{k}" / "run", "--nnodes", "2", "--node-rank", str(k),
                  "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "job",
                  "--secret-file", str(key), *flags, script=SCRIPTS / "ckpt_train.py",
                  args=["--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        "--checkpoint-every", "5", *pacing], port=free_port(),
                  cwd=tmp_path / f"{tag}-node{k}")  # each node its own working and run dir
            for k in range(2)]


def test_a_dead_jobs_keys_are_named_as_such_never_as_another_secret(tmp_path, etcd_endpoint):
    # Job A dies at once, every process SIGKILLed (a node pool lost), leaving its keys.
    first = _job(tmp_path, etcd_endpoint, "a", "a" * 64, steps=400, pace=str(tmp_path / "go"))
    run_a = tmp_path / "a-node0" / "run"
    wait_for(lambda: [e for e in events_of(run_a, "checkpoint_saved") if e["step"] >= 10], 120,
             "job A's checkpoint of step 10", explain=run_a)
    for pid in processes_mentioning(str(tmp_path / "a-node")):
        os.kill(pid, signal.SIGKILL)
    for proc in first:
        proc.wait(timeout=30)
        proc.output_file.close()

    # Job B, under the same id with another secret, is refused in one line that says so.
    t0 = time.monotonic()
    refused = [finish(p, tmp_path / f"b-node{k}" / "run", timeout=120)
               for k, p in enumerate(_job(tmp_path, etcd_endpoint, "b", "b" * 64, steps=20))]
    for r in refused:
        assert r.code == 2, r.output
        errors = [line for line in r.output.splitlines() if "error:" in line]
        assert len(errors) == 1 and "keys of a dead job under --rdzv-id job" in errors[0], r.output
        assert "--continue-dead-job" in errors[0] and "fresh --rdzv-id" in errors[0]
        assert "another secret" not in r.output and "secret differs" not in r.output
        assert [e["cont"] for e in r.events("dead_job_found")] == [False]
    assert time.monotonic() - t0 < 120
    # With --continue-dead-job one agent clears them and the job continues: shown as pods, by a
    # JobSet restart (tests/integration/test_pods.py).
