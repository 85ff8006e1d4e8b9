"""Signed control messages: every message written through a `Channel` carries an HMAC of
the job's secret, and a message without a valid one is rejected, not acted on.

The secret is per job (`control.auth` says where it comes from and how the agents agree on
it at first contact): given to every node (`--secret-file`, or `UNBROKEN_SECRET` as hex), or
on a one-node job made by its agent (32 random bytes, `RUN_DIR/secret`, mode 0600, for
`unbroken drain` on the same host), or, on a multi-node job given none, absent: the job
then runs unsigned, and says so. The agent hands it to its workers in their environment.

What is signed: every slot and queue entry (faults, deaths, plans, results, orders,
drains...). What is not: counters (an atomic add cannot carry a signature) and the keys of
torch's own process-group rendezvous. A forger who can reach the store can therefore bump a
counter, which at worst wakes the planner, but cannot make it act on a death, a plan or a
drain it did not get from a holder of the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from unbroken.errors import UserError

SECRET_FILE = "secret"  # in the run dir
SECRET_ENV = "UNBROKEN_SECRET"  # hex


class ForgedMessage(Exception):  # noqa: N818 - a verdict on a message, handled as an event
    """A message whose signature is missing or wrong."""


class Signer:
    """Seals and opens messages with the job's secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise UserError("the job secret must be at least 16 bytes (32 hex digits)")
        self._key = secret

    def _mac(self, key: str, text: str) -> str:
        # The key is part of what is signed: a valid message cannot be replayed elsewhere.
        return hmac.new(self._key, f"{key}\n{text}".encode(), hashlib.sha256).hexdigest()

    def seal(self, key: str, text: str) -> str:
        return json.dumps({"m": text, "mac": self._mac(key, text)}, separators=(",", ":"))

    def open(self, key: str, raw: str) -> str:
        try:
            envelope = json.loads(raw)
            text, mac = envelope["m"], envelope["mac"]
        except (ValueError, KeyError, TypeError):
            raise ForgedMessage(f"{key}: not a signed message") from None
        if not (isinstance(text, str) and isinstance(mac, str)
                and hmac.compare_digest(mac, self._mac(key, text))):
            raise ForgedMessage(f"{key}: bad signature")
        return text


def load_secret(run_dir: str | os.PathLike[str] | None, secret_file: str | None = None,
                create: bool = False) -> bytes | None:
    """The job's secret: from `secret_file`, from UNBROKEN_SECRET, from RUN_DIR/secret (pass
    `run_dir` only where that file can be on this host: a one-node job), or (`create=True`,
    the one-node job's agent) a new one written there. None when there is none."""
    if secret_file:
        try:
            return bytes.fromhex(Path(secret_file).read_text().strip())
        except OSError as exc:
            raise UserError(f"cannot read --secret-file {secret_file}: {exc.strerror}") from None
        except ValueError:
            raise UserError(f"--secret-file {secret_file}: not hex digits") from None
    if os.environ.get(SECRET_ENV):
        try:
            return bytes.fromhex(os.environ[SECRET_ENV].strip())
        except ValueError:
            raise UserError(f"{SECRET_ENV} must be hex digits") from None
    if run_dir is None:
        return None
    path = Path(run_dir) / SECRET_FILE
    if path.exists():
        return bytes.fromhex(path.read_text().strip())
    if not create:
        return None
    secret = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret.hex())
    tmp.replace(path)
    return secret
