"""The fault language: `KIND:rank=R,step=S[,FIELD=VALUE...]`, several joined by `;`.

Process faults (`crash`, `hang`, `exception`, `device_error`, `slow`) take `at=POINT`, where
the fault fires: `step` (default) at the start of step S; `join` when the worker, holding
step S or later, starts forming a new generation's groups (a fault during a recovery);
`send` when it is about to send its state to a peer (the state sender dies); `teardown` in a
planned switch (a drain, a promotion), once the device has drained and before the old groups
are torn down; `update` just
before step S's update, its gradients reduced (at the fence, `runtime/generations/fence.py`); `persist` in
the background checkpoint writer, once the files of a checkpoint of step S or later are
written but before it is committed (`crash`: the worker dies mid-write; `exception`: the
writer dies; `slow`: the writer stalls for `seconds`).

Numeric faults (`nan`, `spike`, `bitflip`) corrupt the training state silently, for anomaly
detection to find; each fires at the one point its kind names (`FaultSpec.point`), and
`at=` is refused:

    nan:rank=R,step=S[,persistent=1]              the gradient, after backward, before the check
    spike:rank=R,step=S,scale=X[,persistent=1]    the loss the check sees, and the gradients, x X
    bitflip:rank=R,step=S[,param=I][,index=J][,bit=B][,persistent=1]
                                                  after the update: bit B of flat element J
                                                  of the I-th parameter is flipped

`slow` may span a window: `slow:rank=R,step=S,steps=N,factor=F` makes steps S..S+N-1 each
sleep (F-1) x the step time (frozen at the window's first step); `steps=N,seconds=X` sleeps
X in each. `slow:...,at=update,seconds=X,until=abort` sleeps at most X but wakes as soon
as the rank's watchdog aborts its generation on notice of a peer's fault: the straggler
reaches its fence after the fault is known, however long the notice takes (a loaded machine,
a slow control plane).

A fault fires once per job; a `persistent=1` fault, and a `slow` window, fire again on every
matching execution in the process that first fired them (see `unbroken.faults.inject`).

Every spec that parses prints back to itself: `parse_faults(str(spec)) == [spec]`, printing
only the fields that differ from their defaults (and `seconds` of a `slow`, always). One
grammar for the `--fault` flag, the `UNBROKEN_FAULTS` variable, tests and benchmarks, so a
fault that broke a run can be replayed by pasting the same string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.errors import UserError

FAULT_KINDS = {
    "crash": "the worker is SIGKILLed (a process or machine dying)",
    "hang": "the worker is SIGSTOPped (a hang: alive, silent, never progressing)",
    "exception": "the worker raises an exception (a bug or a bad batch)",
    "device_error": "the worker's own accelerator fails (raises torch.AcceleratorError, as a "
                    "sticky CUDA error does): the process must be replaced",
    "slow": "the worker sleeps `seconds` (default 1) in that step (a straggler); with "
            "`steps=N` in each of N steps, and with `factor=F` (F-1) x the step time",
    "nan": "one element of the worker's gradient becomes NaN after backward (a numeric "
           "blow-up or a bad batch)",
    "spike": "the worker's loss and gradients are multiplied by `scale` (a loss spike)",
    "bitflip": "one bit of one parameter flips after the update (silent data corruption: "
               "bit `bit`, default 20, of element `index` of parameter `param`)",
}

FAULT_POINTS = {
    "step": "at the start of the step (the default)",
    "join": "when the worker starts forming a new generation's groups (a fault in a recovery)",
    "send": "when it is about to send its state to a peer",
    "teardown": "in a planned switch, the device drained, before the old groups are torn down",
    "update": "just before the step's update, its gradients reduced (at the fence)",
    "persist": "in the background checkpoint writer, files written, before the commit",
}
"""Where a process fault fires (`at=`): each point's name and when it fires."""

UNTIL = {
    "abort": "a `slow` at the update point wakes once the watchdog aborts its generation",
}
"""What may end a `slow` fault's sleep early (`until=`)."""

# The numeric kinds fire at one fixed point each: after backward, when the loss is checked,
# after the update.
NUMERIC_POINTS = {"nan": "grad", "spike": "loss", "bitflip": "update"}

_PROCESS_FIELDS = {"rank", "step", "at"}
_FIELDS_BY_KIND = {
    "crash": _PROCESS_FIELDS,
    "hang": _PROCESS_FIELDS,
    "exception": _PROCESS_FIELDS,
    "device_error": _PROCESS_FIELDS,
    "slow": _PROCESS_FIELDS | {"seconds", "steps", "factor", "until"},
    "nan": {"rank", "step", "persistent"},
    "spike": {"rank", "step", "scale", "persistent"},
    "bitflip": {"rank", "step", "param", "index", "bit", "persistent"},
}
_ALL_FIELDS = set().union(*_FIELDS_BY_KIND.values())
_BOOLS = {"1": True, "true": True, "0": False, "false": False}


