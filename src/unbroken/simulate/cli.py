"""`unbroken simulate`: its flags, and the command that runs the simulation and prints it.

Every flag fills a field of `simulate.inputs` (`Job`, `Failures`); bad input is one line
and exit 2, as everywhere in unbroken."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

from unbroken.errors import ExitCode, UserError
from unbroken.simulate.inputs import CheckpointMode, Failures, Job, Kind, Scale, Strategy


def _number(name: str, positive: bool = True, integer: bool = False):
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, got {text!r}") from None
        if not math.isfinite(value) or (value <= 0 if positive else value < 0):
            raise argparse.ArgumentTypeError(
                f"{name} must be {'positive' if positive else 'zero or more'}, got {text}")
        return value
    return parse


def _shares(text: str) -> dict[Kind, float]:
    """`crash=0.7,node_lost=0.2,...`: kinds not named get 0."""
    out = {k: 0.0 for k in Kind}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        try:
            out[Kind(name.strip())] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--shares takes KIND=SHARE,... with KIND one of "
                f"{', '.join(k.value for k in Kind)}, got {part!r}") from None
    return out


def _interval(text: str) -> float | None:
    if text == "young-daly":
        return None
    return _number("--checkpoint-every")(text) * 60


def _spares(text: str) -> int | str:
    return "auto" if text == "auto" else int(_number("--spares", False, True)(text))


def add_simulate_flags(p: argparse.ArgumentParser) -> None:
    d = Job()
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--gpus", type=_number("--gpus", integer=True), default=d.gpus,
                       help=f"GPUs that train (default {d.gpus})")
    scale.add_argument("--sweep", action="store_true",
                       help="every scale from 8 to 131,072 GPUs, doubling")
    p.add_argument("--gpus-per-node", type=_number("--gpus-per-node", integer=True),
                   default=d.gpus_per_node,
                   help=f"GPUs a node holds, spares included (default {d.gpus_per_node})")
    p.add_argument("--days", type=_number("--days"), default=d.days,
                   help=f"wall time simulated (default {d.days:g})")
    p.add_argument("--seeds", type=_number("--seeds", integer=True), default=100,
                   help="runs per strategy, each with its own failure draws (default 100)")
    p.add_argument("--seed", type=_number("--seed", False, True), default=0,
                   help="the first seed: the same seed, the same result")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--job-mttf-hours", type=_number("--job-mttf-hours"), default=None,
                      help="the job's MTTF at --mttf-gpus (default Meta RSC's 1.8 h at 16,384)")
    rate.add_argument("--gpu-mtbf-hours", type=_number("--gpu-mtbf-hours"), default=None,
                      help="one GPU's mean time between failures instead")
    p.add_argument("--mttf-gpus", type=_number("--mttf-gpus", integer=True), default=16384,
                   help="the GPU count --mttf-h was measured at: the rate scales from it "
                        "(default 16384, Meta's)")
    p.add_argument("--shares", type=_shares, default=None,
                   help="each failure kind's share, summing to 1 (default from Llama 3: "
                        "crash=0.75,node_lost=0.2,hang=0.02,sdc=0.01,straggler=0.02)")
    p.add_argument("--weibull-shape", type=_number("--weibull-shape"), default=1.0,
                   help="shape of the times between failures (1: exponential)")
    every = p.add_mutually_exclusive_group()
    every.add_argument("--checkpoint-every-min", type=_number("--checkpoint-every-min"),
                       default=None, help="compute minutes between checkpoints")
    every.add_argument("--checkpoint-every", type=_interval, default=None,
                       metavar="young-daly|MIN", help="young-daly (the default) or minutes")
    p.add_argument("--checkpoint", type=CheckpointMode, choices=list(CheckpointMode),
                   default=None, help="how the job checkpoints today: sync (the loop stops "
                   "for the whole save; given to the torchrun arm, while unbroken's arms save "
                   "asynchronously) or async (every arm; the default model)")
    p.add_argument("--checkpoint-stall", type=_number("--checkpoint-stall"), default=None,
                   metavar="S", help="seconds one of today's saves stops the loop (default: "
                   "the model's; --from-run of a plain script: its measured saves)")
    p.add_argument("--restart-min", type=_number("--restart-min"), default=None,
                   help="your real restart, failure to training again: pod rescheduling, "
                        "image pull, imports and checkpoint load included (default: scaled "
                        "from published restarts, docs/simulate.md)")
    p.add_argument("--switch-s", type=_number("--switch-s", False), default=None,
                   help="the in-place switch's whole downtime at this scale, communicator "
                        "set-up included (default: the switch --from-run measured, else our "
                        "measured switch plus set-up anchored on TrainMover's: docs/simulate.md)")
    p.add_argument("--spares", type=_spares, default=d.spares_per_node, metavar="N|auto",
                   help="spare GPUs per node, within --gpus-per-node (8 GPUs and 1 spare "
                        "train on 7); auto: find the cheapest reserve")
    p.add_argument("--standby-nodes", type=_number("--standby-nodes", False, True),
                   default=d.standby_nodes,
                   help=f"whole nodes standing by to take a lost node's ranks "
                        f"(default {d.standby_nodes})")
    p.add_argument("--node-replace-min", type=_number("--node-replace-min"),
                   default=d.node_replace_s / 60,
                   help="the scheduler's time to give back a lost node, warm-up included")
    p.add_argument("--step-s", type=_number("--step-s"), default=d.step_s,
                   help=f"seconds a training step takes (default {d.step_s:g})")
    p.add_argument("--replica-gpus", type=_number("--replica-gpus", integer=True),
                   default=None, help="GPUs of one data-parallel replica (default a node)")
    p.add_argument("--state-gb-per-gpu", type=_number("--state-gb-per-gpu"),
                   default=d.state_gb_per_gpu,
                   help=f"GB of model and optimizer state per GPU, what a checkpoint writes "
                        f"(default {d.state_gb_per_gpu:g})")
    p.add_argument("--target-ettr", type=_number("--target-ettr"), default=None,
                   help="with --spares auto: the fewest reserved GPUs reaching this ETTR")
    p.add_argument("--gpu-hour-cost", type=_number("--gpu-hour-cost", False), default=None,
                   help="price of a GPU-hour, for --spares auto")
    p.add_argument("--from-run", nargs="+", metavar="RUN_DIR", default=None,
                   help="take recovery costs (and real fault rates) from these runs")
    p.add_argument("--sensitivity", action="store_true",
                   help="each cost halved and doubled: how much the answer rests on it")
    p.add_argument("--best-interval", action="store_true",
                   help="the checkpoint interval that wastes least, against Young/Daly's")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", metavar="FILE", default=None, help="write the plot")
    p.add_argument("--html", metavar="FILE", default=None, help="write one HTML page")


def _refuse_combinations(args: argparse.Namespace) -> None:
    """Flags that would be ignored together: one line saying so, not a silent drop."""
    if args.target_ettr is not None and not 0 < args.target_ettr < 1:
        raise UserError(f"--target-ettr must be between 0 and 1, got {args.target_ettr:g}")
    if args.spares != "auto" and (args.target_ettr is not None or args.gpu_hour_cost is not None):
        raise UserError("--target-ettr and --gpu-hour-cost are for --spares auto")
    if args.sweep:
        for name, given in (("--spares auto", args.spares == "auto"),
                            ("--sensitivity", args.sensitivity),
                            ("--best-interval", args.best_interval)):
            if given:
                raise UserError(f"{name} works at one scale: give --gpus N, not --sweep")
        if 8 % args.gpus_per_node:
            raise UserError(f"--sweep runs 8 to 131,072 GPUs: --gpus-per-node must divide 8, "
                            f"got {args.gpus_per_node}")


def inputs_from_args(args: argparse.Namespace) -> tuple[Failures, Job]:
    _refuse_combinations(args)
    failures = Failures(
        job_mttf_hours=None if args.gpu_mtbf_hours else (args.job_mttf_hours or 1.8),
        mttf_gpus=int(args.mttf_gpus), gpu_mtbf_hours=args.gpu_mtbf_hours,
        weibull_shape=args.weibull_shape, **({"shares": args.shares} if args.shares else {}))
    every = args.checkpoint_every
    if args.checkpoint_every_min is not None:
        every = args.checkpoint_every_min * 60
    job = Job(gpus=8 if args.sweep else int(args.gpus), gpus_per_node=int(args.gpus_per_node), days=args.days,
              step_s=args.step_s, replica_gpus=int(args.replica_gpus or args.gpus_per_node),
              checkpoint_every_s=every,
              spares_per_node=0 if args.spares == "auto" else int(args.spares),
              standby_nodes=int(args.standby_nodes), node_replace_s=args.node_replace_min * 60,
              restart_s=None if args.restart_min is None else args.restart_min * 60,
              checkpoint=args.checkpoint, checkpoint_stall_s=args.checkpoint_stall,
              switch_s=args.switch_s, state_gb_per_gpu=args.state_gb_per_gpu)
    return failures, job


def run_simulate(args: argparse.Namespace) -> int:
    from unbroken.simulate import output, results
    from unbroken.simulate.validation import llama3_check
    from unbroken.simulate.verdict import stall_source, verdict

    failures, job = inputs_from_args(args)
    scale = Scale()
    seeds = int(args.seeds)
    text: list[str] = []
    data: dict[str, Any] = {"days": job.days, "seeds": seeds, "seed": int(args.seed)}
    if args.from_run:
        from unbroken.simulate.from_run import measure

        measures = measure(args.from_run)
        text += measures.describe()
        scale = replace(scale, measured=measures.measured())
        if measures.gpu_mtbf_hours is not None and args.job_mttf_hours is None \
                and args.gpu_mtbf_hours is None:  # a rate given on the command line wins
            failures = replace(failures, job_mttf_hours=None,
                               gpu_mtbf_hours=measures.gpu_mtbf_hours[0])
        data["from_run"] = {"lines": measures.describe(),
                            "gpu_mtbf_hours": measures.gpu_mtbf_hours}
        if job.switch_s is None and "switch_s" in measures.costs:
            job = replace(job, switch_s=measures.costs["switch_s"].median)
        job = _today_from_run(job, measures, args)
    source = switch_source(args, measures if args.from_run else None)
    text += output.wrapped(f"in-place switch: {source}")
    if args.spares == "auto":  # plan first: the tables then show the chosen reserve
        from unbroken.simulate.planning import plan_spares

        plan = plan_spares(failures, job, scale, min(seeds, 20), args.gpu_hour_cost,
                           args.target_ettr, seed=int(args.seed))
        data["plan"] = {"why": plan.why, "options": [vars(o) for o in plan.options],
                        "chosen": vars(plan.chosen) if plan.chosen else None}
        text += [f"capacity plan ({min(seeds, 20)} seeds):"] + output.plan_table(plan) + [""]
        if plan.chosen is not None:
            job = replace(job, spares_per_node=plan.chosen.spares_per_node,
                          standby_nodes=plan.chosen.standby_nodes)
    data["inputs"] = {"gpus": job.gpus, "gpus_per_node": job.gpus_per_node,
                      "job_mttf_hours_at_gpus": round(failures.job_mttf_s(job.gpus) / 3600, 4),
                      "weibull_shape": failures.weibull_shape,
                      "shares": {k.value: v for k, v in failures.shares.items()},
                      "spares_per_node": job.spares_per_node, "standby_nodes": job.standby_nodes,
                      "node_replace_min": job.node_replace_s / 60, "step_s": job.step_s,
                      "restart_min": None if job.restart_s is None else job.restart_s / 60,
                      "switch_s": job.switch_s, "switch_source": source,
                      "checkpoint": job.checkpoint, "checkpoint_stall_s": job.checkpoint_stall_s,
                      "reserved_gpus": {s.value: job.reserved_gpus(s) for s in Strategy}}
    if args.sweep:
        data["sweep"] = results.sweep(failures, job, scale, seeds, int(args.seed))
        text += output.sweep_table(data["sweep"])
    else:
        data.update(results.at_scale(failures, job, scale, seeds, int(args.seed)))
        text += [f"{job.gpus:,} GPUs ({job.nodes:,} nodes), {job.days:g} days, {seeds} seeds",
                 *output.wrapped(stall_source(job, scale))]
        text += output.costs_lines(data["costs"]) + output.strategy_table(data, job)
        data["verdict"] = verdict(data, job)
        text.insert(0, data["verdict"])  # the answer first, then how it was reached
    if args.from_run and not args.sweep:
        data["from_run"]["ettr_range"] = _projection_range(
            measures, failures, job, scale, min(seeds, 20), int(args.seed),
            switch_from_run=args.switch_s is None and "switch_s" in measures.costs,
            rate_from_run=args.job_mttf_hours is None and args.gpu_mtbf_hours is None)
        text += [""] + output.wrapped(
            f"the runs' uncertainty ({min(seeds, 20)} seeds): ETTR with every measured cost "
            "at its lowest and a real fault rate at its 95 % bounds, then the highest") + [f"  {k}: {lo:.4f} to {hi:.4f}" for k, (lo, hi) in
                               data["from_run"]["ettr_range"].items()]
    if args.sensitivity and not args.sweep:
        data["sensitivity"] = results.sensitivity(failures, job, scale, min(seeds, 20),
                                                  int(args.seed))
        text += ["", f"sensitivity ({min(seeds, 20)} seeds): ETTR with one cost x0.5 and x2 "
                 "(change)"] + output.sensitivity_table(data["sensitivity"])
    if args.best_interval and not args.sweep:
        data["best_interval"] = _best_interval(failures, job, scale, min(seeds, 20),
                                               int(args.seed))
        text += ["", f"checkpoint interval ({min(seeds, 20)} seeds, common draws):"] + [
            f"  {k}: best {v['best_s']:.0f} s (waste {v['best_waste']:.5f}); Young/Daly "
            f"{v['daly_s']:.0f} s (waste {v['daly_waste']:.5f})"
            for k, v in data["best_interval"].items()]
    check = llama3_check(seeds=min(seeds, 100), seed=int(args.seed))
    data["llama3_check"] = {"ettr": round(check.ettr, 4),
                            "ettr_ci": [round(x, 4) for x in check.ettr_ci],
                            "published": check.published, "published_is": "a lower bound",
                            "inputs": check.inputs, "sensitivity": check.sensitivity}
    text += [""] + output.wrapped(
        f"llama3_check: a restart-style job at Llama 3's interruption rate gives ETTR "
        f"{check.ettr:.3f}; published: > {check.published:.2f} ("
        + ", ".join(f"{k} {v:g}" for k, v in check.inputs.items()) + ")")
    for path, write in ((args.png, output.write_png), (args.html, None)):
        if path:
            written = write(data, path) if write else output.write_html(data, text, path)
            print(f"wrote {written}", file=sys.stderr)
    if args.json:
        print(json.dumps(data, separators=(",", ":")))
    else:
        print("\n".join(text))
    return ExitCode.SUCCESS


def _today_from_run(job: Job, measures: Any, args: argparse.Namespace) -> Job:
    """A plain script's run: its own saves are today's synchronous checkpoints (a flag given
    on the command line wins)."""
    today = measures.today
    if "stall_s" not in today or args.checkpoint == CheckpointMode.ASYNC:
        return job
    every = job.checkpoint_every_s
    if every is None and args.checkpoint_every is None and "every_s" in today:
        every = today["every_s"].median
    return replace(job, checkpoint=CheckpointMode.SYNC, checkpoint_every_s=every,
                   checkpoint_stall_s=job.checkpoint_stall_s or today["stall_s"].median)


def switch_source(args: argparse.Namespace, measures: Any) -> str:
    """Where the in-place switch's figure comes from, said once in the output."""
    if args.switch_s is not None:
        return f"{args.switch_s:g} s at every scale (--switch-s)"
    if measures is not None and "switch_s" in measures.costs:
        s = measures.costs["switch_s"]
        return (f"{s.median:.3f} s at every scale, as --from-run measured it (n={s.n}, at "
                f"{measures.workers or '?'} workers; --switch-s overrides)")
    return ("modelled: our measured switch plus communicator set-up at N, anchored on "
            "TrainMover's at 32 and 1,024 GPUs (docs/simulate.md; --switch-s overrides)")


