"""The checks `gpu_check.py` runs, one per child process (its docstring says what each
shows). Each takes `dry` (CPU tensors and gloo: the code up to its first CUDA-only call)
and returns its result: `{"result": "pass"|"fail"|"skipped", "why": one line, ...figures}`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

MiB = 1 << 20


@dataclass(frozen=True)
class Check:
    fn: Callable[[bool], dict]
    timeout: int
    """Seconds its child process may take (the whole script fits in 5 minutes)."""


def _device(dry: bool) -> str:
    if dry:
        return "cpu"
    torch.cuda.set_device(0)
    return "cuda"


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))


def _sync(dry: bool) -> None:
    if not dry:
        torch.cuda.synchronize()


def _result(ok: bool, why_pass: str, why_fail: str, **figures) -> dict:
    return {"result": "pass" if ok else "fail", "why": why_pass if ok else why_fail, **figures}


def _dry(exercised: str, **figures) -> dict:
    return {"result": "pass", "why": f"dry run: {exercised} (nothing about CUDA)", **figures}


def _skipped(why: str) -> dict:
    return {"result": "skipped", "why": why}


def abort_queued(dry: bool) -> dict:
    """A: the watchdog's abort (flag, then `interrupt`) while an all-reduce is queued
    behind ~1 s of GPU work; the fence must refuse the update behind it."""
    from unbroken.errors import UpdateRefused, classify, current_device, first_line
    from unbroken.runtime.generations.fence import Fence
    from unbroken.runtime.groups.process_group import AbortableGroups, nccl_errors
    from unbroken.runtime.position import Position
    from unbroken.runtime.tracked import TrackedState

    dev = _device(dry)
    groups = AbortableGroups()
    groups.form(dist.PrefixStore("a/", _store()), 0, 1, "gloo" if dry else "nccl", 30, 60)
    model = torch.nn.Linear(1024, 1024, device=dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    aborted = threading.Event()
    tracked = TrackedState(model, [optimizer], {})
    tracked.fence = Fence(lambda: Position(rank=0, world_size=1, step=0), lambda gen: aborted.is_set(),
                          nccl_errors)
    model(torch.ones(8, 1024, device=dev)).sum().backward()
    if not dry:
        torch.cuda._sleep(int(2e9))  # about a second of GPU time ahead of the all-reduce
    dist.all_reduce(model.weight.grad, async_op=True).wait()  # orders the stream, not the CPU

    def watchdog() -> None:
        aborted.set()  # before the interrupt, as runtime/generations/watchdog.py does
        groups.interrupt()

    t0 = time.monotonic()
    thread = threading.Thread(target=watchdog)
    thread.start()
    thread.join(30)
    abort_s = round(time.monotonic() - t0, 3)
    sync_error = None
    try:
        _sync(dry)
    except Exception as exc:  # noqa: BLE001 - what the sync does is the finding
        sync_error = first_line(exc)
    errors = nccl_errors()
    before = model.weight.detach().clone()
    try:
        with tracked.updating():
            optimizer.step()
        refused = False
    except UpdateRefused:
        refused = True
    unchanged = torch.equal(before, model.weight.detach())
    next_class = None
    try:
        dist.all_reduce(torch.ones(4, device=dev))
        _sync(dry)
    except Exception as exc:  # noqa: BLE001
        next_class = classify(exc, current_device()).value
    groups.abort()
    figures = {"abort_s": abort_s, "sync_raised": sync_error, "get_error_after": errors,
               "fence_refused": refused, "state_whole": tracked.whole and unchanged,
               "next_collective": next_class}
    if dry:
        return _dry("formed, all-reduce queued, aborted from a thread, the fence refused",
                    **figures) if refused else _result(False, "", "the fence let the update by",
                                                       **figures)
    ok = not thread.is_alive() and abort_s < 5 and refused and next_class == "peer"
    return _result(ok, f"aborted in {abort_s} s; sync raised: {sync_error}; get_error: "
                   f"{errors}; the fence refused; next collective: peer",
                   f"abort {abort_s} s (thread alive: {thread.is_alive()}), refused {refused}, "
                   f"next collective {next_class}", **figures)


def planned_switch_drain(dry: bool) -> dict:
    """J: a planned switch's leave (`drain_device`, then the abort) with an all-reduce
    queued behind ~1 s of GPU work: the drain waits for it, so the abort finds nothing in
    flight and the all-reduce's result is whole."""
    from unbroken.runtime.groups.process_group import AbortableGroups, drain_device

    dev = _device(dry)
    groups = AbortableGroups()
    groups.form(dist.PrefixStore("j/", _store()), 0, 1, "gloo" if dry else "nccl", 30, 60)
    x = torch.full((1 << 20,), 3.0, device=dev)
    if not dry:
        torch.cuda._sleep(int(2e9))
    dist.all_reduce(x, async_op=True).wait()
    t0 = time.monotonic()
    drained = drain_device(10.0)
    waited = round(time.monotonic() - t0, 3)
    groups.abort()
    whole = bool((x == 3.0).all().item())
    if dry:
        return _dry("queued, drained (nothing on a CPU: None), aborted", drained=drained) \
            if drained is None and whole else _result(False, "", f"drained {drained}, whole {whole}")
    return _result(drained is True and whole, f"drained in {waited} s, the all-reduce whole",
                   f"drained {drained} after {waited} s, result whole {whole}",
                   drained=drained, waited_s=waited)