@dataclass(frozen=True)
class FaultSpec:
    """One fault: what happens, to which rank, at which step, and at which point.

    Fields a kind does not take keep their defaults (the parser refuses them)."""

    kind: str
    rank: int
    step: int
    seconds: float = 1.0
    at: str = "step"
    scale: float = 1.0  # spike: the factor on the loss and the gradients
    persistent: bool = False  # nan, spike, bitflip: fires again in the process that fired it
    steps: int = 1  # slow: the window's length, from `step`
    factor: float | None = None  # slow: sleep (factor-1) x the step time, instead of seconds
    param: int = 0  # bitflip: which parameter, in the order given
    index: int = 0  # bitflip: which element of it, flat
    bit: int = 20  # bitflip: which bit of that element
    until: str | None = None  # slow at=update: "abort" wakes it when its generation is aborted

    def __str__(self) -> str:
        out = [f"{self.kind}:rank={self.rank},step={self.step}"]
        if self.kind == "slow" and self.factor is None:
            out.append(f"seconds={_num(self.seconds)}")
        if self.steps != 1:
            out.append(f"steps={self.steps}")
        if self.factor is not None:
            out.append(f"factor={_num(self.factor)}")
        if self.kind == "spike":
            out.append(f"scale={_num(self.scale)}")
        for name, default in (("param", 0), ("index", 0), ("bit", 20)):
            if getattr(self, name) != default:
                out.append(f"{name}={getattr(self, name)}")
        if self.persistent:
            out.append("persistent=1")
        if self.at != "step":
            out.append(f"at={self.at}")
        if self.until is not None:
            out.append(f"until={self.until}")
        return ",".join(out)

    @property
    def key(self) -> str:
        """Identifies the fault across restarts so that it fires once per job."""
        return str(self)

    @property
    def point(self) -> str:
        """Where it fires: `at` for a process fault; `grad`, `loss` or `update` for a
        numeric one."""
        return NUMERIC_POINTS.get(self.kind, self.at)


def _num(x: float) -> str:
    """`x` as short as it prints and still parses back to itself."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


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
    unknown = set(fields) - _ALL_FIELDS
    if unknown:
        raise UserError(f"unknown fault field(s) {sorted(unknown)} in {text!r}")
    if kind in NUMERIC_POINTS and "at" in fields:
        raise UserError(f"fault {text!r}: a {kind} fault always fires at "
                        f"{NUMERIC_POINTS[kind]!r}; drop at=")
    invalid = sorted(set(fields) - _FIELDS_BY_KIND[kind])
    if invalid:
        raise UserError(f"fault {text!r}: field {invalid[0]}= is not valid for {kind} "
                        f"(it takes {', '.join(sorted(_FIELDS_BY_KIND[kind]))})")
    if "rank" not in fields or "step" not in fields:
        raise UserError(f"fault {text!r} needs rank= and step=, e.g. crash:rank=1,step=30")
    if kind == "spike" and "scale" not in fields:
        raise UserError(f"fault {text!r} needs scale=, e.g. spike:rank=0,step=10,scale=100")
    if "seconds" in fields and "factor" in fields:
        raise UserError(f"fault {text!r}: give seconds= or factor=, not both")
    persistent = fields.get("persistent", "0").lower()
    if persistent not in _BOOLS:
        raise UserError(f"fault {text!r}: persistent= must be 1 or 0")
    try:
        spec = FaultSpec(
            kind=kind,
            rank=int(fields["rank"]),
            step=int(fields["step"]),
            seconds=float(fields.get("seconds", 1.0)),
            at=fields.get("at", "step"),
            scale=float(fields.get("scale", 1.0)),
            persistent=_BOOLS[persistent],
            steps=int(fields.get("steps", 1)),
            factor=float(fields["factor"]) if "factor" in fields else None,
            param=int(fields.get("param", 0)),
            index=int(fields.get("index", 0)),
            bit=int(fields.get("bit", 20)),
            until=fields.get("until"),
        )
    except ValueError as exc:
        raise UserError(f"fault {text!r} has a non-numeric value: {exc}") from None
    _check(spec, text)
    return spec


def _check(spec: FaultSpec, text: str) -> None:
    """Refuses values out of range, one clear line each."""
    if spec.at not in FAULT_POINTS:
        raise UserError(f"fault {text!r}: at= must be one of {', '.join(FAULT_POINTS)}")
    if spec.rank < 0 or spec.step < 0 or not spec.seconds >= 0 or math.isinf(spec.seconds):
        raise UserError(f"fault {text!r}: rank, step and seconds must be >= 0")
    if not (spec.scale > 0 and math.isfinite(spec.scale)):
        raise UserError(f"fault {text!r}: scale= must be a finite number > 0")
    if spec.steps < 1:
        raise UserError(f"fault {text!r}: steps= must be >= 1")
    if spec.factor is not None and not (spec.factor > 1 and math.isfinite(spec.factor)):
        raise UserError(f"fault {text!r}: factor= must be a finite number > 1")
    if (spec.steps != 1 or spec.factor is not None) and spec.at != "step":
        raise UserError(f"fault {text!r}: steps= and factor= need at=step (a step window)")
    if spec.until is not None and (spec.until not in UNTIL or spec.at != "update"):
        raise UserError(f"fault {text!r}: until= takes {', '.join(UNTIL)}, with at=update")
    if spec.param < 0 or spec.index < 0:
        raise UserError(f"fault {text!r}: param= and index= must be >= 0")
    if not 0 <= spec.bit <= 63:
        raise UserError(f"fault {text!r}: bit= must be in 0..63")


def parse_faults(text: str | None) -> list[FaultSpec]:
    """Parse `;`-separated faults; empty or None gives no faults."""
    if not text:
        return []
    return [_parse_one(part) for part in text.split(";") if part.strip()]
