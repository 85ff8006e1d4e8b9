"""A training pod deleted: from the deletion to the first resumed step, with pods emulated from
the manifests `unbroken k8s` generates (tests/pods.py), and the same emulated scheduling delay
for every arm that waits for a pod to be recreated.

Each try applies one JobSet of 2 nodes, 1 worker each (`unbroken k8s --nnodes 2
--nproc-per-node 1 --checkpoint-pvc ckpt --node-timeout T`), running tests/scripts/ckpt_train.py
(a two-layer model, DDP over gloo, a checkpoint every 10 steps on the shared checkpoint
volume, under `$(UNBROKEN_JOB_ID)`). Each step waits `--step-sleep` (0.05 s), standing in for
accelerator time as in the other benchmarks: on a GPU host the CPUs are mostly idle, and a
standby's spare warms up on idle CPU only. Once training is past a checkpoint, mid-way to
the next one (rank 0 at step `--delete-at` (25) + 10k, k >= 0; in the standby arms also once
the standby pod's spare is ready), node 1's pod is deleted (never node 0's: on the embedded store
node 0's agent is the store). t0 is the deletion. The figure: seconds from t0 to the first
step completed after t0

- in the unbroken arms, by rank 1 (the deleted pod's rank), from the events of the pod that
  now runs it (the standby pod, or node 1's recreated pod);
- under torchrun, by any rank of the restarted job (a later attempt, or a recreated pod),
  from the step events unbroken.init() writes under torchrun too (`UNBROKEN_RUN_DIR`).

Also per try: when the job went on at all (the first step after t0 of a later attempt or
generation, or from another pod, any rank) and at what world size; the deleted pod's exit
code; when its replacement was created; checkpoints that failed after t0.

Steps redone: the most steps any rank completed twice. A try in which that step does not
come within `--hang-after` seconds, or the JobSet ends first, is a failure, shown with its
reason; after the figure the benchmark lets the job run out its steps at full speed
(`--sleep-until`) and checks that the JobSet completes.

Arms (each at every scheduling delay of `--delays`, 0 and 10 s by default; tries alternate):

- `standby`: `--standby-nodes 1`; a pod deletion (SIGTERM, then SIGKILL after the grace
  period): node 1's agent hands its rank to the standby pod's spare in place;
- `standby_force`: the same with a force deletion (every process SIGKILLed at once, the
  `DisruptionTarget` condition): the leader declares node 1 lost after `--node-timeout`, and
  the standby's spare takes its rank;
- `recreated`: no standby pod; a pod deletion; the Job recreates the pod after the
  scheduling delay;
- `torchrun`: the same JobSet (no standby) with the container's command replaced by
  `python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank
  $(JOB_COMPLETION_INDEX) --master-addr <name>-node-0-0.<name> --master-port 29500
  --max-restarts 3 --monitor-interval 0.1` (a static rendezvous on node 0's name; `--torchrun-rdzv
  c10d` for a c10d one with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`), and without the Job's
  podFailurePolicy: torchrun exits 1 on SIGTERM, which unbroken's rules read as a
  configuration error (FailJob, then FailJobSet); a torchrun Job counts each pod failure
  against its backoffLimit and recreates the pod. A pod deletion; the pod is recreated after
  the scheduling delay, and torchrun restarts every worker from the checkpoint.

The standby arms do not wait for the recreated pod; they run at every delay all the same, so
that the table is complete.

    .venv/bin/python benchmarks/pods.py                # 2 tries per arm and delay
    .venv/bin/python benchmarks/pods.py --tries 5 --arms standby,torchrun --delays 10

Needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN (network, mount and UTS namespaces). What
the emulation does not cover (tests/pods.py): the scheduler and node placement (the delay
stands in for them), image pulls (the "image" is this checkout's venv), the CNI (one
bridge), a DNS server (hosts files, rewritten when a pod comes or goes), the API server,
probes, resource limits; every pod shares this machine's 2 cores.

The last line printed is one JSON object: `standby`, `standby_force`, `recreated` and
`torchrun` at the largest delay (10 s), `<arm>_no_delay` at 0, each with `median_s`; the
ratios, `node_timeout_s`, and the targets.
"""

from __future__ import annotations