def two_groups_aborted(dry: bool) -> dict:
    """K: two NCCL groups (the default one and another, as HSDP has), each with an
    all-reduce queued behind GPU work, aborted together by `interrupt` (each in a thread of
    its own, bounded): how long it takes, and whether each group's next collective fails."""
    from unbroken.errors import classify, current_device
    from unbroken.runtime.groups.process_group import ABORT_BOUND, AbortableGroups

    dev = _device(dry)
    backend = "gloo" if dry else "nccl"
    groups = AbortableGroups()
    groups.form(dist.PrefixStore("k/", _store()), 0, 1, backend, 30, 60)
    other = dist.new_group(backend=backend, **({} if dry else {"device_id": torch.device("cuda", 0)}))
    if not dry:
        torch.cuda._sleep(int(2e9))
    for group in (None, other):
        dist.all_reduce(torch.ones(1 << 20, device=dev), group=group, async_op=True)
    t0 = time.monotonic()
    groups.interrupt()
    took = round(time.monotonic() - t0, 3)
    after = []
    for group in (None, other):
        try:
            dist.all_reduce(torch.ones(4, device=dev), group=group)
            _sync(dry)
            after.append("no error")
        except Exception as exc:  # noqa: BLE001
            after.append(classify(exc, current_device()).value)
    groups.abort()
    if dry:
        return _dry("two groups formed, interrupted together", took_s=took, after=after)
    ok = took < ABORT_BOUND and after == ["peer", "peer"]
    return _result(ok, f"both aborted in {took} s; next collectives: {after}",
                   f"interrupt took {took} s (bound {ABORT_BOUND}); next collectives {after}",
                   took_s=took, after=after)


def stale_dump_key(dry: bool) -> dict:
    """B: torch's heartbeat monitor at 5 s over a store holding `exception_dump` (no one
    clears it): the in-place environment keeps the process alive for 30 s."""
    os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = "5"
    from unbroken.runtime.groups.process_group import AbortableGroups

    dev = _device(dry)
    store = _store()
    store.set("exception_dump", struct.pack("i", 7))
    groups = AbortableGroups()
    groups.form(dist.PrefixStore("unbroken/r/a/0/g/1/pg/", store), 0, 1,
                "gloo" if dry else "nccl", 30, 60)
    dist.all_reduce(torch.ones(4, device=dev))
    _sync(dry)
    settings = {k: os.environ.get(k) for k in ("TORCH_NCCL_ENABLE_MONITORING",
                                               "TORCH_NCCL_DUMP_ON_TIMEOUT")}
    if dry:
        groups.destroy()
        return _skipped("dry run: the store and group made; the monitor is NCCL's")
    time.sleep(30)  # a SIGABRT here is a crash: the runner records `fail`
    groups.destroy()
    return _result(True, f"survived 30 s with the key set and {settings}", "", **settings)


