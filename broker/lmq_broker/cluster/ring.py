"""Which ring slot owns a lite topic: a jump consistent hash of its LMQ name.

Jump hashing (Lamping and Veach, 2014) needs no table and moves the fewest keys when the ring grows: going
from n to n+1 slots, only keys that now land on the new slot n change owner (about 1/(n+1) of them), and
shrinking from n+1 to n moves only the keys of the removed last slot. That matches a StatefulSet, which adds
and removes the highest ordinals, and slots are numbered pod-major (``ordinal * processes + process``) so a
scale of pods appends or drops whole blocks at the end.

The key is a 64-bit BLAKE2b digest of the LMQ name, the same on every broker and Python version (``hash()``
of a str is salted per process).
"""

from __future__ import annotations

import hashlib
from typing import Final

_MULTIPLIER: Final = 2862933555777941757  # 64-bit linear congruential step of the published algorithm
_MASK: Final = (1 << 64) - 1


def key_of(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def jump(key: int, slots: int) -> int:
    """The slot in ``[0, slots)`` of a 64-bit key."""
    if slots <= 0:
        raise ValueError("a ring has at least one slot")
    bucket, candidate = -1, 0
    while candidate < slots:
        bucket = candidate
        key = (key * _MULTIPLIER + 1) & _MASK
        candidate = int((bucket + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return bucket


def slot_of(name: str, slots: int) -> int:
    return 0 if slots == 1 else jump(key_of(name), slots)


def process_port(pod_port: int, process: int) -> int:
    """The port of process ``process`` (0-based) of a pod whose processes share ``pod_port``
    (``serve --processes N``): each also listens on a port of its own, ``pod_port + 1 + process``. The one
    place this rule is written; gRPC, external, admin, metrics and copy socket ports all follow it."""
    return pod_port + 1 + process


def slot_endpoints(pod: str, processes: int) -> tuple[str, ...]:
    """The ring slots' endpoints (``host:port``) of one pod at ``pod``: the pod itself with one process, else
    its processes' own ports (``process_port``)."""
    if processes == 1:
        return (pod,)
    host, _, port = pod.rpartition(":")
    return tuple(f"{host}:{process_port(int(port), i)}" for i in range(processes))


def slot_number(ordinal: int, process: int, processes: int) -> int:
    """The ring slot of process ``process`` (0-based) of pod ``ordinal`` when every pod runs ``processes``."""
    if not 0 <= process < processes:
        raise ValueError(f"process {process} out of 0..{processes - 1}")
    return ordinal * processes + process
