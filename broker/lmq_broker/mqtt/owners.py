"""What the MQTT listener needs from a cluster of brokers (``lmq_broker.cluster.mqtt_link`` provides it).

In a cluster each lite topic lives on one broker, its owner (docs/scale-out.md). The listener cannot know the
ring (``mqtt`` sits below ``cluster`` in the import layers), so it is handed an ``Owners``: while the broker
acts as part of a cluster (``active``), what an MQTT client publishes (its wills too) is stored through it, at
each message's owner, before the publish is acknowledged. A broker alone, or one whose cluster shrank back to
itself, stores on its own dispatcher as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lmq_broker import model


class Owners(Protocol):
    @property
    def active(self) -> bool:
        """This broker is one of several: lite topics may live elsewhere."""
        ...

    async def store(self, messages: Sequence[model.NewMessage]) -> None:
        """Store every message at its lite topic's owner (this broker's own here); return once all are
        stored (durable as a gRPC send is). Raise an ``errors.LmqError`` when any is not: a refusal by its
        owner as that owner's error (a quota, a missing parent), an owner that cannot be reached as
        ``errors.BrokerUnavailable``. Then the caller must not acknowledge the publishes; those of the call that
        were stored stay stored (a resend stores them again: at least once)."""
        ...
