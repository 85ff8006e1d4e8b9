"""The places where an adapter reaches into a framework (its *seams*), declared once, and
checked against the framework as installed: protection is decided by what the framework
has and does, never by its version string.

Each adapter declares the seams it uses (`hf.SEAMS`, `lightning.SEAMS`): a class or module
attribute that must be there, callable where the adapter calls it, with the parameters the
adapter passes or reads by name. `missing(seams)` checks them all when the adapter is about
to protect a job and names the first that is not as needed; the adapter then trains the job
unprotected, saying so in one line (a fault restarts every worker, as under torchrun).
Attributes a framework only sets on a live object (a loop's private counters) are checked
on that object (`absent`). The behaviour behind the seams (the order of the calls in one
update) is checked on the first updates of every job (`integrations/update_order.py`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Seam:
    """One attribute a framework must have for an adapter to protect a job."""

    owner: str
    """Where it lives: a module, or a module and a class ("transformers.trainer:Trainer")."""
    name: str
    """The attribute."""
    why: str
    """What the adapter does with it, for the line that says it is missing."""
    params: tuple[str, ...] = ()
    """Parameters the adapter passes by name or relies on; non-empty: it must be callable."""
    callable: bool = True
    """It is called (a method, a function, a class the adapter builds)."""

    @property
    def where(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


def resolve(owner: str) -> Any:
    """The module, or the class in it, that `owner` names; None if it cannot be imported."""
    module, _, cls = owner.partition(":")
    try:
        found: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in filter(None, cls.split(".")):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def fault(seam: Seam) -> str | None:
    """What is wrong with `seam` as installed (None: nothing)."""
    owner = resolve(seam.owner)
    if owner is None:
        return f"{seam.owner.replace(':', '.')} cannot be imported"
    target = getattr(owner, seam.name, None)
    if target is None:
        return f"{seam.where} is missing"
    if not seam.callable:
        return None
    if not callable(target):
        return f"{seam.where} is not callable"
    if seam.params:
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            return None  # a builtin without a signature: nothing more to check
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        lacking = [p for p in seam.params if p not in params and not takes_any]
        if lacking:
            return f"{seam.where} takes no parameter {', '.join(lacking)}"
    return None


def missing(seams: tuple[Seam, ...]) -> str | None:
    """One line naming the first seam not as the adapter needs it, with what it is for;
    None when every seam holds."""
    for seam in seams:
        if (wrong := fault(seam)) is not None:
            return f"{wrong} (the adapter {seam.why})"
    return None


def absent(obj: Any, names: tuple[str, ...], what: str) -> str | None:
    """One line naming the first of `names` that live object `obj` (called `what`) lacks."""
    for name in names:
        if not hasattr(obj, name):
            return f"{what} has no attribute {name}"
    return None
