"""Fault injection shared by tests, the demo and the benchmarks."""

from unbroken.faults.spec import FAULT_KINDS, FaultSpec, parse_faults

__all__ = ["FAULT_KINDS", "FaultSpec", "parse_faults"]
