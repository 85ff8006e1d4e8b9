"""Whether the job's control messages are signed, and with which secret: settled at first
contact, so that no agent waits in silence for a file that only another host has.

The rules (docs/design-notes.md, "Authentication: signed control messages"):

- A secret given to an agent (`--secret-file`, or `UNBROKEN_SECRET` as hex, e.g. from a
  mounted Kubernetes Secret) signs its messages and its workers'.
- A one-node job with none makes its own (`RUN_DIR/secret`, mode 0600): only this host's
  agents, workers and `unbroken drain` need it, and they find it there.
- A multi-node job with none runs unsigned, as torchrun's store does; every agent says so
  in one line (`UNSIGNED_NOTICE`) and records `control_unsigned`.
- The first agent to reach the control plane (the TCPStore's host, node 0; with etcd, the
  first to write) declares the job's `JobAuth` under `schema.JOB_AUTH`, unsigned. Every
  other agent compares its own with it (`mismatch`) before it claims a rank or joins. One
  that differs appends an `AuthRejection` (the leader records `agent_rejected`) and exits
  alone with the usage code and one line; the running job goes on. A host with the wrong
  secret can therefore never end the job: it never acts in it.

What the declaration does not protect: a writer with access to the store may squat it
before the first agent (with etcd), which can stop agents from joining but never makes one
accept an unsigned message when it holds a secret.
"""

from __future__ import annotations

import hashlib
import hmac

from unbroken.control.messages import JobAuth

_LABEL = b"unbroken job auth v1"

UNSIGNED_NOTICE = ("control messages are not signed: no secret was given; to sign them, give "
                   "every node the same secret (UNBROKEN_SECRET=<64 hex digits>, e.g. from "
                   "`openssl rand -hex 32`, or --secret-file PATH)")


def job_auth(secret: bytes | None) -> JobAuth:
    """This agent's side of the declaration: signed, and a fingerprint of its secret (an
    HMAC of a fixed label: equal for equal secrets, and useless to recover one)."""
    if secret is None:
        return JobAuth(signed=False)
    return JobAuth(signed=True, fingerprint=hmac.new(secret, _LABEL, hashlib.sha256).hexdigest())


def mismatch(job: JobAuth, mine: JobAuth) -> str | None:
    """Why an agent declaring `mine` may not join a job that declared `job` (one line for
    the user, saying how to fix it); None when it may. Pure."""
    if job.signed == mine.signed and job.fingerprint == mine.fingerprint:
        return None
    same = "give every node the same --secret-file or UNBROKEN_SECRET"
    if job.signed and not mine.signed:
        return f"the job signs its control messages and this agent has no secret: {same}"
    if not job.signed:
        return ("the job runs unsigned (its first node has no secret) and this agent has one: "
                f"{same}, or none on any node")
    return f"this agent's secret differs from the job's: {same}"