import argparse
import copy
import secrets
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from harness import (
    REPO,
    ArmStats,
    EventTail,
    Try,
    alternate,
    emit,
    epoch,
    events_of,
    median_of,
    ratio,
    recovery_times,
    temp_root,
)

sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the pod emulator

from pods import Cluster, JobSetRun, Pod, unavailable  # noqa: E402

ARMS = ["standby", "standby_force", "recreated", "torchrun"]
NAME = "bench"  # the JobSet's name (each try has a cluster of its own)
CKPT = "/run/unbroken-bench/checkpoints"  # the checkpoint volume's mountPath in the pods
SCRIPT = REPO / "tests" / "scripts" / "ckpt_train.py"
CHECKPOINT_EVERY = 10
VICTIM_RANK = 1  # node 1's only rank
GO = "go"  # on the checkpoint volume: the steps stop sleeping once it exists


@dataclass
class PodTry(Try):
    """A try, and: the scheduling delay; `job_resumed`, seconds from the deletion to the
    first step of the job that went on (any rank: a later attempt or generation, or another
    pod), and the world size it ran at; the last step done before the deletion and the
    resumed step; the deleted pod's exit code; when its replacement was created (s after the
    deletion); the JobSet's end; checkpoints that failed after the deletion (events
    `checkpoint_failed`, any rank); under torchrun, the worker starts that failed on the
    recreated pod (torchrun's "failed (exitcode" lines) before one resumed."""

    delay: float = 0.0
    job_resumed: float | None = None
    world_size_after: int | None = None
    deleted_at_step: int | None = None
    resumed_at_step: int | None = None
    victim_exit: int | None = None
    recreated_after: float | None = None
    status: str | None = None
    checkpoints_failed: int | None = None
    failed_starts: int | None = None


# ---------------------------------------------------------------- manifests
def script_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--checkpoint-dir", f"{CKPT}/$(UNBROKEN_JOB_ID)",
            "--checkpoint-every", str(CHECKPOINT_EVERY), "--step-sleep", f"{args.step_sleep:g}",
            "--sleep-until", f"{CKPT}/{GO}"]


def generate(root: Path, standby: bool, args: argparse.Namespace) -> dict:
    """`unbroken k8s ... -o DIR`, its JobSet read back."""
    out = root / f"manifests-{'standby' if standby else 'plain'}"
    cmd = [sys.executable, "-m", "unbroken", "k8s", "--name", NAME, "--image", "unbroken:bench",
           "--nnodes", "2", "--nproc-per-node", "1",
           *(["--standby-nodes", "1"] if standby else []),
           "--checkpoint-pvc", "ckpt", "--checkpoint-mount", CKPT,
           "--node-timeout", f"{args.node_timeout:g}", "-o", str(out), str(SCRIPT),
           *script_args(args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"unbroken k8s failed ({done.returncode}):\n{done.stderr}")
    objs = [o for path in sorted(out.iterdir()) for o in yaml.safe_load_all(path.read_text()) if o]
    (jobset,) = [o for o in objs if o["kind"] == "JobSet"]
    return jobset


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def run_mount(jobset: dict) -> str:
    """Where the pods mount their emptyDir `run` (the agent's run dir: its events)."""
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "run")


def torchrun_jobset(plain: dict, args: argparse.Namespace) -> dict:
    """The generated JobSet (no standby) with torchrun in the container, on node 0's name and
    port as `unbroken run` had them; unbroken.init() writes its events to the same run dir."""
    jobset = copy.deepcopy(plain)
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    # torchrun exits 1 on SIGTERM; unbroken's rules FailJob on 1 (a configuration error).
    # A torchrun Job has no such rules: each pod failure counts against backoffLimit.
    job.pop("podFailurePolicy", None)
    (container,) = job["template"]["spec"]["containers"]
    master, port = _arg(container["args"], "--master-addr"), _arg(container["args"], "--master-port")
    if args.torchrun_rdzv == "static":
        rdzv = ["--node-rank", "$(JOB_COMPLETION_INDEX)", "--master-addr", master,
                "--master-port", port]
        extra = []
    else:  # c10d, with a fresh store per restart (its best case in restart.py)
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{port}",
                "--rdzv-id", "$(UNBROKEN_JOB_ID)"]
        extra = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}]
    container["command"] = ["python", "-m", "torch.distributed.run"]
    container["args"] = ["--nnodes", "2", "--nproc-per-node", "1", *rdzv, "--max-restarts", "3",
                         "--monitor-interval", "0.1", str(SCRIPT), *script_args(args)]
    container["env"] = [*container["env"], {"name": "UNBROKEN_RUN_DIR", "value": run_mount(plain)},
                        *extra]
    return jobset