def _projection_range(measures, failures: Failures, job: Job, scale: Scale, seeds: int,
                      seed: int, switch_from_run: bool = False,
                      rate_from_run: bool = True) -> dict[str, list[float]]:
    """Each strategy's ETTR at the optimistic end of what the runs measured (every cost at
    its lowest, the fault rate at its lower bound) and at the pessimistic end.
    `switch_from_run`: the job's switch is the runs' too, taken at the same end;
    `rate_from_run`: so is the fault rate (not where the command line gave one)."""
    from unbroken.simulate import results

    ends = []
    for bound, mtbf_at in (("low", 2), ("high", 1)):
        f = failures
        if rate_from_run and measures.gpu_mtbf_hours is not None \
                and math.isfinite(measures.gpu_mtbf_hours[mtbf_at]):
            f = replace(failures, job_mttf_hours=None,
                        gpu_mtbf_hours=measures.gpu_mtbf_hours[mtbf_at])
        j = replace(job, switch_s=getattr(measures.costs["switch_s"], bound)) \
            if switch_from_run else job
        ends.append(results.at_scale(f, j, replace(scale, measured=measures.measured(bound)),
                                     seeds, seed))
    return {s: sorted([ends[0][s]["ettr"], ends[1][s]["ettr"]])
            for s in ("torchrun", "in_place", "spares", "spares_standby")}


def _best_interval(failures: Failures, job: Job, scale: Scale, seeds: int,
                   seed: int) -> dict[str, dict[str, float]]:
    """Each strategy's waste over a grid of checkpoint intervals around Young/Daly's (the
    checkpointer's own `daly_interval`), on the same draws."""
    from unbroken.simulate.engine import Checkpoints
    from unbroken.simulate.inputs import Strategy
    from unbroken.simulate.validation import interval_sweep

    ck = Checkpoints.for_job(job, scale, failures)
    out = {}
    for strategy in (Strategy.TORCHRUN, Strategy.IN_PLACE):
        sweep = interval_sweep(failures, job, scale, seeds, ck.stall_s, ck.persist_s,
                               strategy, points=13, seed=seed)
        out[strategy.value] = {"best_s": round(sweep.best_s, 1),
                               "best_waste": round(sweep.best_waste, 6),
                               "daly_s": round(sweep.daly_s, 1),
                               "daly_waste": round(sweep.daly_waste, 6)}
    return out