def _sample(dry: bool) -> dict:
    statm = Path("/proc/self/statm").read_text().split()
    out = {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
           "rss_mib": round(int(statm[1]) * os.sysconf("SC_PAGE_SIZE") / MiB, 1)}
    if not dry:
        free, _ = torch.cuda.mem_get_info()
        out.update(allocated_mib=round(torch.cuda.memory_allocated() / MiB, 1),
                   reserved_mib=round(torch.cuda.memory_reserved() / MiB, 1),
                   free_mib=round(free / MiB, 1))
    return out


def churn(dry: bool) -> dict:
    """C: generations formed, stepped, aborted and torn down; what each leaves behind."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unbroken.runtime.generations.release import release
    from unbroken.runtime.groups.process_group import AbortableGroups

    dev = _device(dry)
    store, groups = _store(), AbortableGroups()
    model = torch.nn.Linear(512, 512, device=dev)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 512, device=dev)
    rounds = []
    for gen in range(3 if dry else 10):
        groups.form(dist.PrefixStore(f"c{gen}/", store), 0, 1, "gloo" if dry else "nccl", 30, 60)
        ddp = DDP(model, device_ids=None if dry else [0])
        for _ in range(2):
            ddp(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync(dry)
        groups.interrupt()
        groups.abort()
        del ddp
        release()  # what a leaving worker does before the next generation is built
        rounds.append(_sample(dry))
    first, last = rounds[1], rounds[-1]
    grew = {k: round(last[k] - first[k], 1) for k in first}
    if dry:
        return _dry(f"{len(rounds)} generations formed, stepped, aborted", growth=grew)
    ok = grew["threads"] <= 2 and grew["fds"] <= 4 and grew["allocated_mib"] <= 1
    return _result(ok, f"flat from generation 1 to 9: {grew}", f"grew from generation 1 to 9: "
                   f"{grew}", rounds=rounds)


def backend_strings(dry: bool) -> dict:
    """D: each form of `init_process_group` that makes NCCL communicators holds NCCL, and
    `interrupt` makes its next collective fail as a peer error."""
    from unbroken.errors import classify, current_device
    from unbroken.runtime.groups.process_group import (
        bound_device,
        holds_nccl,
        nccl_backed,
        this_process,
    )

    dev = _device(dry)
    store, seen = _store(), {}
    for i, backend in enumerate([None, "gloo"] if dry else [None, "cpu:gloo,cuda:nccl", "nccl"]):
        dist.init_process_group(backend, store=dist.PrefixStore(f"d{i}/", store), rank=0,
                                world_size=1, **bound_device(backend))
        dist.all_reduce(torch.ones(4, device=dev))
        group = dist.distributed_c10d._get_default_group()
        entry = {"backend": dist.get_backend(), "nccl_backed": nccl_backed(backend, not dry),
                 "holds_nccl": holds_nccl(group)}
        this_process().interrupt()
        try:
            dist.all_reduce(torch.ones(4, device=dev))
            _sync(dry)
            entry["after_interrupt"] = "no error"
        except Exception as exc:  # noqa: BLE001
            entry["after_interrupt"] = classify(exc, current_device()).value
        dist.destroy_process_group()
        seen[str(backend)] = entry
    if dry:
        ok = not any(e["holds_nccl"] for e in seen.values())
        return _dry("each form made, interrupted, torn down", forms=seen) if ok else \
            _result(False, "", "a CPU group said it holds NCCL", forms=seen)
    ok = all(e["holds_nccl"] and e["after_interrupt"] == "peer" for e in seen.values())
    return _result(ok, "every form holds NCCL and is interrupted", f"{seen}", forms=seen)


def pinned_footprint(dry: bool) -> dict:
    """E: the checkpoint staging's pinned host bytes against the tensors' bytes, for tensors
    of odd sizes (2^k + 1 bytes: a power-of-two allocator would pin twice as much)."""
    from unbroken.checkpoint.host_buffer import ALIGN
    from unbroken.checkpoint.staging import StagingArea

    dev = _device(dry)
    state = {f"t{k}": torch.ones(2 ** k + 1, dtype=torch.uint8, device=dev) for k in range(12, 27)}
    nbytes = sum(t.numel() for t in state.values())
    area = StagingArea()
    t0 = time.perf_counter()
    staged = area.stage(state, late=lambda t: False)
    first_s = round(time.perf_counter() - t0, 3)
    same = all(torch.equal(staged.state[k].to(dev), v) for k, v in state.items())
    exact = area.host_bytes <= nbytes + ALIGN * len(state)
    if dry:
        return _dry("staged every tensor into one buffer of exact size, equal",
                    first_stage_s=first_s, nbytes=nbytes, host_bytes=area.host_bytes) \
            if same and exact else _result(False, "", f"equal {same}, exact size {exact}")
    pinned = area.pinned_bytes
    cached = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    ratio = round(pinned / nbytes, 4)
    area.close()
    ok = same and exact and pinned == area_bytes(staged) and ratio <= 1.01 and cached == 0
    return _result(ok, f"pinned {ratio}x the state, registered (none in torch's cache)",
                   f"pinned {pinned} bytes for {nbytes} ({ratio}x), {cached} in torch's "
                   f"caching host allocator, equal {same}", pinned=pinned, nbytes=nbytes,
                   cached_pinned=cached, first_stage_s=first_s)


def area_bytes(staged) -> int:
    """The bytes a staged copy's buffer spans: its tensors, each aligned."""
    from unbroken.checkpoint.host_buffer import Layout

    return Layout.of(list(staged.state.values())).total