# ---------------------------------------------------------------- one try
def events_dir(pod: Pod) -> Path:
    """The pod's emptyDir `run` on this machine: its events.jsonl."""
    return pod.dir / "volumes" / "run"


class Watch:
    """Every pod of a JobSet, its events as they come (one EventTail per pod)."""

    def __init__(self, run: JobSetRun) -> None:
        self.run = run
        self.tails: dict[str, EventTail] = {}

    def poll(self) -> list[tuple[Pod, dict]]:
        new = []
        for pod in list(self.run.created):
            tail = self.tails.get(pod.name)
            if tail is None:
                tail = self.tails[pod.name] = EventTail(events_dir(pod))
            new += [(pod, e) for e in tail.poll()]
        return new

    def events(self, pod: Pod) -> list[dict]:
        tail = self.tails.get(pod.name)
        return tail.events if tail is not None else []


def _ready(watch: Watch, node0: Pod, standby: Pod | None, delete_at: int) -> bool:
    """Past a committed checkpoint, rank 0 mid-way to the next one (step `delete_at` + 10k),
    and in the standby arms the standby pod's spare offered to the leader (not only ready:
    until its agent offers it, the leader cannot move the deleted pod's ranks onto it)."""
    events = watch.events(node0)
    steps = [e["step"] for e in events if e["event"] == "step"]
    if not steps or steps[-1] < delete_at or steps[-1] % CHECKPOINT_EVERY != delete_at % CHECKPOINT_EVERY:
        return False
    if not any(e["event"] == "checkpoint_saved" for e in events):
        return False
    if standby is None:
        return True
    offers = [e["wids"] for e in watch.events(standby) if e["event"] == "spares_offered"]
    return bool(offers and offers[-1])


def _world_size_at(events: list[dict], t: float) -> int | None:
    """The world size named by the last event before `t` that names one."""
    sizes = [e["world_size"] for e in events if "world_size" in e and e["t"] <= t]
    return sizes[-1] if sizes else None


def _redone(events: list[dict]) -> int:
    """The most steps any rank completed more than once."""
    by_rank: dict[int, list[int]] = defaultdict(list)
    for e in events:
        if e["event"] == "step" and e.get("rank", -1) >= 0:
            by_rank[e["rank"]].append(e["step"])
    return max((len(s) - len(set(s)) for s in by_rank.values()), default=0)


def one_try(arm: str, delay: float, index: int, root: Path, jobsets: dict[str, dict],
            args: argparse.Namespace) -> PodTry:
    tag = f"{arm}-{delay:g}s-{index}"
    where = root / tag
    volume = where / "volumes" / "ckpt"
    volume.mkdir(parents=True)
    jobset = copy.deepcopy(jobsets[arm])
    secret = {f"{NAME}-secret": {"secret": secrets.token_hex(32)}}
    with open(where / "jobset.log", "w") as log:

        def say(line: str) -> None:
            log.write(f"{time.time():.3f} {line}\n")
            log.flush()
            if args.verbose:
                print(f"  {line}", flush=True)

        with Cluster(where / "cluster", volumes={"ckpt": volume}, secrets=secret) as cluster:
            run = JobSetRun(cluster, jobset, scheduling_delay=delay, on_event=say)
            try:
                run.start()
                return _measure(arm, delay, run, volume, args)
            except AssertionError as exc:  # run.pod: a pod never created
                return PodTry(arm, delay=delay, error=str(exc).splitlines()[0])
            finally:
                run.close()


