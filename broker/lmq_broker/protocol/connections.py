"""Which connection each client's Telemetry stream runs on, so a client id cannot be ended by another caller.

A client id is a header any caller may write. NotifyClientTermination drops every subscription of the id
it names, so without a check one tenant could end another's consumers by naming their id. The official
clients (Java, Go, Node, Python) send it over the same gRPC channel as their Telemetry stream, so the
stream's peer (``context.peer()``: ``ipv4:10.0.0.7:51324``, one TCP connection) identifies the owner. An
id with no open stream has nothing a stranger could end that expiry would not (its subscriptions went
with its last stream), so its termination is accepted from anyone, as before.
"""

from __future__ import annotations

from collections import Counter


class Connections:
    """Open Telemetry streams by client id and peer; kept by the protocol layer, never persisted."""

    def __init__(self) -> None:
        self._streams: dict[str, Counter[str]] = {}

    def opened(self, client_id: str, peer: str) -> None:
        self._streams.setdefault(client_id, Counter())[peer] += 1

    def closed(self, client_id: str, peer: str) -> None:
        peers = self._streams.get(client_id)
        if peers is None:
            return
        peers[peer] -= 1
        if peers[peer] <= 0:
            del peers[peer]
        if not peers:
            del self._streams[client_id]

    def owns(self, client_id: str, peer: str) -> bool:
        """Whether ``peer`` may act as ``client_id``: it runs one of its streams, or the id has none open."""
        peers = self._streams.get(client_id)
        return peers is None or peer in peers

    def peers_of(self, client_id: str) -> tuple[str, ...]:
        return tuple(self._streams.get(client_id, ()))
