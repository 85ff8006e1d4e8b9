"""What a training pod asks for: CPU and memory, requests equal to limits (Guaranteed QoS: the
last to be evicted under memory pressure), derived from the layout unless given.

Memory = the memory-backed `/dev/shm` (it counts against the pod) + for each process that
trains or stands by (`nproc_per_node + spares`): its base (`WORKER_BASE`: the interpreter,
torch, CUDA's host side, data loader buffers) and its host copies (3 x its state:
`state_size`, the peer snapshot round and the staged checkpoint; docs/design-notes.md,
"One host copy") + the agent (`AGENT`). CPU = `CPU_PER_PROCESS` per process (its data
loader workers) + 1 for the agent. Pure; `K8sSpec` checks the results.
"""

from __future__ import annotations

import math
import re

GI = 2**30
QUANTITY_BYTES = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

WORKER_BASE = {True: 6 * GI, False: 2 * GI}
"""A process's own memory, with GPUs (CUDA's host side, pinned pools) and without."""
AGENT = 1 * GI
"""The agent: its event tails, metrics, the control store's client (node 0: its server)."""
HOST_COPIES = 3
"""Host copies of a rank's state: its own, one buddy's two buffers (`sharded/host_copy`)."""
CPU_PER_PROCESS = {True: 8, False: 1}
"""Cores per process: its data loader workers with GPUs; one on CPU."""
STATE_SIZE = {True: "8Gi", False: "256Mi"}
"""A rank's state (parameters, gradients' owner share, optimizer) when not given."""


def quantity_bytes(text: str) -> int | None:
    """A Kubernetes quantity (`16Gi`, `512Mi`, `2G`) in bytes, or None if it is not one."""
    m = QUANTITY_BYTES.fullmatch(text)
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def memory_bytes(*, gpus: bool, processes: int, shm: int, state: int) -> int:
    """The pod's memory in bytes (the module's formula)."""
    return shm + processes * (WORKER_BASE[gpus] + HOST_COPIES * state) + AGENT


def cpu_cores(*, gpus: bool, processes: int) -> int:
    return processes * CPU_PER_PROCESS[gpus] + 1


def gibibytes(n: int) -> str:
    """`n` bytes as a whole number of Gi, rounded up."""
    return f"{math.ceil(n / GI)}Gi"
