"""A worker's departure, posted to its agent: one local datagram, no store round trip.

Declared once, here, for both sides, like the heartbeat page: the agent binds the socket
(`launch/workers/departure_relay.py`, `DepartureRelay`) and names it in the worker's environment
(`WorkerEnv.departures_socket`); the worker posts each `Departure` it writes (`post`). The
agent gathers its workers' departures of one generation into one `NodeDepartures` append, so
a recovery costs the control plane one write per node, not one per worker.

The socket is a datagram socket in a directory only the agent's user can enter, so only
processes of that user on this machine can post. A post never blocks: if the agent cannot
take it (no socket, its queue full, a datagram too long for a traceback), `post` says so and
the worker writes its departure to the store itself, as a node of one.
"""

from __future__ import annotations

import socket

from unbroken.control import codec
from unbroken.control.messages import Departure, RelayedDeparture

MAX_DATAGRAM = 64 * 1024
"""A longer departure (a long traceback) goes to the store directly."""


def encode(attempt: int, departure: Departure) -> bytes:
    return codec.encode(RelayedDeparture(attempt=attempt, departure=departure)).encode()


def decode(data: bytes) -> RelayedDeparture | None:
    """The posted departure; None if `data` is not one (it is dropped, never executed)."""
    try:
        return codec.decode(RelayedDeparture, data)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def post(path: str, attempt: int, departure: Departure) -> bool:
    """Hand `departure` to the agent listening at `path`; False if it could not take it
    (the caller then writes it to the store itself). Never blocks."""
    data = encode(attempt, departure)
    if len(data) > MAX_DATAGRAM:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(data, path)
        except OSError:  # no agent there, or its queue is full
            return False
    return True
