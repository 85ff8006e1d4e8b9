"""Train a small GPT on the Python Language Reference, data-parallel (DDP) over gloo on CPU.

Runs unchanged under `unbroken run`, under `torchrun`, or as a single `python train.py`:

    unbroken run --nproc-per-node 4 --max-restarts 3 examples/gpt/train.py --steps 200

Under `unbroken run`, a worker's fault does not stop the others: they recover in place.
"""

from __future__ import annotations

import argparse
import array
import os
import random
import time
import zlib

import torch
import torch.nn.functional as F
from data import CharCorpus
from model import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel as DDP

import unbroken


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step, all ranks")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--final-state", default=None, help="rank 0 saves model and optimizer here")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step waits, standing in for accelerator time: on a GPU "
                        "host the CPUs are mostly idle (benchmarks/spares.py uses it)")
    p.add_argument("--sleep-until", default=None, metavar="PATH",
                   help="sleep --step-sleep per step only until PATH exists (a test that has "
                        "seen what it waited for lets the job run out its steps at full speed)")
    p.add_argument("--step-jitter", type=float, default=1.0,
                   help="each step's --step-sleep is scaled by a random factor in [1, J], per "
                        "rank and step (a noisy step time; benchmarks/hang.py uses it)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="every N steps rank 0 evaluates for --eval-seconds inside the step, "
                        "declared with run.phase('eval'); the other ranks wait for it")
    p.add_argument("--eval-seconds", type=float, default=4.0)
    p.add_argument("--exact", action="store_true",
                   help="reduce gradients in rank order: bit-identical results across recoveries")
    p.add_argument("--stall-prob", type=float, default=0.0,
                   help="each rank-step, with this probability, sleeps a further uniform "
                        "(0, --stall-max) x --step-sleep (sparse jitter; seeded by step and rank)")
    p.add_argument("--stall-max", type=float, default=3.0)
    p.add_argument("--wait-for", default=None, metavar="PATH",
                   help="at step --wait-at, every rank waits (up to 300 s, a declared long "
                        "phase) until PATH exists (a test holds the job until a spare is ready)")
    p.add_argument("--wait-at", type=int, default=0)
    a = p.add_argument_group("anomalies (docs/anomalies.md)")
    a.add_argument("--anomalies", action="store_true",
                   help="check every step for NaN, Inf and loss spikes")
    a.add_argument("--on-anomaly", choices=[r.value for r in unbroken.Remedy], default="skip")
    a.add_argument("--max-anomalies", type=int, default=5)
    a.add_argument("--anomaly-window", type=int, default=1000)
    a.add_argument("--skip-after", type=int, default=0)
    a.add_argument("--sdc", action="store_true", help="compare the replicas' checksums")
    a.add_argument("--sdc-every", type=int, default=None)
    a.add_argument("--on-sdc", choices=[r.value for r in unbroken.SdcRemedy], default="rollback")
    a.add_argument("--stragglers", choices=["off", *[r.value for r in unbroken.StragglerRemedy]],
                   default="off")
    a.add_argument("--skip-steps", default="",
                   help="comma-separated steps to pass over (run.skip_steps): the reference "
                        "run for a job that skipped them")
    args = p.parse_args()
    anomalies = unbroken.AnomalyConfig(
        numerics=unbroken.NumericsConfig(
            enabled=args.anomalies, remedy=unbroken.Remedy(args.on_anomaly),
            max_anomalies=args.max_anomalies, anomaly_window=args.anomaly_window,
            skip_after=args.skip_after),
        sdc=unbroken.SdcConfig(enabled=args.sdc, every=args.sdc_every,
                               remedy=unbroken.SdcRemedy(args.on_sdc)),
        stragglers=unbroken.StragglerConfig(
            enabled=args.stragglers != "off",
            remedy=unbroken.StragglerRemedy(
                args.stragglers if args.stragglers != "off" else "report")))

    torch.set_num_threads(1)
    run = unbroken.init(checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                        seed=args.seed, anomalies=anomalies)
    if args.skip_steps:
        run.skip_steps([int(s) for s in args.skip_steps.split(",")])
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    corpus = CharCorpus.load()
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=args.seq,
                          n_layer=args.layers, n_embd=args.dim))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run.track(model, optimizer)

    def build() -> torch.nn.Module:  # once per generation: the wrapper that needs the group
        if run.world_size == 1:
            return model
        ddp = DDP(model)
        if args.exact:
            ddp.register_comm_hook(None, unbroken.exact_allreduce)
        return ddp

    def train_step(step: int, net: torch.nn.Module) -> None:  # forward + backward; no opt.step()
        if args.eval_every and step and step % args.eval_every == 0 and run.rank == 0:
            with run.phase("eval"):  # many step times long: no hang timeout runs in it
                time.sleep(args.eval_seconds)  # stands in for an evaluation pass
        if args.wait_for and step == args.wait_at:
            with run.phase("wait"):
                deadline = time.monotonic() + 300
                while not os.path.exists(args.wait_for) and time.monotonic() < deadline:
                    time.sleep(0.05)
        if args.step_sleep and not (args.sleep_until and os.path.exists(args.sleep_until)):
            # The accelerator's time for the step: before the gradients' all-reduce, as a
            # forward and backward would spend it.
            rng = random.Random(step * 1_000_003 + run.rank)
            jitter = rng.uniform(1.0, args.step_jitter)
            if args.stall_prob and rng.random() < args.stall_prob:
                jitter += rng.uniform(0.0, args.stall_max)
            time.sleep(args.step_sleep * jitter)
        x, y = corpus.batch(step, run.rank, run.world_size, args.global_batch, args.seq, args.seed)
        # Summed over this rank's samples and scaled so that DDP's mean over ranks is the mean
        # over the global batch, however many ranks share it.
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum")
        (loss * run.world_size / (args.global_batch * args.seq)).backward()
        mean = loss.detach() / y.numel()
        run.log(loss=mean, data=zlib.crc32(array.array("q", x.flatten().tolist()).tobytes()))
        if run.rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean.item():.3f}", flush=True)

    run.train(train_step, steps=args.steps, build=build)
    if args.final_state and run.rank == 0:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, args.final_state)
    run.close()


if __name__ == "__main__":
    main()