def _measure(arm: str, delay: float, run: JobSetRun, volume: Path,
             args: argparse.Namespace) -> PodTry:
    node0, victim = run.pod("node", 0), run.pod("node", 1)
    standby = run.pod("standby", 0) if arm.startswith("standby") else None
    watch = Watch(run)
    deadline = time.monotonic() + args.ready_timeout
    while not _ready(watch, node0, standby, args.delete_at):
        if time.monotonic() > deadline or run.status is not None:
            what = "the standby's spare ready and " if standby is not None else ""
            return PodTry(arm, delay=delay, status=run.status,
                          error=f"never {what}past step {args.delete_at} with a checkpoint "
                                f"within {args.ready_timeout:g}s")
        watch.poll()
        time.sleep(0.01)

    before = {pod.name: max((epoch(e) for e in watch.events(pod) if e["event"] == "step"),
                            default=None) for pod in list(run.created)}

    def later(pod: Pod, e: dict) -> bool:
        """A step of the job that went on: not the deleted pod's, and from a pod that had
        no step before the deletion, or from a later attempt or generation than it had."""
        if pod is victim:
            return False
        base = before.get(pod.name)
        return base is None or epoch(e) > base

    def headline(pod: Pod, e: dict) -> bool:
        if arm == "torchrun":
            return later(pod, e)
        return pod is not victim and e.get("rank") == VICTIM_RANK

    t0 = time.time()
    run.delete_pod(victim, force=arm == "standby_force")
    resumed = job = None  # (pod, step event)
    deadline = time.monotonic() + args.hang_after
    while resumed is None and time.monotonic() < deadline:
        steps = [(p, e) for p, e in watch.poll() if e["event"] == "step" and e["t"] > t0]
        jobs = [(p, e) for p, e in steps if later(p, e)]
        if job is None and jobs:
            job = min(jobs, key=lambda pe: pe[1]["t"])
        firsts = [(p, e) for p, e in steps if headline(p, e)]
        if firsts:
            resumed = min(firsts, key=lambda pe: pe[1]["t"])
        elif run.status is not None:
            break
        time.sleep(0.01)

    (volume / GO).touch()  # the rest of the steps at full speed
    status = run.status
    if status is None and (resumed or job):
        try:
            status = run.wait(args.finish_timeout)
        except AssertionError:
            status = None
    every = {pod.name: events_of(events_dir(pod)) for pod in list(run.created)}
    flat = [e for events in every.values() for e in events]
    done_before = [e["step"] for e in flat if e["event"] == "step" and e["t"] <= t0]
    after = [p for p in run.incarnations("node", 1) if p.started > victim.started]
    result = PodTry(
        arm, delay=delay, lost_steps=_redone(flat), status=status,
        deleted_at_step=max(done_before, default=None), victim_exit=victim.code,
        recreated_after=round(after[0].started - victim.deleted, 3) if after else None,
        finished=status == "Completed" if (resumed or job) else None,
        checkpoints_failed=sum(1 for e in flat if e["event"] == "checkpoint_failed"
                               and e["t"] > t0),
        failed_starts=(sum(p.log().count("failed (exitcode") for p in after)
                       if arm == "torchrun" else None))
    if job is not None:
        pod, e = job
        result.job_resumed = round(e["t"] - t0, 4)
        result.world_size_after = _world_size_at(every.get(pod.name, []), e["t"])
    if resumed is not None:
        result.recovery = round(resumed[1]["t"] - t0, 4)
        result.resumed_at_step = resumed[1]["step"]
        if status != "Completed":
            result.error = (f"the JobSet did not complete after the resumed step "
                            f"({status or f'still running after {args.finish_timeout:g}s'})")
        return result
    who = "any rank of a restarted job" if arm == "torchrun" else f"rank {VICTIM_RANK}"
    if job is not None:
        ended = f"; the JobSet ended: {status}" if status else ""
        result.error = (f"{who} never resumed within {args.hang_after:g}s: the job went on "
                        f"without it at world size {result.world_size_after} "
                        f"({result.job_resumed:.2f}s after the deletion){ended}")
    elif run.status is not None:
        result.error = f"the JobSet ended ({run.status}: {run.reason}) before {who} resumed"
    else:
        result.hang = True
    return result


# ---------------------------------------------------------------- summary
def label(arm: str, delay: float) -> str:
    return f"{arm}@{delay:g}s"