def exchange_ring(dry: bool) -> dict:
    """M: a snapshot round's sends staged through the pinned chunk ring: an odd-sized device
    shard of 256 MiB streamed to a host receiver, host memory (RSS) during it against the
    ring's bytes (the old way copied the whole shard to the host first: +256 MiB), the
    bytes equal. One GPU has no buddy on another rank: the sends are played by a copy into
    the receiver's buffer (gloo's part is the CPU tests'; gpu_multi.py runs rounds)."""
    from unbroken.runtime.generations.state_sync import byte_view
    from unbroken.runtime.sharded.chunk_ring import ChunkRing
    from unbroken.runtime.sharded.host_copy import CHUNK, RING_SLOTS, chunks

    dev = _device(dry)
    size = (40 if dry else 256) * MiB + 12345
    shard = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
    received = torch.empty(size, dtype=torch.uint8)
    ring = ChunkRing(RING_SLOTS, CHUNK, pin=not dry)
    ready = None if dry else torch.cuda.Event()
    if ready is not None:
        ready.record()
    pos, peak = [0], [0.0]
    before = _sample(dry)["rss_mib"]

    class Done:
        def wait(self) -> None:
            pass

    def post(host: torch.Tensor, i: int) -> list:
        n = host.numel()
        received[pos[0]:pos[0] + n].copy_(host)
        pos[0] += n
        if i % 8 == 0:
            peak[0] = max(peak[0], _sample(dry)["rss_mib"] - before)
        return [Done()]

    t0 = time.perf_counter()
    for w in ring.send(chunks([byte_view(shard)]), post, ready):
        w.wait()
    seconds = time.perf_counter() - t0
    same = torch.equal(received, shard.cpu())
    pinned = ring.pinned_bytes
    ring.close()
    figures = {"shard_mib": round(size / MiB, 1), "ring_mib": ring.host_bytes / MiB,
               "rss_growth_mib": round(peak[0], 1), "gb_per_s": round(size / seconds / 1e9, 2)}
    if dry:
        return _dry(f"{ring.copies} chunks through {RING_SLOTS} slots, equal", **figures) \
            if same else _result(False, "", "the bytes received differ from those sent")
    ok = same and pinned == ring.host_bytes and peak[0] <= ring.host_bytes / MiB + 64
    return _result(ok, f"host memory during the stream within the ring's {figures['ring_mib']}"
                   " MiB (+64 MiB slack), the bytes equal",
                   f"equal {same}, pinned {pinned}, RSS grew {peak[0]:.0f} MiB", **figures)


