"""The categories every second of every rank's wall time is charged to, declared once.

Names follow Google's goodput taxonomy (`ml-goodput-measurement`) where one fits. The report,
the CSV tables, the Prometheus label `category` and the Grafana dashboard all use these
values; docs/goodput.md defines each.
"""

from __future__ import annotations

from enum import StrEnum


class Category(StrEnum):
    PRODUCTIVE_STEP = "productive_step"
    """A committed step's compute that the run kept (the last computation of that step)."""
    PROGRAM_STARTUP = "program_startup"
    """A worker process starting: from its spawn to the end of its imports."""
    INIT_RENDEZVOUS = "init_rendezvous"
    """Process-group rendezvous and the script's set-up before its first step."""
    CHECKPOINT_SAVE = "checkpoint_save"
    """The training loop's stall for a checkpoint, and the final flush before exit."""
    CHECKPOINT_RESTORE = "checkpoint_restore"
    """Loading a checkpoint from storage."""
    DATA_LOADING = "data_loading"
    """Time inside `run.phase("data_loading")` (or "data"), when the script marks it."""
    STRAGGLER = "straggler"
    """Time a step took beyond three times the run's median step (a slow rank holds all)."""
    WASTED_PROGRESS = "wasted_progress"
    """Steps computed again after a disruption, and the step a fault cut short."""
    INFRASTRUCTURE_RECOVERY = "infrastructure_recovery"
    """From a fault to the next step: detection, reconfiguration, state sync, `build()`."""
    CAPACITY_LOST = "capacity_lost"
    """A rank missing while the job runs shrunk."""
    UNTRACKED = "untracked"
    """A script that reports no steps: the time its processes ran, training included, which
    unbroken cannot tell apart (docs/goodput.md, "Scripts that report no steps")."""
    IDLE = "idle"
    """Anything else: waiting at start or at the end, time no event accounts for."""


BADPUT = tuple(c for c in Category if c != Category.PRODUCTIVE_STEP)
"""Every category that is not goodput, in report order."""
