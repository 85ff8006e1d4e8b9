"""The report of a job that failed, in torchrun's shape (its `ChildFailedError` block), so
that whoever greps a torchrun job's log for "Root Cause" finds the same lines here."""

from __future__ import annotations

import time
from pathlib import Path

from unbroken.control.messages import Fault

_RULE = "=" * 60
_THIN = "-" * 60


def root_cause_report(script: str, fault: Fault | None) -> str:
    """The first failure: time, host, rank, exit code, error file and traceback."""
    lines = [_RULE, f"{Path(script).name} FAILED", _THIN, "Failures:", "  <NO_OTHER_FAILURES>",
             _THIN, "Root Cause (first observed failure):"]
    if fault is None:
        lines += ["  <N/A>", _RULE]
        return "\n".join(lines)
    when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(fault.t or time.time()))
    rank = (f"{fault.rank} (local_rank: {fault.local_rank})" if fault.local_rank is not None
            else str(fault.rank) if fault.rank is not None else f"all ranks of node {fault.node}")
    code = fault.exit_code if fault.exit_code is not None else "<N/A>"
    traceback = (fault.traceback or "").rstrip() or (
        f"{fault.kind.value}: {fault.detail}" if fault.detail else "<N/A>")
    traceback = traceback.replace("\n", "\n    ")
    lines += ["[0]:",
              f"  time      : {when}",
              f"  host      : {fault.host or (f'node {fault.node}' if fault.node is not None else '<N/A>')}",
              f"  rank      : {rank}",
              f"  exitcode  : {code} (pid: {fault.pid if fault.pid is not None else '<N/A>'})",
              f"  error_file: {fault.error_file or '<N/A>'}",
              f"  traceback : {traceback}",
              _RULE]
    return "\n".join(lines)