def state_sync_on_device(dry: bool) -> dict:
    """F: `send_tensors`/`recv_bytes` through a device chunk. One GPU cannot carry it: torch
    refuses point-to-point to self, NCCL two ranks on one device. The dry run streams a
    state through the chunking, the point-to-point calls routed in-process."""
    from unbroken.runtime.generations import state_sync

    if not dry:
        return _skipped("torch refuses send/recv to self and NCCL two ranks on one GPU: "
                        "gpu_multi.py on 2 GPUs")
    sent: list[torch.Tensor] = []
    real_send, real_recv = dist.send, dist.recv
    dist.send = lambda tensor, dst, group=None: sent.append(tensor.clone())
    dist.recv = lambda tensor, src, group=None: tensor.copy_(sent.pop(0))
    try:
        tensors = [torch.randn(1000), torch.arange(777, dtype=torch.int64)]
        total = sum(t.numel() * t.element_size() for t in tensors)
        state_sync.send_tensors(tensors, total, 1, None, torch.device("cpu"), chunk=1000)
        got = state_sync.recv_bytes(total, 0, None, torch.device("cpu"), chunk=1000)
    finally:
        dist.send, dist.recv = real_send, real_recv
    want = torch.cat([state_sync.byte_view(t) for t in tensors])
    return _dry(f"{total} bytes in 1000-byte chunks, equal") if torch.equal(got, want) else \
        _result(False, "", "the bytes received differ from those sent")


def fsdp_abort_mid_step(dry: bool) -> dict:
    """G: FSDP2 on a world of one, a fault inside a forward (parameters unsharded), then
    the recovery's own steps: reset, tear down, form again, a new mesh, rebind, a step."""
    from torch.distributed.fsdp import fully_shard

    from unbroken.runtime.generations.release import forget_frames, release
    from unbroken.runtime.groups.process_group import AbortableGroups
    from unbroken.runtime.sharded.shards import LocalShards, new_mesh

    dev = _device(dry)
    store, groups = _store(), AbortableGroups()
    backend = "gloo" if dry else "nccl"
    groups.form(dist.PrefixStore("g0/", store), 0, 1, backend, 30, 60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    for layer in model:
        fully_shard(layer, mesh=new_mesh_for(dev))
    fully_shard(model, mesh=new_mesh_for(dev))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 1024, device=dev)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(dry)
    level = 0 if dry else torch.cuda.memory_allocated()

    def fault(*_):
        raise RuntimeError("a peer's fault, mid-forward")

    hook = model[2].register_forward_pre_hook(fault)
    failed = None
    try:
        model(x)
    except RuntimeError as exc:
        failed = exc  # held while the recovery runs, as the engine's handler holds it
    hook.remove()
    shards = LocalShards(model, [optimizer], {})
    if (why := shards.unresettable()) is not None:  # in place is off for FSDP2 on this torch
        groups.destroy()
        return _skipped(f"{why} (in-place recovery of FSDP2 is turned off on it)")
    shards.reset_iteration()
    optimizer.zero_grad(set_to_none=True)
    groups.interrupt()
    groups.abort()
    groups.form(dist.PrefixStore("g1/", store), 0, 1, backend, 30, 60)
    shards.rebind(new_mesh(shards.shape))
    forget_frames(failed)  # what a leaving worker does before the next generation is built
    release()
    _sync(dry)
    after = 0 if dry else torch.cuda.memory_allocated()
    model(x).sum().backward()
    optimizer.step()
    _sync(dry)
    groups.destroy()
    if dry:
        return _dry("faulted mid-forward, reset, re-formed, rebound, stepped")
    grew = after - level
    return _result(grew <= MiB, f"device memory back to the pre-step level (+{grew} bytes)",
                   f"device memory {grew} bytes above the pre-step level after the recovery",
                   grew_bytes=grew)


def new_mesh_for(dev: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dev, (1,))


def environment_facts(dry: bool) -> dict:
    """H: what this torch does with NCCL: the backend's class, NCCL's version, our
    settings as the process has them."""
    if dry:
        return _skipped("dry run: the facts are NCCL's")
    from unbroken.runtime.groups.process_group import AbortableGroups

    _device(dry)
    groups = AbortableGroups()
    groups.form(dist.PrefixStore("h/", _store()), 0, 1, "nccl", 30, 60)
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    facts = {"backend_class": type(backend).__name__,
             "nccl": ".".join(map(str, torch.cuda.nccl.version())),
             "get_error": hasattr(backend, "get_error"),
             "env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL_",
                                                                          "TORCH_DIST"))}}
    groups.destroy()
    return _result(True, f"{facts['backend_class']}, NCCL {facts['nccl']}", "", **facts)


