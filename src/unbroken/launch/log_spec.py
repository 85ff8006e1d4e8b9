"""What the workers' output is to do, as parsed from torchrun's log flags (pure): `--log-dir`,
`--redirects`, `--tee`, `--local-ranks-filter`, `--duplicate-std*-filters` and
`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`. The flags and the launch configuration hold a
`LogSpec`; the supervisor's `workers/worker_logs.py` carries it out."""

from __future__ import annotations

import socket
import string
from dataclasses import dataclass
from enum import IntFlag

from unbroken.errors import UserError

PREFIX_TEMPLATE_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


class Std(IntFlag):
    """Which streams: 0 none, 1 stdout, 2 stderr, 3 both (torchrun's `Std`)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


StdSpec = Std | dict[int, Std]


def parse_std(flag: str, text: str) -> StdSpec:
    """`3`, or a per-local-rank map such as `0:1,1:2` (ranks not named get 0)."""
    text = text.strip()

    def one(value: str) -> Std:
        if value not in ("0", "1", "2", "3"):
            raise UserError(f"{flag} takes 0-3 or a map such as 0:1,1:2, got {text!r}")
        return Std(int(value))

    if ":" not in text:
        return one(text)
    out: dict[int, Std] = {}
    for part in text.split(","):
        rank, sep, value = part.partition(":")
        if not sep or not rank.strip().isdigit():
            raise UserError(f"{flag} takes 0-3 or a map such as 0:1,1:2, got {text!r}")
        out[int(rank)] = one(value.strip())
    return out


def _of(spec: StdSpec, local_rank: int) -> Std:
    return spec if isinstance(spec, Std) else spec.get(local_rank, Std.NONE)


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        ranks = frozenset(int(x) for x in text.split(","))
    except ValueError:
        raise UserError("--local-ranks-filter must be a comma-separated list of integers, e.g. "
                        f"0,1,2; got {text!r}") from None
    return ranks


@dataclass(frozen=True)
class LogSpec:
    log_dir: str | None = None
    """torchrun's `--log-dir`; None: RUN_DIR/logs once anything is written there."""
    redirects: StdSpec = Std.NONE
    """Streams that go to files only."""
    tee: StdSpec = Std.NONE
    """Streams that go to files and to the console."""
    local_ranks_filter: frozenset[int] | None = None
    """Local ranks shown on the console (None: all)."""
    prefix_template: str | None = None
    """`--log-line-prefix-template`, else `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`:
    `${role_name}`, `${rank}`, `${local_rank}`, `${hostname}` (this host's short name)."""
    duplicate_stdout: tuple[str, ...] = ()
    """Lines containing one of these also go to the attempt's filtered_stdout.log."""
    duplicate_stderr: tuple[str, ...] = ()
    role: str = "default"
    """torchrun's `--role`: ROLE_NAME, and the default prefix."""

    def redirected(self, local_rank: int) -> Std:
        """The streams written to files (tee'd ones are too, and tailed from there)."""
        return _of(self.redirects, local_rank) | _of(self.tee, local_rank)

    def teed(self, local_rank: int) -> Std:
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return Std.NONE
        return _of(self.tee, local_rank)

    def hidden(self, local_rank: int) -> bool:
        """Left out of the console by `--local-ranks-filter`."""
        return self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter

    @property
    def uses_dir(self) -> bool:
        """torchrun's layout is made (a --log-dir given, or something goes to a file)."""
        return (self.log_dir is not None or self.redirects != Std.NONE or self.tee != Std.NONE
                or bool(self.duplicate_stdout or self.duplicate_stderr))

    def prefix(self, rank: int, local_rank: int) -> str:
        if self.prefix_template:
            return string.Template(self.prefix_template).safe_substitute(
                role_name=self.role, rank=rank, local_rank=local_rank,
                hostname=socket.gethostname())
        return f"[{self.role}{local_rank}]:"