def summarize(tries: list[PodTry]) -> dict[str, Any]:
    stats = ArmStats.of(tries)
    times = recovery_times(tries)
    jobs = [t.job_resumed for t in tries if t.job_resumed is not None]
    return {
        **stats.as_json(),
        "min_s": round(min(times), 3) if times else None,
        "max_s": round(max(times), 3) if times else None,
        "times_s": [t.recovery if not t.hang else None for t in tries],
        "job_resumed_median_s": median_of(jobs, 3),
        "world_size_after": sorted({t.world_size_after for t in tries
                                    if t.world_size_after is not None}),
        "errors": sorted({t.error for t in tries if t.error}),
        "checkpoints_failed_after": [t.checkpoints_failed for t in tries],
        **({"failed_worker_starts": [t.failed_starts for t in tries]}
           if any(t.failed_starts is not None for t in tries) else {}),
    }


def key(arm: str, delay: float, delays: list[float]) -> str:
    """The JSON key: the arm at the largest delay, `<arm>_no_delay` at 0, else with the delay."""
    if delay == max(delays) and delay > 0:
        return arm
    return f"{arm}_no_delay" if delay == 0 else f"{arm}_delay_{delay:g}s"


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def shown(t: PodTry) -> str:
    head = (f"{t.recovery:.3f}s" if t.recovery is not None and not t.hang
            else "HANG" if t.hang else "FAILED")
    parts = [head]
    if t.lost_steps is not None:
        parts.append(f"redone {t.lost_steps}")
    parts.append(f"deleted after step {t.deleted_at_step}, pod exit {t.victim_exit}")
    if t.recreated_after is not None:
        parts.append(f"recreated after {t.recreated_after:.2f}s")
    if t.job_resumed is not None:
        parts.append(f"job went on after {t.job_resumed:.3f}s at world size {t.world_size_after}")
    if t.failed_starts:
        parts.append(f"{t.failed_starts} failed worker start(s) on the recreated pod")
    if t.checkpoints_failed:
        parts.append(f"{t.checkpoints_failed} checkpoint(s) failed after the deletion")
    parts.append(f"JobSet {t.status or 'not ended'}")
    if t.error:
        parts.append(f"** {t.error}")
    return ";  ".join(parts)


