"""unbroken: fault-tolerant distributed training for PyTorch.

The worker API (`init`, `Run`) is imported lazily: every worker starts through
`unbroken.worker`, and importing torch before the user's script would break
scripts that set environment variables (CUDA_VISIBLE_DEVICES, ...) before `import torch`.
"""

from typing import TYPE_CHECKING, Any

from unbroken.errors import CheckpointMismatch, ExitCode, JobStopped, UserError
from unbroken.faults import FaultSpec, parse_faults

if TYPE_CHECKING:
    from unbroken.runtime.anomalies.numerics import Verdict
    from unbroken.runtime.config import (
        AnomalyConfig,
        NumericsConfig,
        Remedy,
        SdcConfig,
        SdcRemedy,
        StragglerConfig,
        StragglerRemedy,
    )
    from unbroken.runtime.groups.exact_reduce import exact_allreduce
    from unbroken.runtime.run import Run, init
    from unbroken.runtime.step_probe import timed

__version__ = "0.1.0"

_CONFIG = ("AnomalyConfig", "NumericsConfig", "Remedy", "SdcConfig", "SdcRemedy",
           "StragglerConfig", "StragglerRemedy")

__all__ = [
    "AnomalyConfig",
    "CheckpointMismatch",
    "ExitCode",
    "FaultSpec",
    "JobStopped",
    "NumericsConfig",
    "Remedy",
    "Run",
    "SdcConfig",
    "SdcRemedy",
    "StragglerConfig",
    "StragglerRemedy",
    "UserError",
    "Verdict",
    "exact_allreduce",
    "init",
    "parse_faults",
    "timed",
]


def __dir__() -> list[str]:
    """The public names (`__all__`, the lazily imported ones included) and the module's own."""
    return sorted(set(__all__) | set(globals()))


def __getattr__(name: str) -> Any:
    if name in ("Run", "init"):
        from unbroken.runtime import run

        return getattr(run, name)
    if name in _CONFIG:
        from unbroken.runtime import config

        return getattr(config, name)
    if name == "timed":
        from unbroken.runtime.step_probe import timed

        return timed
    if name == "Verdict":
        from unbroken.runtime.anomalies.numerics import Verdict

        return Verdict
    if name == "exact_allreduce":
        from unbroken.runtime.groups.exact_reduce import exact_allreduce

        return exact_allreduce
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
