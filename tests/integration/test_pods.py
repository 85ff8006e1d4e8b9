"""`unbroken k8s` manifests run as pods on this machine (tests/pods.py): each pod in its own
network, mount and UTS namespaces, with its own address (a new one when recreated), its own
emptyDirs, its Secret as a file, the checkpoint volume as the one shared dir, and the
controllers interpreting the manifests' own failure and success policies.

What is shown (docs/kubernetes.md, "What was shown here"):
- a training pod deleted (SIGTERM, grace) with a standby pod ready: its ranks move in place
  during the grace period, the recreated pod comes back as a standby node, and when the pod
  now holding those ranks is force-deleted, the returned node takes them after the node
  timeout; the JobSet completes;
- a deleted pod with no standby: the job restarts, and the recreated pod is taken back in
  as the node it was; the report made afterwards from the shared volume alone counts the
  deleted pod's steps and fault;
- a recreated pod whose checkpoint volume is read-only fails its health check (exit 4, one
  line) before it joins, and the job goes on with its standby;
- the etcd StatefulSet as pods, and the leader's pod force-deleted: another agent leads, and
  the job finishes; then, on the same etcd, a JobSet restart of the same instance (every
  agent killed, the Job's backoffLimit spent) continues the job from its checkpoint past the
  dead attempt's keys, and a re-applied JobSet of the same name starts a fresh job;
- node 0's pod force-deleted on the embedded store: node 1 leaves with the control-plane code,
  both pods are recreated, and training resumes from the checkpoint on the shared volume;
- a pod with the wrong Secret fails with the configuration code and fails the JobSet at once;
  with that one rule edited out of the manifest, the same pod is retried up to its
  backoffLimit: the emulation follows the manifest, not a hard-coded table.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import SCRIPTS, offered, read_events, unbroken_cmd, wait_for
from pods import Cluster, JobSetRun, StatefulSetRun, unavailable

from unbroken.telemetry.report import build_report

pytestmark = [pytest.mark.usefixtures("no_process_outlives_its_test"),
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

SECRET = "5e" * 32
CKPT = "/run/unbroken-test/checkpoints"  # the checkpoint volume's mountPath in the pods
SCRIPT = str(SCRIPTS / "ckpt_train.py")


def manifests(tmp_path: Path, name: str, *flags: str, script_args: tuple[str, ...] = ()) -> dict:
    """`unbroken k8s ... -o DIR`, read back: {kind: [objects]}."""
    out = tmp_path / f"manifests-{name}"
    cmd = unbroken_cmd("k8s", "--name", name, "--image", "unbroken:test", "--nproc-per-node",
                       "1", "--checkpoint-pvc", "ckpt", "--checkpoint-mount", CKPT,
                       "--node-timeout", "5", "--grace-period", "30", *flags, "-o", str(out),
                       SCRIPT, *script_args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found: dict[str, list[dict]] = {}
    for path in sorted(out.iterdir()):
        for obj in yaml.safe_load_all(path.read_text()):
            found.setdefault(obj["kind"], []).append(obj)
    return found


def train_args(steps: int, go: str, every: int = 10, where: str = "$(JOBSET_NAME)") -> tuple:
    """The script's arguments: paced until the test touches `go` on the shared volume."""
    return ("--steps", str(steps), "--checkpoint-dir", f"{CKPT}/{where}", "--checkpoint-every",
            str(every), "--step-sleep", "0.05", "--sleep-until", f"{CKPT}/{go}")


def events(pod, name: str | None = None) -> list[dict]:
    """A pod's events, from its run dir (its emptyDir `run`)."""
    path = pod.dir / "volumes" / "run" / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in read_events(path) if name is None or e["event"] == name]


def steps_at_least(pod, step: int) -> bool:
    return any(e["step"] >= step for e in events(pod, "step"))


def wait_checkpoint(pod, step: int) -> None:
    """Wait until the pod's job has saved a checkpoint at `step` or later."""
    wait_for(lambda: [e for e in events(pod, "checkpoint_saved") if e["step"] >= step], 180,
             f"a checkpoint at step {step}", explain=pod.dir / "volumes" / "run")


