"""What the planner (`planner.decide`) asks the executor (`plan_executor.carry_out`) to do.

Each command is plain data; carrying one out is a store write, an event or a line to the
user, nothing else. `EndAttempt` ends the attempt: the leader decides, by its `EndAction`,
whether the next attempt is paid for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from unbroken.control.messages import (
    DrainOutcome,
    Fault,
    GenPlan,
    NodeOrder,
    NodeOut,
    SwitchTarget,
)
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_names import Event


@dataclass
class WriteTarget:
    target: SwitchTarget


@dataclass
class WritePlan:
    plan: GenPlan


@dataclass
class Order:
    node: int
    order: NodeOrder


@dataclass
class MarkDrained:
    wid: str


@dataclass
class MarkOut:
    """Tell `node`'s agent it is out of the job (a quarantine)."""

    node: int
    why: NodeOut


@dataclass
class AnswerDrain:
    index: int
    outcome: DrainOutcome


@dataclass
class MarkFinished:
    pass


@dataclass
class Record:
    """An event for the run's log, typed (`telemetry.schema`)."""

    body: ev.EventBody

    @property
    def event(self) -> Event:
        return self.body.EVENT

    @property
    def fields(self) -> dict[str, Any]:
        """Its keys as the log holds them."""
        return ev.encode(self.body)


@dataclass
class Say:
    text: str


class EndAction(StrEnum):
    FALLBACK = "fallback"  # restart every worker from the last checkpoint (already paid for)
    RESTART = "restart"  # a fault in-place recovery cannot take: a full restart, if budget allows
    GIVE_UP = "give_up"  # the job fails


@dataclass
class EndAttempt:
    action: EndAction
    fault: Fault
    reason: str


Command = (WriteTarget | WritePlan | Order | MarkDrained | MarkOut | AnswerDrain | MarkFinished
           | Record | Say | EndAttempt)
