"""Brokers of a cluster know each other by a shared secret: every call one broker makes to another carries a
peer header, an HMAC of the call's method, its time and the caller's membership epoch (no grpc, no I/O).

A client can put any header on a call, so a peer's copy of a send or a subscription (which the receiver
applies as it is and never sends on) is recognised only by a valid peer header: ``x-lmq-peer:
<epoch>;<unix ms>;<HMAC-SHA256 hex>`` over ``<method>;<epoch>;<unix ms>`` with the cluster secret, within
``MAX_SKEW_MS`` of the receiver's clock. A call whose header is missing, forged, stale or for another method is
served as a client's call: a client-supplied marker never changes where a message is stored. With TLS between
brokers a captured header stays secret; without it, a header seen on the wire can be replayed for the same
method within the skew window (as the client signatures of ``protocol.auth``).

The secret is ``--cluster-secret`` (``LMQ_CLUSTER_SECRET``, the same on every broker), else derived from the
admin secret key, which every broker of a cluster shares already (the chart's one Secret). ``serve --processes
N`` gives its processes one generated secret when neither is set. A cluster with no secret at all refuses to
start (``setup.membership_of``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

HEADER: Final = "x-lmq-peer"
MAX_SKEW_MS: Final = 60_000
_DERIVE: Final = b"lmq peer calls v1"


def secret_of(cluster_secret: str, admin_secret_key: str) -> bytes:
    """The key peer headers are signed with; empty when the broker has neither secret."""
    if cluster_secret:
        return cluster_secret.encode()
    if admin_secret_key:
        return hmac.new(admin_secret_key.encode(), _DERIVE, hashlib.sha256).digest()
    return b""


def _mac(secret: bytes, method: str, epoch: int, at_ms: int) -> str:
    return hmac.new(secret, f"{method};{epoch};{at_ms}".encode(), hashlib.sha256).hexdigest()


def header(secret: bytes, method: str, epoch: int, now_ms: int) -> tuple[str, str]:
    """The peer header of a call to ``method`` (its full gRPC path) made at ``now_ms``."""
    return HEADER, f"{epoch};{now_ms};{_mac(secret, method, epoch, now_ms)}"


@dataclass(frozen=True, slots=True)
class PeerCall:
    epoch: int  # the calling broker's membership epoch


def verify(
    secret: bytes, method: str, metadata: Iterable[tuple[str, str | bytes]] | None, now_ms: int
) -> tuple[PeerCall | None, bool]:
    """(the peer call, or None) and whether a peer header was there at all: a header that does not verify is a
    forgery or a misconfigured broker (a different secret), which the caller counts."""
    value = ""
    for key, item in metadata or ():
        if key == HEADER:
            value = item if isinstance(item, str) else ""
            break
    else:
        return None, False
    epoch_text, _, rest = value.partition(";")
    at_text, _, mac = rest.partition(";")
    if not secret or not epoch_text.isdigit() or not at_text.isdigit() or len(mac) != 64:
        return None, True
    epoch, at_ms = int(epoch_text), int(at_text)
    if abs(now_ms - at_ms) > MAX_SKEW_MS:
        return None, True
    if not hmac.compare_digest(mac.encode(), _mac(secret, method, epoch, at_ms).encode()):
        return None, True
    return PeerCall(epoch), True
