"""A plain torchrun-style training script with heavy imports: `restart.py --case plain_heavy`.

No unbroken API, as a new user's script would be: it imports a heavy real library
(transformers, when installed: a tiny GPT-2 built from its config; otherwise sympy,
networkx and torch's inductor compiler, with a small MLP), trains with DDP over gloo
(env://, as under torchrun), saves its own checkpoint (rank 0, `torch.save` of the state
dicts to a temporary file, then `os.replace`) every --checkpoint-every steps and resumes
from it at start.

What the benchmark reads, the same under either launcher: each rank writes its pid to
OUT/pid_rank<R> at start; rank 0 appends `{"attempt", "step", "t"}` (t: wall time at the
end of the step) to OUT/steps.jsonl after every step.
"""

from __future__ import annotations

import time

T0 = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

VOCAB, SEQ = 128, 32


def heavy_model() -> tuple[str, torch.nn.Module]:
    """The heavy library's model: what the imports are for."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        import networkx  # noqa: F401
        import sympy  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401

        net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, 64),
                                  torch.nn.Tanh(), torch.nn.Linear(64, VOCAB))
        return "sympy+networkx+torch._inductor", net
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0)
    return "transformers", GPT2LMHeadModel(config)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds each step waits, standing in for accelerator time")
    args = p.parse_args()

    library, model = heavy_model()
    imported = time.time() - T0
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(args.out, f"pid_rank{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = os.path.join(args.out, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DDP(model)
    log = open(os.path.join(args.out, "steps.jsonl"), "a") if rank == 0 else None  # noqa: SIM115
    if log is not None:
        log.write(json.dumps({"attempt": attempt, "library": library, "imports_s": imported,
                              "resumed_from": start}) + "\n")
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        loss_of(ddp, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0 and (step + 1) % args.checkpoint_every == 0:
            tmp = f"{ckpt}.tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
        if log is not None:
            log.write(json.dumps({"attempt": attempt, "step": step, "t": time.time()}) + "\n")
            log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
