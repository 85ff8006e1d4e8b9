"""The value parsers of `unbroken run`'s flags (argparse `type=` callables, which raise
`ArgumentTypeError` for a one-line usage error) and the parsers of composite values
(`--nnodes`, `--rdzv-conf`, `--signals-to-handle`), which raise `UserError`."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.errors import UserError

LAST_CALL_DEFAULT = 30.0
"""torchrun's c10d rendezvous: wait this long after MIN nodes joined for more (up to MAX)."""


def positive_int(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value
    return parse


def nproc(text: str) -> int:
    """`--nproc-per-node`: an integer, or auto/cpu/gpu/cuda/xpu as torchrun reads them."""
    if text == "auto":  # as torchrun: one per GPU if there are GPUs, else one per CPU
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"--nproc-per-node {text}: no CUDA device is visible")
        return torch.cuda.device_count()
    if text == "xpu":
        import torch

        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise argparse.ArgumentTypeError("--nproc-per-node xpu: no XPU device is visible")
        return torch.xpu.device_count()
    return positive_int("--nproc-per-node")(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value:g}")
    return value


def seconds_or_zero(text: str) -> float:
    """Seconds, where 0 means "never"."""
    return 0.0 if text.strip() in ("0", "0.0") else seconds(text)


def size_bytes(text: str) -> int:
    """A size in bytes: a number with an optional unit (`64Gi`, `512Mi`, `2G`, `1048576`)."""
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?B?", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 64Gi or 512Mi, got {text!r}")
    unit = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
            "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}[m.group(2)]
    return int(float(m.group(1)) * unit)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, got {value}")
    return value


def comma_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def truthy(text: str) -> bool:
    """torchrun reads a switch's PET_ variable as an integer (PET_NO_PYTHON=1); `true` too."""
    text = text.strip().lower()
    if text in ("true", "yes"):
        return True
    try:
        return bool(int(text or "0"))
    except ValueError:
        return False


@dataclass(frozen=True)
class NodeRange:
    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max


def parse_nnodes(text: str) -> NodeRange:
    lo, sep, hi = text.strip().partition(":")
    try:
        n_lo, n_hi = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UserError(f"--nnodes must be N or MIN:MAX with whole numbers, got {text!r}") from None
    if n_lo < 1:
        raise UserError(f"--nnodes {text}: the number of nodes must be at least 1")
    if n_hi < n_lo:
        raise UserError(f"--nnodes {text}: MIN must not exceed MAX")
    return NodeRange(n_lo, n_hi)


@dataclass
class RdzvConf:
    """torchrun's `--rdzv-conf`, mapped onto unbroken's settings."""

    join_timeout: float | None = None
    last_call: float | None = None
    node_timeout: float | None = None
    is_host: bool | None = None


_IGNORED_CONF = {
    "close_timeout": "unbroken's agents leave on the leader's result, not after a close wait",
    "read_timeout": "control-store reads are retried for --control-retry-window instead",
    "use_libuv": "the store's transport is chosen by torch",
    "store_type": "the workers' store is always a TCPStore served by the leading agent",
}


def parse_rdzv_conf(text: str, warn: Callable[[str], None]) -> RdzvConf:
    conf = RdzvConf()
    if not text.strip():
        return conf
    keepalive: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"--rdzv-conf takes KEY=VALUE,KEY=VALUE, got {text!r}")
        try:
            if key in ("join_timeout", "timeout"):
                conf.join_timeout = float(value)
            elif key == "last_call_timeout":
                conf.last_call = float(value)
            elif key in ("keep_alive_interval", "keep_alive_max_attempt"):
                keepalive[key] = float(value)
            elif key == "is_host":
                conf.is_host = value.lower() in ("1", "true", "yes")
            elif key in _IGNORED_CONF:
                warn(f"--rdzv-conf {key} has no effect: {_IGNORED_CONF[key]}")
            else:
                warn(f"--rdzv-conf {key} is not a rendezvous setting unbroken knows; ignored")
        except ValueError:
            raise UserError(f"--rdzv-conf {key} takes a number, got {value!r}") from None
    for key, seconds_ in (("join_timeout", conf.join_timeout),
                          ("last_call_timeout", conf.last_call)):
        if seconds_ is not None and seconds_ < 0:
            raise UserError(f"--rdzv-conf {key} must be 0 or more seconds, got {seconds_:g}")
    if keepalive:  # torchrun: a node is dead after max_attempt missed keep-alives
        conf.node_timeout = (keepalive.get("keep_alive_interval", 5.0)
                             * keepalive.get("keep_alive_max_attempt", 3.0))
    return conf


def parse_signals(text: str) -> tuple[int, ...]:
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]))
        except KeyError:
            raise UserError(f"--signals-to-handle: unknown signal {name!r}") from None
    return tuple(out)
