"""What one GPU can check of the CUDA and NCCL paths, for when a GPU is lent (the `device`
tool). Each check prints PASS or FAIL with its figures; the exit code is the number of
failures (2 with no CUDA device: nothing was checked).

1. **Checkpoint of CUDA tensors**: a model and AdamW on the GPU, three steps with
   `run.steps()` and an async checkpoint each step; a fresh `Run` loads the newest one, and
   every tensor equals the trained one.
2. **State sync of CUDA tensors**: two processes (gloo transport, the state on the GPU)
   stream a CUDA model's state through `send_tensors`/`recv_bytes` in 1 MiB chunks; the
   receiver's state equals the sender's. (NCCL refuses two ranks on one GPU, so the
   transport here is gloo; the NCCL transport needs two GPUs.)
3. **An NCCL world of size 1** (`AbortableGroups.form`, bound to the device): created, an
   all-reduce, aborted from another thread (`interrupt`, as the watchdog does), torn down,
   created again under a new prefix, and an all-reduce again.
4. **A device error is the worker's own**: a device-side assert in a subprocess raises,
   and `errors.classify` says `own_device`.
5. **One host copy of CUDA shards** (issue 26): FSDP2 over a world of one on the GPU; a
   snapshot round copies the shards into the rank's host buffer (on the CPU), the device's
   peak memory does not grow across the round (no device memory held for snapshots), and a
   rollback two steps later restores every tensor exactly.
6. **The replica checksum on the device** (issue 27): the integer checksum of a model's
   parameters and AdamW state computed on the GPU equals the one computed on a CPU copy
   (integer sums do not depend on the reduction order), its time per GB of state, and
   whether a step rerun on the same data gives bit-identical gradients with and without
   `torch.use_deterministic_algorithms` (a rerun's classification compares bitwise unless
   `rerun_rtol` is given).

    .venv/bin/python benchmarks/gpu_check.py
    .venv/bin/python benchmarks/gpu_check.py --dry-run   # checks 1, 2, 5 and 6 on CPU tensors

`--dry-run` runs checks 1, 2, 5 and 6 with CPU tensors, so that the script itself is tested
on a machine without a GPU; it proves nothing about CUDA.
"""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from harness import REPO, launch, temp_root, wait_or_kill

sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []
DEVICE = "cuda"  # "cpu" with --dry-run


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def _model(device: str | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """On `device` (a spawned process passes it: DEVICE is the parent's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 16)).to(device or DEVICE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def checkpoint_of_cuda_tensors(root: Path) -> None:
    import unbroken

    model, optimizer = _model()
    run = unbroken.init(checkpoint_dir=root / "ckpt", checkpoint_every=1, backend="gloo")
    run.track(model, optimizer)
    for _ in run.steps(3):
        model(torch.randn(32, 256, device=DEVICE)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    run.close()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _model()
    again = unbroken.init(checkpoint_dir=root / "ckpt", checkpoint_every=1, backend="gloo")
    again.track(fresh, fresh_opt)
    list(again.steps(3))  # loads the newest checkpoint, and has nothing left to run
    again.close()
    same = all(torch.equal(trained[k], v) for k, v in fresh.state_dict().items())
    placed = all(v.device.type == DEVICE for v in fresh.state_dict().values())
    check("checkpoint of CUDA tensors", again.step == 3 and same and placed,
          f"resumed at step {again.step}, equal {same}, on {DEVICE} {placed}")


def _sync_side(rank: int, store: str, out: str, device: str) -> None:
    global DEVICE
    DEVICE = device
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from unbroken.runtime.state_sync import pack, recv_bytes, send_tensors, unpack

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    model, optimizer = _model()
    if rank == 0:  # the holder: a trained state
        model(torch.randn(8, 256, device=DEVICE)).sum().backward()
        optimizer.step()
    model_sd, optim_sd = get_state_dict(model, [optimizer])
    header, tensors = pack({"model": model_sd, "optim": optim_sd})
    total = sum(t.numel() * t.element_size() for t in tensors)
    sizes = torch.tensor([total])
    dist.broadcast(sizes, src=0)
    if rank == 0:
        send_tensors(tensors, total, 1, None, torch.device("cpu"), chunk=1 << 20)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out + ".sent")
    else:
        got = unpack(header, recv_bytes(int(sizes[0]), 0, None, torch.device("cpu"),
                                        chunk=1 << 20))
        set_state_dict(model, [optimizer], model_state_dict=got["model"],
                       optim_state_dict=got["optim"])
        dist.barrier()
        sent = torch.load(out + ".sent", weights_only=True)
        same = all(torch.equal(sent[k], v.cpu()) and v.device.type == DEVICE
                   for k, v in model.state_dict().items())
        Path(out).write_text(f"{same} {int(sizes[0])}")
    if rank == 0:
        dist.barrier()
    dist.destroy_process_group()


def state_sync_of_cuda_tensors(root: Path) -> None:
    out = str(root / "sync.txt")
    mp.spawn(_sync_side, args=(str(root / "store"), out, DEVICE), nprocs=2, join=True)
    same, nbytes = Path(out).read_text().split()
    check("state sync of CUDA tensors", same == "True", f"{int(nbytes)} bytes, equal {same}")


def nccl_world_of_one(_: Path) -> None:
    from unbroken.runtime.process_group import AbortableGroups

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    groups = AbortableGroups()
    t0 = time.monotonic()
    groups.form(dist.PrefixStore("g1/", store), 0, 1, "nccl", 30, 60)
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    formed = time.monotonic() - t0
    aborter = threading.Thread(target=groups.interrupt)  # as the watchdog thread does
    aborter.start()
    aborter.join(timeout=30)
    t1 = time.monotonic()
    groups.abort()
    torn = time.monotonic() - t1
    t2 = time.monotonic()
    groups.form(dist.PrefixStore("g2/", store), 0, 1, "nccl", 30, 60)
    y = torch.full((1024,), 2.0, device="cuda")
    dist.all_reduce(y)
    torch.cuda.synchronize()
    again = time.monotonic() - t2
    groups.destroy()
    check("NCCL world of one: create, abort, re-create", bool(y[0].item() == 2.0)
          and not aborter.is_alive(),
          f"formed {formed:.2f}s, torn down {torn:.2f}s, re-formed {again:.2f}s")


def _host_copy_side(rank: int, out: str, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unbroken.runtime.shards import LocalShards
    from unbroken.runtime.snapshots import PeerSnapshots

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    model, optimizer = _model(device)
    fully_shard(model, mesh=init_device_mesh(device, (1,)))

    def step() -> None:
        model(torch.randn(8, 256, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    shards = LocalShards(model, [optimizer], {})
    at_3 = [t.detach().cpu().clone() for t in shards.tensors()]
    snaps = PeerSnapshots(shards, replicas=1, every=1, record=lambda *a, **k: None)
    snaps.use_group(dist.new_group(backend="gloo"), 0, 1, 1)

    def peak(body) -> int:  # noqa: ANN001 - the device memory a step's peak adds
        if not cuda:
            body()
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated()
        body()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    snaps.take(3)
    with_round = peak(lambda: (step(), snaps.wait()))  # the round beside step 4
    plain = peak(step)  # step 5, no round
    grew = max(0, with_round - plain)
    back = snaps.rollback()
    same = back == 3 and snaps.own.buf.device.type == "cpu" and all(
        torch.equal(a, b.detach().cpu()) for a, b in zip(at_3, shards.tensors(), strict=True))
    Path(out).write_text(f"{same} {grew} {shards.nbytes()}")
    dist.destroy_process_group()


def host_copy_of_cuda_shards(root: Path) -> None:
    out = str(root / "host_copy.txt")
    mp.spawn(_host_copy_side, args=(out, DEVICE), nprocs=1, join=True)
    same, grew, nbytes = Path(out).read_text().split()
    check("one host copy of CUDA shards", same == "True" and int(grew) < int(nbytes) // 10,
          f"{int(nbytes)} bytes of shards, rollback exact: {same}, a step with a round "
          f"peaked {int(grew)} bytes of device memory above one without")


_DEVICE_ERROR = """
import torch
from unbroken.errors import classify, current_device
torch.cuda.set_device(0)
try:
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([10], device="cuda")] = 1.0
    torch.cuda.synchronize()
    print("RESULT no error")
