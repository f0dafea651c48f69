"""Calls that wait rather than work (ReceiveMessage long polls, Telemetry streams), counted per client id and
per connection, each count capped.

Admission (``admission``) caps the calls that run; a waiting call holds no admission slot, so without these
caps one client could park any number of them: 10,000 long polls on one connection were all accepted (issue
26; each held ~24 KiB) and 300 Telemetry streams that never read held 893 MiB at peak. The client id is a
header anyone may write, so a connection (``context.peer()``, one TCP connection) has its own cap: a client
cannot escape the first cap by inventing ids, nor another caller's id fill the cap of a client on another
connection. Long polls are also capped in all (``--max-polls``): many connections, each under its own cap, parked
without bound before (1,024 polls on each of 20 connections were all parked). A call beyond any cap is refused at
once (``Parking.admit`` names the reason), counted by the caller in ``lmq_calls_refused_total``, and never parks.

One event loop runs every call, so the counts are plain dicts of ints: no lock.
"""

from __future__ import annotations

import sys
from typing import Final

REASON_PER_CLIENT: Final = "per_client"
REASON_PER_CONNECTION: Final = "per_connection"
REASON_TOTAL: Final = "total"


def _cap(limit: int) -> int:
    return limit if limit > 0 else sys.maxsize  # 0: no cap


class Parking:
    """How many calls of one kind (``what``: "long polls", "Telemetry streams") each client id and each
    connection has parked now, and the caps on both and on their sum (``limit``; 0: none)."""

    __slots__ = ("by_client", "by_connection", "limit", "per_client", "per_connection", "total", "what")

    def __init__(self, what: str, per_client: int, per_connection: int, limit: int = 0) -> None:
        self.what = what
        self.per_client = _cap(per_client)
        self.per_connection = _cap(per_connection)
        self.limit = _cap(limit)
        self.by_client: dict[str, int] = {}
        self.by_connection: dict[str, int] = {}
        self.total = 0

    def admit(self, client_id: str, peer: str) -> str | None:
        """Park one call of ``client_id`` on ``peer`` (then ``leave`` with the same pair when it ends); or,
        beyond a cap, park nothing and return the reason (``REASON_PER_CLIENT``, ``REASON_PER_CONNECTION``,
        ``REASON_TOTAL``)."""
        if self.total >= self.limit:
            return REASON_TOTAL
        mine = self.by_client.get(client_id, 0)
        if mine >= self.per_client:
            return REASON_PER_CLIENT
        theirs = self.by_connection.get(peer, 0)
        if theirs >= self.per_connection:
            return REASON_PER_CONNECTION
        self.by_client[client_id] = mine + 1
        self.by_connection[peer] = theirs + 1
        self.total += 1
        return None

    def leave(self, client_id: str, peer: str) -> None:
        _decrement(self.by_client, client_id)
        _decrement(self.by_connection, peer)
        self.total -= 1

    def refusal(self, reason: str, client_id: str) -> str:
        """The message a refused caller reads."""
        if reason == REASON_PER_CLIENT:
            return (
                f"too many {self.what} parked for client {client_id} (at most {self.per_client}); "
                "retry once one has ended"
            )
        if reason == REASON_TOTAL:
            return f"too many {self.what} parked on this broker (at most {self.limit}); retry later"
        return f"too many {self.what} parked on this connection (at most {self.per_connection}); retry later"


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)  # an idle client or closed connection leaves no entry behind


class Budget:
    """Bytes that calls of one kind hold between them (Telemetry replies queued for clients that have not read
    them yet), and the cap on the sum. Once a ``take`` was refused the budget is ``full`` until half of it is
    free again, so that new calls are not admitted just to be refused at their first reply."""

    __slots__ = ("limit", "refusing", "used")

    def __init__(self, limit: int) -> None:
        self.limit = _cap(limit)
        self.used = 0
        self.refusing = False

    @property
    def full(self) -> bool:
        return self.refusing or self.used >= self.limit

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes (then ``give`` them back), unless that would pass the cap."""
        if self.used + size > self.limit:
            self.refusing = True
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size
        if self.refusing and self.used * 2 <= self.limit:
            self.refusing = False