@pytest.fixture
def cluster(tmp_path):
    volume = tmp_path / "volumes" / "ckpt"
    volume.mkdir(parents=True)
    secrets = {f"{n}-secret": {"secret": SECRET}
               for n in ("del", "back", "etcdjob", "id", "zero", "bad", "sick")}
    secrets["other-secret"] = {"secret": "0f" * 32}
    with Cluster(tmp_path / "cluster", volumes={"ckpt": volume}, secrets=secrets) as c:
        c.shared = volume
        yield c


def go(cluster, name: str) -> None:
    (cluster.shared / name).touch()


def test_a_deleted_training_pod_hands_its_ranks_to_the_standby_and_returns_as_one(cluster,
                                                                                  tmp_path):
    objs = manifests(tmp_path, "del", "--nnodes", "2", "--standby-nodes", "1",
                     script_args=train_args(400, "go-del"))
    run = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=1.0, on_event=print).start()
    try:
        node0, node1, standby = run.pod("node", 0), run.pod("node", 1), run.pod("standby", 0)
        wait_for(lambda: offered(events(standby, "spares_offered")), 180,
                 "the standby pod's spare offered")
        # Both nodes past step 10, so node 1's agent has seen its worker in the resilient
        # loop (a SIGTERM before that is a plain stop: CI once deleted it that early).
        wait_for(lambda: steps_at_least(node0, 10) and steps_at_least(node1, 10), 120, "step 10")
        run.delete_pod(node1)  # kubectl delete pod: SIGTERM, then the grace period
        wait_for(lambda: node1.ended, 60, "the deleted pod to end")
        assert node1.code == 143, node1.log()
        assert node1.ended - node1.deleted < 30, "ended by the grace period's SIGKILL"
        assert "ranks moved to spares" in node1.log()
        promoted = [e["slot"] for e in events(standby, "spare_promoted") if e["source"] == "worker"]
        assert promoted == [1]

        # The Job recreates it (the SIGTERM code is Ignored): a new address, an empty disk,
        # and it finds the job went on without it: a standby node now.
        back = wait_for(lambda: next(iter(run.incarnations("node", 1)[1:]), None), 60,
                        "node 1's pod to be recreated")
        assert back.ip != node1.ip  # and its disk is its own: one start in its event log
        returned = wait_for(lambda: events(back, "node_returned"), 120, "node 1 to return",
                            explain=back.dir / "volumes" / "run")
        assert returned[0]["returned_node"] == 1 and len(events(back, "agent_start")) == 1
        wait_for(lambda: offered(events(back, "spares_offered")), 180,
                 "the returned node's spare offered")

        # Force-delete the pod that now holds rank 1: after the node timeout, the returned
        # node's spare takes it; the standby pod is recreated as a standby again.
        run.delete_pod(standby, force=True)
        wait_for(lambda: [e for e in events(back, "spare_promoted") if e["source"] == "worker"],
                 120, "the returned node to take rank 1", explain=node0.dir / "volumes" / "run")
        lost = [e["lost_node"] for e in events(node0, "node_lost")]
        assert len(lost) == 1 and lost[0] >= 100, lost  # the standby pod's node (a standby id)
        go(cluster, "go-del")
        assert run.wait(240) == "Completed", run.log
        assert not events(node0, "restart"), "in place: nobody restarted"
        assert max(e["step"] for e in events(node0, "step")) == 399
        assert [p.code for p in run.incarnations("node", 0)] == [0]
        assert back.code == 0, back.log()
    finally:
        run.close()


