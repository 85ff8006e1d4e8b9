"""The fault language: `KIND:rank=R,step=S[,seconds=X][,at=POINT]`, several joined by `;`.

`at` says where the fault fires: `step` (default) at the start of step S; `join` when the
worker, holding step S or later, starts forming a new generation's groups (a fault during a
recovery); `send` when it is about to send its state to a peer (the state sender dies);
`persist` in the background checkpoint writer, once the files of a checkpoint of step S or
later are written but before it is committed (`crash`: the worker dies mid-write;
`exception`: the writer dies; `slow`: the writer stalls for `seconds`).

One grammar for the `--fault` flag, the `UNBROKEN_FAULTS` variable, tests and benchmarks,
so a fault that broke a run can be replayed by pasting the same string.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.errors import UserError

FAULT_KINDS = {
    "crash": "the worker is SIGKILLed (a process or machine dying)",
    "hang": "the worker is SIGSTOPped (a hang: alive, silent, never progressing)",
    "exception": "the worker raises an exception (a bug or a bad batch)",
    "device_error": "the worker's own accelerator fails (raises torch.AcceleratorError, as a "
                    "sticky CUDA error does): the process must be replaced",
    "slow": "the worker sleeps `seconds` (default 1) in that step (a straggler)",
}


FAULT_POINTS = ("step", "join", "send", "persist")


@dataclass(frozen=True)
class FaultSpec:
    """One fault: what happens, to which rank, at which step, and at which point."""

    kind: str
    rank: int
    step: int
    seconds: float = 1.0
    at: str = "step"

    def __str__(self) -> str:
        extra = f",seconds={self.seconds:g}" if self.kind == "slow" else ""
        where = f",at={self.at}" if self.at != "step" else ""
        return f"{self.kind}:rank={self.rank},step={self.step}{extra}{where}"

    @property
    def key(self) -> str:
        """Identifies the fault across restarts so that it fires once per job."""
        return str(self)


def _parse_one(text: str) -> FaultSpec:
    kind, sep, rest = text.strip().partition(":")
    kind = kind.strip()
    if kind not in FAULT_KINDS:
        raise UserError(
            f"unknown fault kind {kind!r} in {text!r}; use one of {', '.join(FAULT_KINDS)}"
        )
    fields: dict[str, str] = {}
    for part in rest.split(",") if sep else []:
        name, eq, value = part.partition("=")
        if not eq:
            raise UserError(f"fault field {part!r} in {text!r} is not NAME=VALUE")
        fields[name.strip()] = value.strip()
    unknown = set(fields) - {"rank", "step", "seconds", "at"}
    if unknown:
        raise UserError(f"unknown fault field(s) {sorted(unknown)} in {text!r}")
    if "rank" not in fields or "step" not in fields:
        raise UserError(f"fault {text!r} needs rank= and step=, e.g. crash:rank=1,step=30")
    try:
        spec = FaultSpec(
            kind=kind,
            rank=int(fields["rank"]),
            step=int(fields["step"]),
            seconds=float(fields.get("seconds", 1.0)),
            at=fields.get("at", "step"),
        )
    except ValueError as exc:
        raise UserError(f"fault {text!r} has a non-numeric value: {exc}") from None
    if spec.at not in FAULT_POINTS:
        raise UserError(f"fault {text!r}: at= must be one of {', '.join(FAULT_POINTS)}")
    if spec.rank < 0 or spec.step < 0 or spec.seconds < 0:
        raise UserError(f"fault {text!r}: rank, step and seconds must be >= 0")
    return spec


def parse_faults(text: str | None) -> list[FaultSpec]:
    """Parse `;`-separated faults; empty or None gives no faults."""
    if not text:
        return []
    return [_parse_one(part) for part in text.split(";") if part.strip()]
