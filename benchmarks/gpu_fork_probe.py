"""Check L's worker (`gpu_checks.fork_then_cuda`): a plain torchrun-style script run twice by
`unbroken run --max-restarts 1`, so that its second attempt is forked from a fork server
that has pre-imported what the first imported.

Attempt 0 imports the preimport list (transformers, accelerate: those installed), waits
until the node's fork server says it has caught up with a list that holds them
(`warm_imports` whose `listed` covers the list read), and exits 1.
Attempt 1 notes what was imported before its first line, then initialises CUDA in the
forked child, forms a world of one (NCCL on a GPU, gloo with --dry-run), steps a Linear
with an all-reduce, and writes OUT/attempt1.json.

    python gpu_fork_probe.py OUT [--dry-run]
"""

import sys

_before = {m: m in sys.modules for m in ("torch", "transformers", "accelerate")}

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

out, dry = sys.argv[1], "--dry-run" in sys.argv
LIBRARIES = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m)]

if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    for name in LIBRARIES:
        __import__(name)
    from unbroken.runtime.warm_imports import valid_name

    run_dir = os.environ["UNBROKEN_RUN_DIR"]
    listed = os.path.join(run_dir, f"node_{os.environ['GROUP_RANK']}", "modules.json")
    deadline, wanted = time.monotonic() + 120, None
    while time.monotonic() < deadline:  # listed, then dealt with by the server: 1 is forked
        if wanted is None and os.path.exists(listed):
            with open(listed) as fh:
                names = json.load(fh)["modules"]
            if all(m in names for m in LIBRARIES):  # the server's count of this list
                wanted = len({n for n in names if valid_name(n)})
        elif wanted is not None:
            with open(os.path.join(run_dir, "events.jsonl")) as fh:
                if any('"warm_imports"' in line and line.endswith("\n")
                       and json.loads(line).get("listed", 0) >= wanted for line in fh):
                    break
        time.sleep(0.2)
    sys.exit(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

t0 = time.monotonic()
device = torch.device("cpu") if dry else torch.device("cuda", 0)
if not dry:
    torch.cuda.set_device(device)
    torch.cuda.init()
dist.init_process_group("gloo" if dry else "nccl", device_id=None if dry else device)
model = torch.nn.Linear(64, 64, device=device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 64, device=device)).pow(2).mean()
loss.backward()
for p in model.parameters():
    dist.all_reduce(p.grad)
opt.step()
if not dry:
    torch.cuda.synchronize()
backend = type(dist.distributed_c10d._get_default_group()._get_backend(device)).__name__
dist.destroy_process_group()
with open(os.path.join(out, "attempt1.json"), "w") as fh:
    json.dump({"before": _before, "libraries": LIBRARIES, "backend": backend,
               "loss": float(loss), "seconds": round(time.monotonic() - t0, 3)}, fh)