def test_a_recreated_pod_on_a_read_only_volume_fails_its_health_check_and_the_job_goes_on(
        cluster, tmp_path):
    """Node 1's pod deleted: its rank goes to the standby pod in place. Its recreation lands
    where the checkpoint volume is read-only (its mount made so, for that pod alone): the
    agent's health check refuses the node before it joins, exit 4 with one line, and the
    job trains on; the next recreation, healthy, comes back as a standby node."""
    objs = manifests(tmp_path, "sick", "--nnodes", "2", "--standby-nodes", "1",
                     script_args=train_args(400, "go-sick"))
    run = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=1.0, on_event=print)
    create = run._create_pod

    def on_a_bad_machine(job, index):  # node 1's first recreation: a read-only volume
        if (job.rjob, index) != ("node", 1) or len(run.incarnations("node", 1)) != 1:
            return create(job, index)
        healthy = job.spec["template"]
        sick = copy.deepcopy(healthy)
        for mount in sick["spec"]["containers"][0]["volumeMounts"]:
            if mount["name"] == "checkpoints":
                mount["readOnly"] = True
        job.spec["template"] = sick
        try:
            return create(job, index)
        finally:
            job.spec["template"] = healthy

    run._create_pod = on_a_bad_machine
    run.start()
    try:
        node0, node1, standby = run.pod("node", 0), run.pod("node", 1), run.pod("standby", 0)
        wait_for(lambda: offered(events(standby, "spares_offered")), 180,
                 "the standby pod's spare offered")
        wait_for(lambda: steps_at_least(node0, 10) and steps_at_least(node1, 10), 120, "step 10")
        run.delete_pod(node1)
        sick = wait_for(lambda: next(iter(run.incarnations("node", 1)[1:]), None), 60,
                        "node 1's pod to be recreated")
        wait_for(lambda: sick.ended, 120, "the recreated pod's refusal",
                 explain=sick.dir / "volumes" / "run")
        assert sick.code == 4, sick.log()
        said = [line for line in sick.log().splitlines() if "health check failed" in line]
        assert len(said) == 1 and f"volume {CKPT}: not writable" in said[0], sick.log()
        assert not events(sick, "workers_started") and not events(sick, "node_returned")
        at_refusal = max(e["step"] for e in events(node0, "step"))
        wait_for(lambda: steps_at_least(node0, at_refusal + 10), 120, "the job to go on")
        back = wait_for(lambda: next(iter(run.incarnations("node", 1)[2:]), None), 120,
                        "node 1's pod to be recreated again")
        wait_for(lambda: events(back, "node_returned"), 120, "the healthy pod to return",
                 explain=back.dir / "volumes" / "run")
        go(cluster, "go-sick")
        assert run.wait(240) == "Completed", run.log
        assert not events(node0, "restart"), "in place: nobody restarted"
        assert max(e["step"] for e in events(node0, "step")) == 399
    finally:
        run.close()


def test_a_deleted_pod_with_no_standby_is_taken_back_in_when_recreated(cluster, tmp_path):
    """No spare can take the deleted pod's rank: the job restarts short of a node, and when
    the pod is recreated its agent joins as the node it was, and a restart takes it back in
    (without spending the restart budget)."""
    objs = manifests(tmp_path, "back", "--nnodes", "2", script_args=train_args(300, "go-back"))
    run = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=3.0, on_event=print).start()
    try:
        node0, node1 = run.pod("node", 0), run.pod("node", 1)
        wait_checkpoint(node0, 10)
        run.delete_pod(node1)
        back = wait_for(lambda: next(iter(run.incarnations("node", 1)[1:]), None), 60,
                        "node 1's pod to be recreated")
        wait_for(lambda: [e for e in events(node0, "rendezvous") if e["world_size"] == 2
                          and e["attempt"] > 0], 120, "the world of 2 again",
                 explain=node0.dir / "volumes" / "run")
        assert not events(back, "node_returned"), "it came back as itself, not as a standby"
        go(cluster, "go-back")
        assert run.wait(240) == "Completed", run.log
        assert max(e["step"] for e in events(node0, "step")) == 299
        restarts = events(node0, "restart")  # the taking back in spends no restart
        assert restarts and restarts[-1]["restarts_left"] >= 10 - 1, restarts
    finally:
        run.close()
    # After the job, from the shared volume alone: every pod's copy of its events, the
    # deleted pod's beside its successor's, and the report counts what only the deleted pod
    # saw (its worker's steps of the first attempt, the fault its agent recorded).
    (copies,) = (cluster.shared / "unbroken-events").iterdir()
    node1 = sorted(copies.glob("node1-*.jsonl"))
    assert [p.name for p in node1] == sorted(f"node1-{p.uid}.jsonl" for p in
                                             run.incarnations("node", 1)[:2]), node1
    report = build_report([copies])
    assert [s for s in report["steps"] if s["slot"] == 1 and s["attempt"] == 0]
    assert [f for f in report["faults"] if f["node"] == 1], report["faults"]
    assert report["world_size"] == 2
    assert "[rank0]:ckpt_train: rank 0 of 2" in node0.log(), node0.log()[-2000:]  # tee'd


