"""What a run's event log says: steps, faults, the time each fault cost, the loss.

For each fault, `downtime` runs from the moment the fault happened (an injected fault: its
injection; a hang: its last heartbeat; otherwise: its detection) to the first step completed
after recovery (in place: by the next generation; by restart: by the next attempt), and
`redone` counts the steps that were computed before the fault and had to run again.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EVENTS_FILE, read_events
from unbroken.telemetry.goodput import distinct_faults


def summarize(run_dir: str | Path | Sequence[str | Path]) -> dict[str, Any]:
    """The run's summary from its run dir, or from every node's run dir where the nodes do
    not share one (merged on the leader's clock, as `sources.load_events` does)."""
    if isinstance(run_dir, (str, Path)):
        path = Path(run_dir) / EVENTS_FILE
        if not path.is_file():
            raise UserError(f"no event log at {path}; pass the run directory `unbroken run` "
                            "printed")
        records = read_events(path)
    else:
        from unbroken.telemetry.sources import load_events

        records = load_events(run_dir)
    names = [run_dir] if isinstance(run_dir, (str, Path)) else list(run_dir)
    return summary_of(ev.decode_all(records), ", ".join(str(d) for d in names))


def summary_of(events: list[ev.EventBody], run_dir: str) -> dict[str, Any]:
    """The summary of a run's merged, decoded events (`summarize`); its faults in the order
    they happened, as the goodput report's (`goodput.account`) are. Pure."""
    steps = [e for e in events if isinstance(e, ev.Step)]
    starts = [e.t for e in events if isinstance(e, ev.AgentStart)]
    exits = [e for e in events if isinstance(e, ev.AgentExit)]
    wall = (max(e.t for e in exits) - min(starts)) if starts and exits else None

    by_step: dict[int, list[ev.Step]] = {}
    last_attempt: dict[int, int] = {}
    for e in steps:
        last_attempt[e.step] = max(last_attempt.get(e.step, -1), e.attempt)
    for e in steps:  # the run's history is the last attempt that computed each step
        if e.attempt == last_attempt[e.step]:
            by_step.setdefault(e.step, []).append(e)

    def mean_loss(step: int) -> float | None:
        losses = [e.loss for e in by_step.get(step, []) if e.loss is not None]
        return round(statistics.fmean(losses), 4) if losses else None

    def attempt_of(e: ev.EventBody) -> int:
        return e.attempt if e.attempt is not None else 0

    def gen_of(e: ev.Step) -> int:
        return e.gen if e.gen is not None else 0

    durations = [statistics.fmean(e.duration for e in es) for es in by_step.values()]
    faults = []
    for seen in sorted(distinct_faults(events), key=lambda f: f.began):
        f, t = seen.event, seen.t
        attempt = attempt_of(f)
        began = seen.began  # when it happened (goodput.distinct_faults)
        before = [e for e in steps if e.attempt == attempt and e.t <= began]
        reached = max((e.step for e in before), default=-1) + 1
        resumed: ev.EventBody | None
        if f.in_place:
            # Recovered in place: the first step of a later generation of the same attempt.
            gen = max((gen_of(e) for e in before), default=0)
            resumed = next((e for e in steps if e.attempt == attempt and gen_of(e) > gen
                            and e.t > t), None)
            resumed_from = resumed.step if resumed else None
        else:
            resumed = next((e for e in steps if e.attempt > attempt and e.t > t), None)
            if resumed is None:  # no step was left to run: the restart resumed into the end
                resumed = next((e for e in events if isinstance(e, ev.Resume)
                                and attempt_of(e) > attempt and e.t > t), None)
            resumed_from = next((e.step for e in events if isinstance(e, ev.Resume)
                                 and e.attempt == attempt + 1), None)
        restarted = next((e.t for e in events if isinstance(e, ev.WorkersStarted)
                          and attempt_of(e) > attempt and e.t > t), None)
        faults.append({
            "restart_s": round(restarted - began, 3) if restarted is not None else None,
            "kind": f.kind, "rank": f.rank, "node": f.node, "host": f.host,
            "attempt": attempt, "step": f.step, "detail": f.detail,
            "in_place": bool(f.in_place), "injected": seen.injected,
            "detection": round(t - began, 3),
            "downtime": round(resumed.t - began, 3) if resumed else None,
            "redone": max(0, reached - resumed_from) if resumed_from is not None else None,
        })
    committed = max(by_step, default=-1) + 1
    return {
        "steps_known": bool(steps),
        "run_dir": run_dir,
        "steps": committed,
        "steps_computed": len({(e.attempt, e.step) for e in steps}),
        "attempts": 1 + max((attempt_of(e) for e in events), default=0),
        "wall": round(wall, 3) if wall is not None else None,
        "step_time": round(statistics.median(durations), 4) if durations else None,
        "useful": round(sum(durations), 3),
        "first_loss": mean_loss(min(by_step)) if by_step else None,
        "final_loss": mean_loss(max(by_step)) if by_step else None,
        "faults": faults,
        "checkpoints_failed": _failed_saves(events),
        "exit_code": exits[-1].code if exits else None,
    } | ({"steps_watched": watched} if (watched := _watched_steps(events)) else {})


def _failed_saves(events: list[ev.EventBody]) -> list[dict[str, Any]]:
    """Each checkpoint save that committed nothing, once (every rank reports it), and why."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, ev.CheckpointFailed) and e.source == "worker":
            out.setdefault(e.step, {"step": e.step, "error": e.error})
    return list(out.values())


def _watched_steps(events: list[ev.EventBody]) -> int:
    """Steps an unchanged script computed (`script_steps`), its redone ones included: the
    most any one rank did."""
    per: dict[int | None, int] = {}
    for e in events:
        if isinstance(e, ev.ScriptSteps):
            per[e.slot] = per.get(e.slot, 0) + len(e.steps)
    return max(per.values(), default=0)


def _where(f: dict[str, Any]) -> str:
    """ ` on node N (host)`, as far as the fault says."""
    if f.get("rank") is None:  # a node's fault: its node is the subject already
        return f" ({f['host']})" if f.get("host") else ""
    if f.get("node") is None:
        return ""
    return f" on node {f['node']}" + (f" ({f['host']})" if f.get("host") else "")


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"run {s['run_dir']}"]
    wall = f"{s['wall']:.1f}s" if s["wall"] is not None else "unfinished"
    if s["steps_known"]:
        lines.append(f"  steps done      {s['steps']} ({s['steps_computed']} computed, "
                     f"{s['attempts']} attempt(s)), wall time {wall}")
    elif s.get("steps_watched"):
        lines.append(f"  steps           {s['steps_watched']} computed by an unchanged script, "
                     f"seen by torch's optimizer hooks ({s['attempts']} attempt(s)), wall time "
                     f"{wall}")
    else:
        lines.append(f"  steps           unknown: the script reports no steps to unbroken (it does "
                     f"not use run.steps/run.train); {s['attempts']} attempt(s), wall time {wall}")
    if s["step_time"] is not None:
        lines.append(f"  step time       {1000 * s['step_time']:.0f} ms median")
    if s["first_loss"] is not None:
        lines.append(f"  loss            {s['first_loss']:.3f} -> {s['final_loss']:.3f}")
    lines.append(f"  faults          {len(s['faults'])}")
    for i, f in enumerate(s["faults"], 1):
        who = f"rank {f['rank']}" if f["rank"] is not None else f"node {f['node']}"
        if not s["steps_known"]:
            back = (f"the script restarted {f['restart_s']:.2f}s later" if f["restart_s"]
                    is not None else "not restarted")
            lines.append(f"   {i}. {f['kind']:<9} {who} (attempt {f['attempt']}): detected in "
                         f"{f['detection']:.2f}s, {back}; steps lost: unknown")
            continue
        down = f"{f['downtime']:.2f}s" if f["downtime"] is not None else "not recovered"
        how = "in place" if f.get("in_place") else "by restart"
        redone = f", {f['redone']} step(s) redone" if f["redone"] is not None else ""
        cost = (f", cost {f['cost']:.1f} rank-s" if f.get("cost") is not None else "")
        lines.append(f"   {i}. {f['kind']:<9} {who}{_where(f)} at step {f['step']}"
                     f"{' (injected)' if f.get('injected') else ''}: detected in "
                     f"{f['detection']:.2f}s, {down} to the next step ({how}){redone}{cost}")
    failed = s.get("checkpoints_failed") or []
    if failed:
        lines.append(f"  checkpoints     {len(failed)} save(s) failed; the previous one stayed "
                     "the latest:")
        lines += [f"    step {c['step']}: {c['error']}" for c in failed]
    if s["exit_code"] is not None:
        lines.append(f"  exit code       {s['exit_code']}")
    return "\n".join(lines)
