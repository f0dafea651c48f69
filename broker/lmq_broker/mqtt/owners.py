"""What the MQTT listener needs from a cluster of brokers (``lmq_broker.cluster.mqtt_link`` provides it).

In a cluster each lite topic lives on one broker, its owner (docs/scale-out.md). The listener cannot know the
ring (``mqtt`` sits below ``cluster`` in the import layers), so it is handed an ``Owners``: while the broker
acts as part of a cluster (``active``), what an MQTT client publishes (its wills too) is stored through it, at
each message's owner, before the publish is acknowledged; and a session's subscriptions are made at every
other broker too, whose messages the session pulls (without waiting) when they say they have some (``Remote``:
it waits for that at each of them, leasing nothing, while it waits on its own broker's), and settles where
they came from. A broker alone, or one whose cluster shrank back to itself, stores on and
delivers from its own dispatcher as before.

A session is known to the other brokers as one client per parent it subscribes in (``consumer``, the same id
its own broker's dispatcher knows it by) of its implicit group (``group``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmq_broker import model
from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import durable, exactly


@dataclass(frozen=True, slots=True)
class Pulled:
    """A message another broker handed to the session (leased there); ``receipt`` names that broker and its
    handle there (opaque here: given back to ``Owners.settle`` or ``Owners.release``)."""

    lite: str
    body: bytes
    attempt: int
    receipt: str
    properties: dict[str, str] = field(default_factory=dict)
    message_id: str = ""  # its message id there (a QoS 2 delivery keeps it with its released id, ``releasing``)


class Owners(Protocol):
    @property
    def active(self) -> bool:
        """This broker is one of several: lite topics may live elsewhere."""
        ...

    @property
    def members(self) -> tuple[str, ...]:
        """The brokers of the cluster now: a session whose subscriptions were made when they were others (a
        broker joined) makes them again."""
        ...

    async def store(self, messages: Sequence[model.NewMessage]) -> None:
        """Store every message at its lite topic's owner (this broker's own here); return once all are
        stored (durable as a gRPC send is). Raise an ``errors.LmqError`` when any is not: a refusal by its
        owner as that owner's error (a quota, a missing parent), an owner that cannot be reached as
        ``errors.BrokerUnavailable``. Then the caller must not acknowledge the publishes; those of the call that
        were stored stay stored (a resend stores them again: at least once)."""
        ...

    async def was_stored(self, planned: exactly.Planned) -> bool | None:
        """Is ``planned``'s message stored at its lite topic's owner, at or after ``planned.end``; None when this
        broker owns the topic (look here). Raise ``errors.BrokerUnavailable`` when the owner cannot tell (it
        cannot be reached): the caller must not answer the resend."""
        ...

    async def ends(self, places: Sequence[tuple[str, str]]) -> list[int | None]:
        """Each lite topic's (parent, lite) end offset at its owner (None: this broker owns it); raise
        ``errors.BrokerUnavailable`` when an owner cannot be reached (nothing can be stored there either)."""
        ...

    async def subscribe(
        self,
        consumer: str,
        group: str,
        parent: str,
        filters: Sequence[wildcards.Filter],
        older: Sequence[wildcards.Filter] | None,
    ) -> None:
        """Make ``filters`` at every other broker (kept there across its restart). ``older`` given: they are
        new, so the group starts at the end of each lite topic there that they match and ``older`` does not
        (what it holds was published before the subscription); None: a session resumed at its offsets. Raise an
        ``errors.LmqError`` when a broker refuses (a quota); one that does not answer gets them later."""
        ...

    async def unsubscribe(self, consumer: str, group: str, parent: str, filters: Sequence[wildcards.Filter]) -> None:
        """End ``filters`` (empty: every filter of ``consumer``) at every other broker; best effort."""
        ...

    async def pull(self, consumer: str, group: str, parent: str, batch: int) -> list[Pulled]:
        """At most ``batch`` messages waiting at the other brokers for ``consumer``, asked for without waiting
        (leased there, renewed while the session pulls or ``keep_alive``s); [] when none answered any."""
        ...

    def waiting(self, consumer: str, group: str, parent: str) -> Remote:
        """The other brokers of ``consumer`` as one session loop sees them (``close`` it when the loop ends)."""
        ...

    async def settle(self, consumer: str, group: str, parent: str, receipts: Sequence[str]) -> list[str]:
        """Acknowledge pulled messages at the brokers that delivered them (their group's offsets move there);
        returned, those of ``receipts`` not known settled: refused there (a lease that expired: the message comes
        again) or not answered (the broker down or too slow: it may come again). Never raises; all of them when
        this broker is alone now."""
        ...

    async def release(self, consumer: str, group: str, parent: str, receipts: Sequence[str]) -> None:
        """Give pulled, unacknowledged messages back at once (handed out again, with DUP); best effort: a
        lease not given back expires there."""
        ...

    async def keep_alive(self, consumer: str, group: str) -> None:
        """The session lives while it pulls nothing (its in-flight window is full): the others keep its
        subscriptions and leases."""
        ...

    async def retained(self, parent: str, levels: wildcards.Filter) -> list[durable.Retained]:
        """The retained messages the other brokers hold that ``levels`` matches (not expired), at most
        ``RETAINED_LIMIT`` from each; brokers that do not answer are skipped."""
        ...


class Remote(Protocol):
    """One session loop's view of the other brokers: it pulls only from those that said they have something for
    it, and waits for them without leasing anything there (a wait cut off loses nothing)."""

    async def pull(self, batch: int) -> list[Pulled]:
        """As ``Owners.pull``, from the brokers that said ready since the last pull (every broker at the first
        pull, and after the members changed)."""
        ...

    async def wait(self, timeout_s: float) -> bool:
        """Until some other broker says it has messages for the session (True), or ``timeout_s`` (False); the
        waits parked there stay parked between calls, and are renewed."""
        ...

    def close(self) -> None:
        """End the waits parked at the other brokers."""
        ...