def _etcd_ready(sts: StatefulSetRun) -> bool:
    if len(sts.pods) < 3:
        return False
    for pod in sts.pods.values():
        try:
            with urllib.request.urlopen(f"http://{pod.ip}:2379/health", timeout=1) as r:
                if json.loads(r.read()).get("health") not in ("true", True):
                    return False
        except OSError:
            return False
    return True


def test_etcd_as_pods_the_leaders_pod_lost_a_restart_continues_and_a_reapply_starts_afresh(
        cluster, tmp_path):
    objs = manifests(tmp_path, "etcdjob", "--nnodes", "2", "--standby-nodes", "1",
                     "--control-plane", "etcd", script_args=train_args(300, "go-etcd"))
    (sts,) = objs["StatefulSet"]
    etcd = StatefulSetRun(cluster, sts).start()
    run = None
    try:
        wait_for(lambda: _etcd_ready(etcd), 60, "the 3 etcd pods to serve")
        run = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=1.0, on_event=print).start()
        node0, node1, standby = run.pod("node", 0), run.pod("node", 1), run.pod("standby", 0)
        wait_for(lambda: offered(events(standby, "spares_offered")), 180,
                 "the standby pod's spare offered")
        wait_for(lambda: steps_at_least(node0, 10), 120, "step 10")
        leader = next(p for p in (node0, node1) if events(p, "node_set"))
        deleted_at = time.time()
        run.delete_pod(leader, force=True)
        survivor = node1 if leader is node0 else node0
        # The survivor or the standby node (a standby can lead too) takes over.
        elected = wait_for(lambda: events(survivor, "leader_elected")
                           or events(standby, "leader_elected"), 60, "a new leader",
                           explain=survivor.dir / "volumes" / "run")
        print(f"another agent led {elected[0]['t'] - deleted_at:.2f}s after the force deletion")
        assert elected[0]["t"] - deleted_at < 50  # the target is 5 s: loose on 2 cores
        go(cluster, "go-etcd")
        assert run.wait(240) == "Completed", run.log
    finally:
        if run is not None:
            run.close()
        etcd.close()
    # (the same etcd pods are not reused below: each test's cluster is its own)


def test_a_jobset_restart_continues_the_job_and_a_reapplied_jobset_starts_afresh(cluster,
                                                                                tmp_path):
    objs = manifests(tmp_path, "id", "--nnodes", "2", "--control-plane", "etcd",
                     "--backoff-limit", "0",
                     script_args=train_args(60, "go-id", every=5, where="$(UNBROKEN_JOB_ID)"))
    etcd = StatefulSetRun(cluster, objs["StatefulSet"][0]).start()
    run = again = None
    try:
        wait_for(lambda: _etcd_ready(etcd), 60, "the 3 etcd pods to serve")
        run = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=1.0, on_event=print).start()
        node0, node1 = run.pod("node", 0), run.pod("node", 1)
        wait_checkpoint(node0, 10)
        run_id = events(node0, "agent_start")[0]["run_id"]
        # Both agents die at once (exit 137: no rule Ignores it): the Job's backoffLimit of 0
        # is spent, and the JobSet's failurePolicy restarts the whole JobSet, same instance.
        for pod in (node0, node1):
            os.kill(pod.proc.pid, signal.SIGKILL)
        wait_for(lambda: run.restarts == 1, 60, "the JobSet restart")
        new0 = wait_for(lambda: next(iter(run.incarnations("node", 0)[1:]), None), 60, "new pods")
        assert new0.labels["jobset.sigs.k8s.io/restart-attempt"] == "1"
        go(cluster, "go-id")
        assert run.wait(240) == "Completed", run.log
        new = [run.incarnations("node", k)[-1] for k in (0, 1)]
        assert {events(p, "agent_start")[0]["run_id"] for p in new} == {run_id}
        cleared = [e for p in new for e in events(p, "dead_job_cleared")]
        assert len(cleared) == 1, "the dead attempt's keys were recognised and cleared once"
        loaded = [e["step"] for p in new for e in events(p, "checkpoint_loaded")]
        assert loaded and min(loaded) >= 10, loaded

        # Re-applied, same name: a new UID, so a new job id, a fresh control plane and a
        # fresh checkpoint dir (the script names it by the job id).
        run.close()
        again = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=1.0, on_event=print).start()
        assert again.wait(240) == "Completed", again.log
        fresh = again.incarnations("node", 0)[0]
        assert events(fresh, "agent_start")[0]["run_id"] != run_id
        assert not events(fresh, "dead_job_found") and not events(fresh, "checkpoint_loaded")
    finally:
        for r in (run, again):
            if r is not None:
                r.close()
        etcd.close()