except Exception as exc:
    print("RESULT", type(exc).__name__, classify(exc, current_device()).value)
"""


def device_error_is_own(root: Path) -> None:
    run_dir = root / "device-error"  # a process of its own, tracked by the harness
    proc = launch([sys.executable, "-c", _DEVICE_ERROR], run_dir,
                  env={"CUDA_LAUNCH_BLOCKING": "1", "PYTHONPATH": str(REPO / "src")})
    code = wait_or_kill(proc, run_dir, 120)
    output = (run_dir / "launcher.log").read_text(errors="replace").splitlines()
    results = [line.removeprefix("RESULT ") for line in output if line.startswith("RESULT ")]
    last = results[-1] if results else "timed out after 120 s" if code is None else "nothing"
    check("a device-side assert is the worker's own device error", last.endswith("own_device"),
          last)


def checksum_on_the_device(_: Path) -> None:
    from unbroken.runtime.checksum import checksum, state_tensors

    torch.manual_seed(0)
    big = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(DEVICE)
    optim = torch.optim.AdamW(big.parameters(), lr=1e-3)
    x = torch.randn(64, 2048, device=DEVICE)
    big(x).square().mean().backward()
    optim.step()
    tensors = state_tensors(big, [optim])
    gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    on_device = checksum(tensors)
    on_cpu = checksum([t.cpu() for t in tensors])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        checksum(tensors)
    ms = (time.perf_counter() - t0) / 5 * 1e3
    check("the replica checksum on the device equals the CPU's", on_device == on_cpu,
          f"{ms:.2f} ms for {gb:.3f} GB of parameters and AdamW state "
          f"({ms / gb:.1f} ms per GB) on {DEVICE}")

    def grads(deterministic: bool) -> list[torch.Tensor]:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            big.zero_grad(set_to_none=True)
            big(x).square().mean().backward()
            return [p.grad.clone() for p in big.parameters()]
        finally:
            torch.use_deterministic_algorithms(False)

    same = {mode: all(torch.equal(a, b) for a, b in zip(grads(mode), grads(mode), strict=True))
            for mode in (False, True)}
    check("a rerun on the same data is bit-identical in deterministic mode", same[True],
          f"deterministic: {same[True]}, default: {same[False]} (a rerun is compared bitwise "
          "unless rerun_rtol is given)")


def main() -> int:
    global DEVICE
    dry = "--dry-run" in sys.argv[1:]
    checks = [checkpoint_of_cuda_tensors, state_sync_of_cuda_tensors, host_copy_of_cuda_shards,
              checksum_on_the_device]
    if dry:
        DEVICE = "cpu"
        print("dry run: checks 1, 2, 5 and 6 with CPU tensors (nothing about CUDA is shown)")
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing was checked")
        return 2
    else:
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
        checks += [nccl_world_of_one, device_error_is_own]
    # The harness ends the checks' processes (mp.spawn's too) if this script is stopped.
    tmp = temp_root("unbroken-gpu-check-")
    for fn in checks:
        try:
            fn(tmp)
        except Exception as exc:  # a check that raised is a failed check, reported
            check(fn.__name__, False, f"{type(exc).__name__}: {exc}")
    failures = sum(1 for _, ok, _ in RESULTS if not ok)
    print(f"{len(RESULTS) - failures} passed, {failures} failed")
    return failures


if __name__ == "__main__":
    sys.exit(main())
