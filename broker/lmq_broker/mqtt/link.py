"""One connection's state that its parts share (``connection`` the life and packets in, ``publishing`` the
client's publishes, ``delivering`` the messages out, ``releasing`` QoS 2 deliveries' PUBREC/PUBREL/PUBCOMP,
``subscribing`` its subscriptions), and what each of them uses: how to tell a 5.0 client why, the cluster,
the reason code of a refusal."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from lmq_broker import errors
from lmq_broker.dispatch import wildcards
from lmq_broker.mqtt import aliases, codec, mapping, properties, stats, topics
from lmq_broker.mqtt.host import Host
from lmq_broker.mqtt.owners import Owners
from lmq_broker.mqtt.properties import Properties, Reason

MAX_INFLIGHT: Final = 64  # QoS 1 deliveries waiting for their PUBACK, per connection
_BOOT_HOST: Final = "mqtt"


class Closed(Exception):
    """The connection ends; ``graceful`` when the client sent DISCONNECT (no will then); ``code``: the reason
    a 5.0 client is told in a DISCONNECT."""

    def __init__(self, reason: str, *, graceful: bool = False, code: int | None = None) -> None:
        super().__init__(reason)
        self.graceful = graceful
        self.code = code


class Link:
    """The connection's socket and session state, as the CONNECT set it."""

    def __init__(self, host: Host, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.dispatcher = host.dispatcher
        self.config = host.config
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        self.address = peer[0] if isinstance(peer, tuple) else _BOOT_HOST
        self.client_id = ""
        self.user = ""  # the CONNECT's user name: under --acl a user's, checked at the CONNECT (``authorizing``)
        self.group = ""
        self.v5 = False
        self.level = codec.LEVEL_3_1_1  # what packets after the CONNECT are read at
        self.expiry_s: int | None = 0  # seconds the session outlives the connection; None: forever
        self.max_inflight = MAX_INFLIGHT  # 5.0: lowered to the client's receive maximum
        # Set unless a SUBSCRIBE is being answered or a new subscription's retained messages are being sent:
        # live deliveries wait (``hold``), so a subscriber gets its SUBACK first (MQTT-3.8.4), then a topic's
        # retained (older) message, then live (newer) ones
        self.retained_sent = asyncio.Event()
        self.retained_sent.set()
        self.retained_sending = 0
        self.max_packet_out = codec.MAX_REMAINING_LENGTH  # 5.0: the client's maximum packet size
        self.aliases = aliases.Outbound(0)  # 5.0: the topic aliases we send, up to the client's maximum
        self.problem_info = True  # 5.0: reason strings wanted
        self.subs: dict[str, dict[wildcards.Filter, int]] = {}  # parent -> filter -> options (low bits: QoS)
        self.stored = False  # a session row exists for this client id
        self.connected = asyncio.Event()  # CONNACK written: deliveries may follow
        self.closing = False
        self.shut = False  # writing shut down (``framing.linger``)
        self.kicked = False

    @property
    def persistent(self) -> bool:
        return self.expiry_s != 0

    @property
    def cluster(self) -> Owners | None:
        """The cluster this broker is part of (its other brokers hold lite topics too); None while alone."""
        owners = self.host.owners
        return owners if owners is not None and owners.active else None

    def consumer_id(self, parent: str) -> str:
        return f"{self.group}@{parent}"

    def max_packet_bytes(self) -> int:
        return self.config.max_body_bytes + 2 + codec.MAX_STRING_BYTES + 2  # a PUBLISH: topic, packet id, body

    def hold(self) -> None:
        """Live deliveries wait until every hold is ``unhold``-ed (``retained_sent``)."""
        self.retained_sending += 1
        self.retained_sent.clear()

    def unhold(self) -> None:
        self.retained_sending -= 1
        if not self.retained_sending:
            self.retained_sent.set()

    def close(self, code: int, why: str = "") -> None:
        """Close the socket; a 5.0 client is told why first (a DISCONNECT with ``code``)."""
        self.tell(code, why)
        self.writer.close()

    def tell(self, code: int, why: str) -> None:
        """A 5.0 client is told why the broker ends the connection (a DISCONNECT with ``code``)."""
        if self.v5 and self.connected.is_set() and not self.writer.is_closing() and not self.shut:
            self.writer.write(codec.encode_disconnect(code, self.why(why)))

    def why(self, text: str) -> Properties:
        """A reason string, where the client asked for them (5.0 ``request_problem_info``)."""
        return Properties(reason_string=text[:200]) if text and self.problem_info else properties.NONE

    def ack_props(self, why: str = "") -> Properties | None:
        """The property section of an acknowledgement: None (no section) for 3.1.1."""
        return self.why(why) if self.v5 else None

    async def ended(self, task: asyncio.Task[None], what: str) -> None:
        await stats.wait_ended(task, f"mqtt client {self.client_id}: {what}", self.host.stats)


async def stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for its end. Again and again: in Python 3.11 a ``wait_for`` whose inner wait
    completes as the cancellation arrives returns normally and swallows it (the long poll would go on)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()


def reason_of(exc: Exception) -> int:
    """The 5.0 reason code a refused publish or subscription is answered with."""
    if isinstance(exc, topics.TopicError | errors.NotFound | errors.InvalidName | errors.InvalidLiteTopic):
        return Reason.TOPIC_NAME_INVALID
    if isinstance(exc, errors.LiteTopicQuotaExceeded | errors.SubscriptionQuotaExceeded | errors.TooManyRequests):
        return Reason.QUOTA_EXCEEDED
    if isinstance(exc, errors.Unauthorized | errors.Forbidden):
        return Reason.NOT_AUTHORIZED
    if isinstance(exc, errors.InvalidArgument | mapping.PropertiesTooLarge):
        return Reason.IMPLEMENTATION_SPECIFIC_ERROR
    return Reason.UNSPECIFIED_ERROR