def test_node_zeros_pod_force_deleted_on_the_embedded_store_resumes_from_the_checkpoint(
        cluster, tmp_path):
    objs = manifests(tmp_path, "zero", "--nnodes", "2", script_args=train_args(80, "go-zero"))
    run = JobSetRun(cluster, objs["JobSet"][0], scheduling_delay=1.0, on_event=print).start()
    try:
        node0, node1 = run.pod("node", 0), run.pod("node", 1)
        wait_checkpoint(node0, 20)
        run.delete_pod(node0, force=True)
        wait_for(lambda: node1.ended, 120, "node 1 to leave the job that ended with node 0")
        assert node1.code == 3, node1.log()  # the control plane lost: worth a restart
        go(cluster, "go-zero")
        assert run.wait(240) == "Completed", run.log
        new = [run.incarnations("node", k)[-1] for k in (0, 1)]
        assert all(p.code == 0 for p in new)
        loaded = [e["step"] for p in new for e in events(p, "checkpoint_loaded")]
        assert loaded and min(loaded) >= 20, loaded
    finally:
        run.close()


def test_a_pod_with_the_wrong_secret_fails_the_jobset_by_the_manifests_own_rules(cluster,
                                                                                 tmp_path):
    objs = manifests(tmp_path, "bad", "--nnodes", "2", "--standby-nodes", "1",
                     script_args=train_args(2000, "go-bad"))
    jobset = objs["JobSet"][0]
    standby = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "standby")
    pod_spec = standby["template"]["spec"]["template"]["spec"]
    for volume in pod_spec["volumes"]:
        if "secret" in volume:
            volume["secret"]["secretName"] = "other-secret"  # a typo: another job's key
    run = JobSetRun(cluster, jobset, scheduling_delay=0.5, on_event=print).start()
    try:
        assert run.wait(180) == "Failed", run.log
        assert run.reason == "PodFailurePolicy"
        (pod,) = run.incarnations("standby", 0)
        assert pod.code == 2 and "secret differs from the job's" in pod.log(), pod.log()
    finally:
        run.close()

    # The same manifest with the configuration code's FailJob rule edited out: the pod is
    # retried (Count) until the Job's backoffLimit is spent.
    rules = standby["template"]["spec"]["podFailurePolicy"]["rules"]
    standby["template"]["spec"]["podFailurePolicy"]["rules"] = [
        r for r in rules if r["action"] != "FailJob"]
    standby["template"]["spec"]["backoffLimit"] = 1
    jobset["spec"]["failurePolicy"]["maxRestarts"] = 0
    edited = JobSetRun(cluster, jobset, scheduling_delay=0.5, on_event=print).start()
    try:
        assert edited.wait(180) == "Failed", edited.log
        assert edited.reason == "ReachedMaxRestarts"
        tries = [p for p in edited.incarnations("standby", 0)]
        assert [p.code for p in tries] == [2, 2]
    finally:
        edited.close()
