"""Whether the keys an agent meets under its `--rdzv-id` are a live job's or a dead one's.

etcd outlives the jobs it serves: a job whose every agent was killed at once (a JobSet's pods
force-deleted, a node pool lost, a benchmark's killed try) leaves its keys behind, and a new
job started under the same id meets them. Joining them would make it a follower of a leader
that is gone (or, with another secret, refuse it for the wrong reason). So an agent that finds
the job's declaration (`schema.JOB_AUTH`) already written judges the job first (`judge`):

- **forming** when nobody has claimed leadership yet: it is joined at once (node 0 must not
  wait here: it is the one who claims first);
- **alive** when, within the window, the leader claim's agent lease moves, or the claim
  changes (a takeover under way);
- **dead** otherwise: its leader's lease did not move, and nobody took over, for the whole
  window.

Not detected: a job that died before any agent claimed leadership (its keys are a
declaration and a few counters; a new job adopts them, and says "another secret" if its
secret differs).

A dead job is refused with one line (`DeadJob`, exit 2) that names the two ways on: a fresh
`--rdzv-id`, or `--continue-dead-job`. With that flag (which `unbroken k8s` always passes: its
id is unique to one JobSet instance, so the only dead job it can meet is that instance's own
earlier attempt, before a JobSet restart), the agents continue the job: exactly one of them
(`clear`) swaps the dead declaration for a reset marker by compare-and-set and deletes every
key of the id; the others wait for that (`wait_cleared`). All then form the job afresh, and
the training resumes from its checkpoints.

Why the declaration is the token: each declaration carries its writer's instance
(`JobAuth.incarnation`), so a slow agent's compare-and-set on the dead declaration can never
succeed against the next job's, even with the same secret.

Only jobs with an elected leader (etcd) are judged: the embedded TCPStore goes away with its
host, so no agent ever meets a dead job's keys in it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from unbroken.control.backend import Backend
from unbroken.control.codec import decode
from unbroken.control.messages import LeaderClaim
from unbroken.control.schema import JOB_AUTH, LEADER, agent_lease
from unbroken.errors import ConfigError, ControlPlaneError
from unbroken.polling import poll_until

RESET_MARK = "reset:"


class DeadJob(ConfigError):
    """A dead job's keys under this agent's id, and no --continue-dead-job: permanent."""

    def __init__(self, run_id: str, silent: float) -> None:
        super().__init__(
            f"the control plane holds the keys of a dead job under --rdzv-id {run_id} (nobody "
            f"led it for the {silent:.0f}s this agent watched): give this job a fresh "
            "--rdzv-id, or pass --continue-dead-job to continue that job (its training "
            "resumes from its checkpoints)")


def window(leader_timeout: float) -> float:
    """How long an agent watches before it calls a job dead: a live leader refreshes its
    lease at least every 2 s (`LaunchConfig.lease_period`), and a silent one is replaced
    within --leader-timeout and a look. Pure."""
    return max(5.0, 3 * leader_timeout + 2.0)


def _claim(raw: str) -> LeaderClaim | None:
    """The leader claim inside a stored value, signed or not, UNVERIFIED: used only to name
    the lease to watch (reading a key is all that is done with it), never acted on."""
    try:
        envelope = json.loads(raw)
        text = envelope["m"] if isinstance(envelope, dict) and "mac" in envelope else raw
        return decode(LeaderClaim, text)
    except (ValueError, KeyError, TypeError):
        return None


def judge(backend: Backend, watch_for: float, sleep: Callable[[float], None]) -> float | None:
    """Watch the job under this id for up to `watch_for` seconds: None as soon as it shows
    life, else the seconds it stayed silent (the job is dead)."""
    start = time.monotonic()
    first = backend.get(LEADER.key)
    claim = _claim(first) if first is not None else None
    if claim is None:
        return None  # forming: nobody leads it yet
    lease = agent_lease(claim.node, claim.instance).key
    token = backend.get(lease)
    while (silent := time.monotonic() - start) < watch_for:
        sleep(0.1)
        if backend.get(LEADER.key) != first or backend.get(lease) != token:
            return None
    return silent


def is_reset(raw: str | None) -> bool:
    return raw is not None and raw.startswith(RESET_MARK)


def clear(backend: Backend, dead_declaration: str, instance: str) -> bool:
    """Take the dead job's keys: True if this agent won the compare-and-set on its
    declaration and deleted every key of the id; False if another agent did (or does)."""
    mark = RESET_MARK + instance
    if backend.compare_set(JOB_AUTH.key, dead_declaration, mark) != mark:
        return False
    backend.delete_prefix()
    return True


def wait_cleared(backend: Backend, timeout: float, sleep: Callable[[float], None]) -> None:
    """Wait until the agent that won `clear` has deleted the dead job's keys (bounded)."""
    poll_until(lambda: None if is_reset(backend.get(JOB_AUTH.key)) else True, timeout, 0.05,
               sleep=sleep, timeout_error=lambda: ControlPlaneError(
                   f"another agent began to clear a dead job's keys and did not finish within "
                   f"{timeout:g}s"))