def target(name: str, value: float | None, ok: bool | None, why: str) -> tuple[bool | None, str]:
    verdict = "met" if ok else "NOT MET" if ok is not None else "NOT SHOWN"
    return ok, f"{name}: {verdict} ({why if value is None else why.format(value)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=2, help="tries per arm and delay (default 2)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}")
    p.add_argument("--delays", default="0,10",
                   help="emulated scheduling delays, seconds, comma-separated (default 0,10)")
    p.add_argument("--node-timeout", type=float, default=5.0,
                   help="unbroken k8s --node-timeout (default 5)")
    p.add_argument("--step-sleep", type=float, default=0.05,
                   help="seconds each step waits, standing in for accelerator time")
    p.add_argument("--steps", type=int, default=600,
                   help="the job's steps (paced by --step-sleep until the figure is taken)")
    p.add_argument("--delete-at", type=int, default=25,
                   help="delete once rank 0 has done this step + 10k, k >= 0 (default 25: mid-way "
                        "between checkpoints)")
    p.add_argument("--hang-after", type=float, default=45.0,
                   help="seconds after the deletion without the resumed step: a failure")
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--finish-timeout", type=float, default=120.0)
    p.add_argument("--torchrun-rdzv", choices=["static", "c10d"], default="static",
                   help="static (default): on node 0's name, torchrun's agent store; c10d: "
                        "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    p.add_argument("--keep", action="store_true", help="keep the pods' directories")
    p.add_argument("-v", "--verbose", action="store_true", help="print the controllers' events")
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arm(s) {sorted(unknown)}")
    delays = [float(d) for d in args.delays.split(",")]
    why = unavailable()
    if why is not None:
        raise SystemExit(f"pods cannot be emulated here: {why}")

    root = temp_root("unbroken-bench-pods-", keep=args.keep)
    with_standby, plain = generate(root, True, args), generate(root, False, args)
    jobsets = {"standby": with_standby, "standby_force": with_standby, "recreated": plain,
               "torchrun": torchrun_jobset(plain, args)}
    combos = {label(a, d): (a, d) for d in delays for a in arms}

    def report(i: int, name: str, t: PodTry) -> None:
        print(f"try {i + 1:2d} {name:20s} deletion-to-resumed-step {shown(t)}", flush=True)

    results = alternate(list(combos), args.tries,
                        lambda name, i: one_try(*combos[name], i, root, jobsets, args),
                        report=report)
    summary = {name: summarize(tries) for name, tries in results.items()}

    print()
    print(f"{'arm':14s} {'delay':>6s} {'median':>9s} {'min':>9s} {'max':>9s} "
          f"{'redone med/max':>15s} {'hangs':>6s} {'failed':>7s}  job went on (median, world size)")
    for name, s in summary.items():
        arm, delay = combos[name]
        redone = (f"{s['lost_steps_median']:g}/{s['lost_steps_max']}"
                  if s["lost_steps_max"] is not None else "-")
        print(f"{arm:14s} {delay:>5g}s {_fmt(s['median_s']):>9s} {_fmt(s['min_s']):>9s} "
              f"{_fmt(s['max_s']):>9s} {redone:>15s} {s['hangs']:>3d}/{s['tries']:<2d} "
              f"{s['failed']:>4d}/{s['tries']:<2d}  {_fmt(s['job_resumed_median_s'])} "
              f"{s['world_size_after'] or '-'}")
        for error in s["errors"]:
            print(f"{'':22s}** {error}")

    def med(arm: str, delay: float) -> float | None:
        s = summary.get(label(arm, delay))
        return s["median_s"] if s else None

    high = max(delays)
    ratios = {
        "ratio_torchrun_over_standby": ratio(med("torchrun", high), med("standby", high)),
        "ratio_torchrun_no_delay_over_standby": ratio(med("torchrun", 0), med("standby", 0)),
        "ratio_torchrun_over_standby_force": ratio(med("torchrun", high), med("standby_force", high)),
        "ratio_torchrun_over_recreated": ratio(med("torchrun", high), med("recreated", high), 2),
        "ratio_torchrun_no_delay_over_recreated": ratio(med("torchrun", 0), med("recreated", 0), 2),
    }
    def x(r: float | None) -> str:
        return "undefined" if r is None else f"{r}x"

    print()
    print(f"torchrun at {high:g}s / standby: {x(ratios['ratio_torchrun_over_standby'])};  "
          f"torchrun at 0s / standby: {x(ratios['ratio_torchrun_no_delay_over_standby'])};  "
          f"torchrun at {high:g}s / standby, force: "
          f"{x(ratios['ratio_torchrun_over_standby_force'])}")
    print(f"torchrun / recreated: {x(ratios['ratio_torchrun_over_recreated'])} at {high:g}s, "
          f"{x(ratios['ratio_torchrun_no_delay_over_recreated'])} at 0s"
          + ("" if med("recreated", high) and med("recreated", 0)
             else "  (undefined where rank 1 never resumed on the recreated pod)"))

    standby_worst = max([m for m in (med("standby", d) for d in delays) if m is not None],
                        default=None)
    t_high, t_zero = ratios["ratio_torchrun_over_standby"], ratios["ratio_torchrun_no_delay_over_standby"]
    checks = [
        target("a standby pod takes over a deleted pod's rank in <= 1 s", standby_worst,
               None if standby_worst is None else standby_worst <= 1.0,
               "no standby figure" if standby_worst is None
               else "standby median {:.3f}s, the larger over the delays"),
        target(f">= 10x faster than torchrun at {high:g} s", t_high,
               None if t_high is None else t_high >= 10,
               "no ratio: an arm has no figure" if t_high is None else "{}x"),
        target("faster than torchrun at 0 s", t_zero, None if t_zero is None else t_zero > 1,
               "no ratio: an arm has no figure" if t_zero is None else "torchrun takes {}x"),
    ]
    for _, line in checks:
        print(f"target: {line}")
    if args.keep:
        print(f"pods' directories kept in {root}")

    figures = {key(*combos[name], delays): s for name, s in summary.items()}
    emit({
        "benchmark": "pods", "nnodes": 2, "nproc_per_node": 1, "step_sleep_s": args.step_sleep,
        "steps": args.steps, "delete_at_step": args.delete_at, "scheduling_delays_s": delays,
        "node_timeout_s": args.node_timeout, "torchrun_rdzv": args.torchrun_rdzv,
        "hang_after_s": args.hang_after, **figures, **ratios,
        "targets": {"standby_le_1s": checks[0][0], "ge_10x_torchrun": checks[1][0],
                    "faster_than_torchrun_no_delay": checks[2][0]},
    })


if __name__ == "__main__":
    main()