def fence_cost(dry: bool) -> dict:
    """I: a bf16 GPT-size model with fused AdamW, 50 steps with and without the fence
    (the stream drained and the flags read before the update); median step times."""
    if dry:
        return _skipped("dry run: the fence's cost is a GPU's")
    from unbroken.runtime.generations.fence import Fence
    from unbroken.runtime.groups.process_group import nccl_errors
    from unbroken.runtime.position import Position

    dev = _device(dry)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(*[layer.__class__(1024, 16, 4096, batch_first=True,
                                                  norm_first=True) for _ in range(12)])
    model = model.to(dev, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(8, 512, 1024, device=dev, dtype=torch.bfloat16)
    step = [0]
    fence = Fence(lambda: Position(rank=0, world_size=1, step=step[0]), lambda gen: False,
                  nccl_errors)

    def one(fenced: bool) -> float:
        t0 = time.perf_counter()
        model(x).float().square().mean().backward()
        if fenced:
            fence()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step[0] += 1
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(5):
        one(False)
    plain = [one(False) for _ in range(50)]
    fenced = [one(True) for _ in range(50)]
    a, b = statistics.median(plain), statistics.median(fenced)
    cost = round((b - a) / a * 100, 2)
    return _result(True, f"median {a * 1e3:.2f} ms without, {b * 1e3:.2f} ms with the fence "
                   f"({cost:+.2f} %)", "", plain_ms=round(a * 1e3, 3), fenced_ms=round(b * 1e3, 3),
                   cost_percent=cost, waits=fence.waits)


def checkpoints_at_commit(dry: bool) -> dict:
    """1: async checkpoints due at each of 6 steps of a model whose device-to-host copy
    outlasts a step (a save still running is passed over); every checkpoint written equals
    the clone taken when its step committed, and at least two are compared."""
    import unbroken

    dev = _device(dry)
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"unbroken-gpu-check-{os.getpid()}"
    torch.manual_seed(0)
    width = 256 if dry else 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = unbroken.init(checkpoint_dir=root / "ckpt", checkpoint_every=1, keep_checkpoints=6,
                        backend="gloo")
    run.track(model, optimizer)
    clones = {}
    for step in run.steps(6):
        model(torch.randn(32, width, device=dev)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        clones[step + 1] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if dry:
            time.sleep(0.3)  # CPU steps are short: let some saves finish between them
    run.close()
    from torch.distributed.checkpoint import load

    from unbroken.checkpoint.layout import committed_checkpoints
    from unbroken.checkpoint.safe_reader import SafeFileSystemReader

    differ, compared = [], []
    for step, folder in sorted(committed_checkpoints(root / "ckpt")):
        clone = clones[step]
        saved = {"model": {k: torch.empty_like(v) for k, v in clone.items()}}
        load(saved, storage_reader=SafeFileSystemReader(folder), no_dist=True)
        compared.append(step)
        if any(not torch.equal(saved["model"][k], clone[k]) for k in clone):
            differ.append(step)
    shutil.rmtree(root, ignore_errors=True)
    figures = {"compared": compared, "differ": differ}
    ok = len(compared) >= 2 and not differ
    if dry and ok:
        return _dry(f"checkpoints of steps {compared} equal their commit's clones", **figures)
    return _result(ok, f"checkpoints of steps {compared} equal their commit's clones",
                   f"compared {compared}, differ {differ}", **figures)


def device_error_is_own(dry: bool) -> dict:
    """4: a device-side assert is this worker's own device error (`errors.classify`)."""
    if dry:
        return _skipped("dry run: a device-side assert is CUDA's")
    from unbroken.errors import classify, current_device

    _device(dry)
    try:
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([10], device="cuda")] = 1.0
        torch.cuda.synchronize()
        return _result(False, "", "no error was raised")
    except Exception as exc:  # noqa: BLE001
        kind = classify(exc, current_device()).value
        return _result(kind == "own_device", f"{type(exc).__name__}: own_device",
                       f"{type(exc).__name__} classified {kind}")


def checksum_on_device(dry: bool) -> dict:
    """6: the replica checksum computed on the device equals the CPU's; its time per GB."""
    from unbroken.runtime.anomalies.checksum import checksum, state_tensors

    dev = _device(dry)
    torch.manual_seed(0)
    width = 256 if dry else 2048
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(64, width, device=dev)).square().mean().backward()
    optimizer.step()
    tensors = state_tensors(model, [optimizer])
    gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    same = checksum(tensors) == checksum([t.cpu() for t in tensors])
    _sync(dry)
    t0 = time.perf_counter()
    for _ in range(5):
        checksum(tensors)
    ms = (time.perf_counter() - t0) / 5 * 1e3
    figures = {"ms_per_gb": round(ms / gb, 2), "gb": round(gb, 3)}
    if dry:
        return _dry("checksums compared", **figures) if same else \
            _result(False, "", "the checksums differ")
    return _result(same, f"equal; {ms / gb:.1f} ms per GB", "device and CPU checksums differ",
                   **figures)


