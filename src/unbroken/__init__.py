"""unbroken: fault-tolerant distributed training for PyTorch.

The worker API (`init`, `Run`) is imported lazily: every worker starts through
`unbroken.worker`, and importing torch before the user's script would break
scripts that set environment variables (CUDA_VISIBLE_DEVICES, ...) before `import torch`.
"""

from typing import TYPE_CHECKING, Any

from unbroken.errors import CheckpointMismatch, ExitCode, UserError
from unbroken.faults import FaultSpec, parse_faults

if TYPE_CHECKING:
    from unbroken.runtime.exact_reduce import exact_allreduce
    from unbroken.runtime.run import Run, init

__version__ = "0.1.0"

__all__ = [
    "CheckpointMismatch",
    "ExitCode",
    "FaultSpec",
    "Run",
    "UserError",
    "exact_allreduce",
    "init",
    "parse_faults",
]


def __getattr__(name: str) -> Any:
    if name in ("Run", "init"):
        from unbroken.runtime import run

        return getattr(run, name)
    if name == "exact_allreduce":
        from unbroken.runtime.exact_reduce import exact_allreduce

        return exact_allreduce
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
