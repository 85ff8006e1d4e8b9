"""The hooks: installed once per interpreter, before any library is imported, so that every
later reference to a watched function (`from safetensors.torch import save_file` inside a
library) is to the wrapped one.

`arm()` runs in the fork server before its preimports (its children inherit the hooks) and
in a cold worker before its script (`unbroken.worker`). Until `watcher.start()` in the
worker, and with `--no-integrations`, every hook returns at once. A hook that fails says so
in one line and turns itself off; it never raises into the script.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from types import ModuleType
from typing import Any

from unbroken.import_hooks import when_imported
from unbroken.runtime.watch import watcher
from unbroken.runtime.watch.calls import CALLS, Call

MARK = "_unbroken_watched"
_armed = False
installed: list[str] = []
"""What is watched, for the worker's `script_watched` line."""
failed: list[str] = []
"""Hooks that could not be installed or turned themselves off, each with why."""
_off: set[str] = set()


def arm() -> None:
    """Install every hook, each when its module is imported (idempotent)."""
    global _armed
    if _armed:
        return
    _armed = True
    when_imported("torch", _step_hooks)
    when_imported("torch.amp.grad_scaler", _scaler_hook)
    for call in CALLS:
        when_imported(call.module, functools.partial(_wrap, call=call))


def _give_up(name: str, exc: BaseException) -> None:
    """A hook raised: it is turned off, said once, and the script goes on."""
    if name not in _off:
        _off.add(name)
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"unbroken: stopped watching {name} ({type(exc).__name__}: {exc}); "
              f"the script is not affected", file=sys.stderr)


def _step_hooks(torch: ModuleType) -> None:
    try:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
    except ImportError as exc:
        failed.append(f"optimizer.step: {exc}")
        return

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        watch = watcher._active
        if watch is None or watch.steps_muted or "optimizer.step" in _off:
            return
        try:
            watch.ended(watch.clock.before_update(id(optimizer)))
        except Exception as exc:  # noqa: BLE001
            _give_up("optimizer.step", exc)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        watch = watcher._active
        if watch is None or watch.steps_muted or "optimizer.step" in _off:
            return
        try:
            watch.clock.after_update(id(optimizer), time.time())
        except Exception as exc:  # noqa: BLE001
            _give_up("optimizer.step", exc)

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    installed.append("optimizer.step")
    autograd = torch.autograd
    original = autograd.backward
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        watch = watcher._active
        if watch is not None and not watch.steps_muted and "backward" not in _off:
            try:
                watch.ended(watch.clock.backward(time.time(), _loss(tensors)))
            except Exception as exc:  # noqa: BLE001
                _give_up("backward", exc)
        return original(tensors, *args, **kwargs)

    setattr(backward, MARK, True)
    autograd.backward = backward  # `Tensor.backward` calls `torch.autograd.backward`
    installed.append("backward")


def _loss(tensors: Any) -> float | None:
    """The loss, where reading it costs no device sync: a one-element CPU tensor."""
    t = tensors
    if isinstance(t, list | tuple):
        if len(t) != 1:
            return None
        t = t[0]
    try:
        if t.is_cuda or t.numel() != 1 or t.device.type != "cpu":
            return None
    except AttributeError:  # not a tensor: nothing to read
        return None
    return t.item()


def _scaler_hook(module: ModuleType) -> None:
    scaler = getattr(module, "GradScaler", None)
    original = getattr(scaler, "update", None)
    if original is None or getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        watch = watcher._active
        if watch is not None and not watch.steps_muted and "GradScaler.update" not in _off:
            try:
                watch.ended(watch.clock.scaler_update(time.time()))
            except Exception as exc:  # noqa: BLE001
                _give_up("GradScaler.update", exc)
        return out

    setattr(update, MARK, True)
    scaler.update = update
    installed.append("GradScaler.update")


def _path(call: Call, args: tuple, kwargs: dict) -> str | None:
    value = kwargs.get(call.keyword) if call.keyword else None
    if value is None and call.position is not None and len(args) > call.position:
        value = args[call.position]
    if value is None:  # DCP given a FileSystemWriter or FileSystemReader instead of an id
        storage = kwargs.get("storage_writer") or kwargs.get("storage_reader")
        value = getattr(storage, "path", None)
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    return None


def _ours(depth: int = 2) -> bool:
    """The caller is unbroken's own code (its checkpointer): not the script's save."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return isinstance(name, str) and name.startswith("unbroken.")


def _wrap(module: ModuleType, call: Call) -> None:
    owner: Any = module
    *parents, leaf = call.attribute.split(".")
    try:
        for part in parents:
            owner = getattr(owner, part)
        original = getattr(owner, leaf)
    except AttributeError as exc:  # another release: said, never fatal
        failed.append(f"{call.name}: not found ({exc})")
        return
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def watched(*args: Any, **kwargs: Any) -> Any:
        watch = watcher._active
        if watch is None or call.name in _off or watch.inside_ours():
            return original(*args, **kwargs)
        if _ours():  # unbroken's own save (its checkpoint events say it): nor any inside it
            with watch.ours():
                return original(*args, **kwargs)
        try:
            path = _path(call, args, kwargs)
            outermost = watch.enter(call, path)
        except Exception as exc:  # noqa: BLE001
            _give_up(call.name, exc)
            return original(*args, **kwargs)
        ok = False
        try:
            out = original(*args, **kwargs)
            ok = True
            return out
        finally:
            try:
                watch.leave(ok)
                if ok and outermost and call.returns_future:
                    watch.waits_on(out, call, path, watch.last_step)
            except Exception as exc:  # noqa: BLE001
                _give_up(call.name, exc)

    setattr(watched, MARK, True)
    setattr(owner, leaf, watched)
    installed.append(call.name)