def fork_then_cuda(dry: bool) -> dict:
    """L: a worker forked from a fork server that pre-imported torch and the real preimport
    list (transformers, accelerate) initialises CUDA, forms an NCCL world of one and steps
    (`gpu_fork_probe.py`, under `unbroken run`: attempt 1 is forked after attempt 0's list)."""
    import tempfile

    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="gpu-fork-") as name:  # nothing left behind
        return _forked(here, Path(name), dry)


def _forked(here: Path, tmp: Path, dry: bool) -> dict:
    import math
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node", "1",
           "--max-restarts", "1", "--on-fault", "restart", "--run-dir", str(tmp / "run"), str(here / "gpu_fork_probe.py"),
           str(tmp), *(["--dry-run"] if dry else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp)
    found = tmp / "attempt1.json"
    if proc.returncode != 0 or not found.exists():
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
        return _result(False, "", f"unbroken run exited {proc.returncode}: {tail}")
    got = json.loads(found.read_text())
    forked = got["before"]["torch"] and all(got["before"][m] for m in got["libraries"])
    ok = forked and math.isfinite(got["loss"]) and (dry or got["backend"].startswith("ProcessGroupNCCL"))
    what = (f"forked with torch and {', '.join(got['libraries']) or 'no library'} imported; "
            f"{got['backend']} world of one stepped in {got['seconds']} s")
    if dry and ok:
        return _dry(what, **got)
    return _result(ok, what, f"not so: {got}", **got)


CHECKS = {
    "A_abort_queued": Check(abort_queued, 60),
    "B_stale_dump_key": Check(stale_dump_key, 75),
    "C_churn": Check(churn, 90),
    "D_backend_strings": Check(backend_strings, 45),
    "E_pinned_footprint": Check(pinned_footprint, 30),
    "F_state_sync_on_device": Check(state_sync_on_device, 30),
    "G_fsdp_abort_mid_step": Check(fsdp_abort_mid_step, 60),
    "H_environment": Check(environment_facts, 30),
    "I_fence_cost": Check(fence_cost, 60),
    "J_planned_switch_drain": Check(planned_switch_drain, 30),
    "K_two_groups_aborted": Check(two_groups_aborted, 45),
    "1_checkpoints_at_commit": Check(checkpoints_at_commit, 60),
    "4_device_error": Check(device_error_is_own, 30),
    "6_checksum": Check(checksum_on_device, 30),
    "L_fork_then_cuda": Check(fork_then_cuda, 180),
    "M_exchange_ring": Check(exchange_ring, 60),
}
"""Every check, in the order they run."""


def run_child(key: str, out: Path, dry: bool) -> int:
    """Run `key`'s check here and append its line to `out`; exit 0 whatever it found (a
    failed check is a result, a crash is the runner's to record). A check still running 3 s
    before its timeout writes every thread's stack to `stacks_file(out, key)` and exits: a
    hang says where it hung."""
    import faulthandler

    stacks = stacks_file(out, key).open("w")
    faulthandler.dump_traceback_later(max(1, CHECKS[key].timeout - 3), exit=True, file=stacks)
    line = {"check": key, **CHECKS[key].fn(dry)}
    faulthandler.cancel_dump_traceback_later()
    stacks.close()
    stacks_file(out, key).unlink()  # it ended: nothing to say where it hung
    with out.open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    return 0


def stacks_file(out: Path, key: str) -> Path:
    """Where `key`'s child writes its threads' stacks if it hangs."""
    return out.with_name(f"{out.stem}.{key}.stacks.txt")
