"""The heartbeat page's layout: a small memory-mapped file shared by a worker and its agent.

Declared once, here, for both sides: the worker writes it (`runtime/heartbeat.py`,
`HeartbeatWriter`) and its agent reads it (`launch/workers/heartbeat_reader.py`, `HeartbeatReader`).
Like `worker_env.py`, it is a contract between the agent and its workers on one machine.

The worker stamps (step, time, phase) at every step boundary: stores into shared memory, no
syscall, well under a microsecond, so invisible in step time. The clock is CLOCK_MONOTONIC,
shared by all processes of a machine. The same page carries the other direction too: the
generation the worker is in (-1 until it runs the resilient loop) and the generation the agent
wants it to move to, with the step at which to move, read by the worker at each boundary and
by its watchdog thread (which aborts the generation's groups if the move is due mid-step).

Two more worker fields let the leader find the culprit of a hang (`launch/planning/culprit.py`):
- `progress`: a counter the worker bumps at points inside a step (0 at the step's start; the
  model's forward entered, then returned: the gradient collective follows). Ranks of one
  generation pass the same points, so a rank whose (step, progress) is behind the others',
  while they wait, is the one they wait for.
- `alive`: the time the worker's watchdog thread last ran. A process whose every thread is
  stopped (SIGSTOP, a frozen host) stops it; one blocked in a collective does not.

The page, in native 8-byte words (little-endian), in this order:

| field | format | written by |
| --- | --- | --- |
| step, monotonic_ns, phase, pid, progress | `BEAT_FORMAT` at 0 | the worker |
| generation | `GEN_FORMAT` at `GEN_OFFSET` | the worker |
| target generation, target step | `TARGET_FORMAT` at `TARGET_OFFSET` | the agent |
| alive (monotonic_ns) | `ALIVE_FORMAT` at `ALIVE_OFFSET` | the worker's watchdog |
| flight recorder dumps asked | `DUMP_FORMAT` at `DUMP_OFFSET` | the agent |
| flight recorder dumps served | `DUMP_FORMAT` at `DUMPED_OFFSET` | the worker's watchdog |

Each field is written as whole aligned words; a reader of several fields takes a `settled`
read, since the other side may be writing them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

BEAT_FORMAT = "<qqqqq"  # step, monotonic_ns, phase, pid, progress: written by the worker
PROGRESS_OFFSET = struct.calcsize("<qqqq")  # the last field of BEAT_FORMAT, bumped on its own
GEN_FORMAT = "<q"  # the generation the worker is in: written by the worker
TARGET_FORMAT = "<qq"  # generation to move to, and from which step: written by the agent
ALIVE_FORMAT = "<q"  # monotonic_ns of the watchdog thread's last run: written by the worker
DUMP_FORMAT = "<q"  # a count of flight-recorder dumps: asked by the agent, served by the worker
GEN_OFFSET = struct.calcsize(BEAT_FORMAT)
TARGET_OFFSET = GEN_OFFSET + struct.calcsize(GEN_FORMAT)
ALIVE_OFFSET = TARGET_OFFSET + struct.calcsize(TARGET_FORMAT)
DUMP_OFFSET = ALIVE_OFFSET + struct.calcsize(ALIVE_FORMAT)
DUMPED_OFFSET = DUMP_OFFSET + struct.calcsize(DUMP_FORMAT)
SIZE = DUMPED_OFFSET + struct.calcsize(DUMP_FORMAT)  # the page's length in bytes

PHASE_STARTING = 0  # process up, no step finished yet
PHASE_TRAINING = 1  # between or inside steps
PHASE_CHECKPOINT = 2  # inside a checkpoint save or load: may legitimately take long
PHASE_DONE = 3  # the training loop has finished
PHASE_RECOVERY = 4  # re-forming the group in place: bounded by the leader, not by step time
PHASE_SPARE_READY = 5  # a hot spare, warmed up, waiting to be promoted
PHASE_LONG = 6  # a phase the script declared long (`run.phase("eval")`): no step timeout
STEPPING = (PHASE_TRAINING, PHASE_LONG)  # inside the training loop, between two boundaries
# In the target's step field: leave at once (the leader broke the generation), which the
# watchdog acts on mid-step; a step >= 0 is a planned switch, made at that step boundary.
LEAVE_NOW = -1
# In a spare's target field, this generation means "promoted": the step field is its slot.
# Shared memory, so that an idle spare waits without a system call or a store round trip.
SPARE_PROMOTION = -2


def settled(read: Callable[[], T]) -> T:
    """`read()` until two reads in a row agree: the other side may be writing the fields,
    which are not written at once, and stores reach us in program order."""
    seen = read()
    for _ in range(100):
        again = read()
        if again == seen:
            break
        seen = again
    return seen


@dataclass(frozen=True)
class Beat:
    """What the agent reads of a worker's page."""

    step: int
    monotonic: float
    phase: int
    pid: int
    generation: int = -1
    progress: int = 0  # points passed inside the step (see the module docstring)
    alive: float | None = None  # monotonic time the watchdog last ran; None: no watchdog
