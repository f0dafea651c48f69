"""What one MQTT client may hold of a broker: sockets (in all and per client address), and a CONNECT's will
(its size and its delay). Each cap has a flag (``config``), a refusal the client can read (a CONNACK reason
code) and a count (``stats``); docs/security.md "Resource caps" lists them.

A socket over a socket cap is read only as far as its CONNECT's protocol level (at most 12 bytes, within
``REFUSAL_READ_S``) to answer it in its own version, and only while fewer than ``REFUSING_MAX`` such refusals
are under way; beyond that it is closed at once, unanswered: a flood of sockets costs a counter.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Final

from lmq_broker.access.control import AccessControl
from lmq_broker.config import BrokerConfig
from lmq_broker.mqtt import authorizing, codec, durable, framing, properties, stats, topics
from lmq_broker.mqtt.properties import Properties, Reason

CONNECT_FIELDS_BYTES: Final = 64 * 1024  # a CONNECT's bytes besides its will: ids, names, password, properties
REFUSING_MAX: Final = 64  # sockets over a cap being answered at once
REFUSAL_READ_S: Final = 2.0
_PROTOCOL_HEAD: Final = 7  # a CONNECT body's protocol name ("MQTT", 2 + 4 bytes) and level


class Sockets:
    """The MQTT sockets open, in all and per client address."""

    def __init__(self, config: BrokerConfig) -> None:
        self.max_total = config.mqtt_max_connections
        self.max_per_address = config.mqtt_max_connections_per_address
        self.total = 0
        self._by_address: dict[str, int] = {}
        self.refusing = 0

    def admit(self, address: str) -> str | None:
        """Count a new socket from ``address``; or the cap it is over (a ``stats`` reason), counting nothing."""
        if self.total >= self.max_total:
            return stats.CONNECTIONS
        held = self._by_address.get(address, 0)
        if held >= self.max_per_address:
            return stats.PER_ADDRESS
        self.total += 1
        self._by_address[address] = held + 1
        return None

    def release(self, address: str) -> None:
        self.total -= 1
        left = self._by_address[address] - 1
        if left:
            self._by_address[address] = left
        else:
            del self._by_address[address]


def session_expiry_s(asked: int | None, config: BrokerConfig) -> int | None:
    """How long a persistent session outlives its connection: what the client asked (None: never; 3.1.1 asks
    nothing), at most ``--mqtt-max-session-expiry-s`` (at ``durable.NEVER``, nothing is capped)."""
    cap = config.mqtt_max_session_expiry_s
    if cap >= durable.NEVER or (asked is not None and asked <= cap):
        return asked
    return cap


async def refuse_socket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, why: str) -> None:
    """A CONNACK refusing a socket over a cap (5.0: 0x97 quota exceeded, 3.1.1: 0x03 server unavailable),
    read from as little of its CONNECT as tells its version; then closed."""
    try:
        async with asyncio.timeout(REFUSAL_READ_S):
            head = await reader.readexactly(2)
            while head[-1] & 0x80 and len(head) < 5:  # the rest of the remaining length
                head += await reader.readexactly(1)
            body = await reader.readexactly(_PROTOCOL_HEAD)
        if head[0] >> 4 == codec.CONNECT:
            if body == _V5_CONNECT:
                reason = Properties(reason_string=why[:200])
                writer.write(codec.encode_connack(False, Reason.QUOTA_EXCEEDED, codec.LEVEL_5, reason))
            else:
                writer.write(codec.encode_connack(False, codec.ConnectCode.SERVER_UNAVAILABLE))
            await writer.drain()
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        pass  # gone, or too slow to be told: closed unanswered
    finally:
        await framing.shut(writer)


def connect_bytes(config: BrokerConfig) -> int:
    """The largest CONNECT read: a will of the largest size allowed and every other field."""
    return config.mqtt_max_will_bytes + CONNECT_FIELDS_BYTES


def will_bytes(will: codec.Will) -> int:
    """What a will costs to keep: its topic, payload and properties (user properties may be many)."""
    props = len(properties.encode(will.properties)) if will.properties is not None else 0
    return len(will.topic.encode()) + len(will.payload) + props


def refusal(  # noqa: PLR0911 (a return per CONNECT refusal, in order)
    connect: codec.Connect,
    config: BrokerConfig,
    access: AccessControl | None = None,
    host: str = "",
    space: topics.Space | None = None,
) -> tuple[int, str] | None:
    """Why ``connect`` is refused: a ConnectCode (3.1.1, translated for 5.0) or a 5.0 reason code, and the
    ``stats`` reason when a cap refused it (else ""); None when it is accepted. Under ``--acl`` (``access``
    enabled) its user name and password must be a user's (``authorizing``)."""
    v5 = connect.level == codec.LEVEL_5
    if not connect.client_id and not connect.clean_session and not v5:
        return codec.ConnectCode.IDENTIFIER_REJECTED, ""  # MQTT-3.1.3-8 (5.0 assigns one, MQTT-3.1.3-6)
    if not v5 and connect.keep_alive_s > config.mqtt_max_keep_alive_s:  # 3.1.1 cannot be told another one
        return codec.ConnectCode.IDENTIFIER_REJECTED, stats.KEEP_ALIVE
    if connect.properties is not None and connect.properties.auth_method is not None:
        return Reason.BAD_AUTHENTICATION_METHOD, ""  # enhanced authentication is not supported
    will = connect.will
    if will is not None:
        try:
            if not will.topic:
                raise topics.TopicError("an empty will topic")
            if "+" in will.topic or "#" in will.topic:  # a topic name, not a filter: MQTT-4.7.0-1
                raise topics.TopicError("a will topic holds a wildcard")
            topics.default_lite(will.topic, config.max_lite_topic_size)  # every other topic has a lite topic
        except topics.TopicError:
            return (Reason.TOPIC_NAME_INVALID if v5 else codec.ConnectCode.NOT_AUTHORIZED), ""  # never publishable
        if will_bytes(will) > config.mqtt_max_will_bytes:
            return (Reason.PACKET_TOO_LARGE if v5 else codec.ConnectCode.NOT_AUTHORIZED), stats.WILL_BYTES
        delay = (will.properties or properties.NONE).will_delay_s or 0
        if delay > config.mqtt_max_will_delay_s:
            return Reason.QUOTA_EXCEEDED, stats.WILL_DELAY
    if access is not None and access.enabled:
        code = authorizing.connect_refusal(access, connect, host, space)
        return None if code is None else (code, "")
    if config.access_key:
        if connect.username is None or connect.password is None:
            return codec.ConnectCode.NOT_AUTHORIZED, ""
        user_ok = hmac.compare_digest(connect.username.encode(), config.access_key.encode())
        password_ok = hmac.compare_digest(connect.password, config.secret_key.encode())
        if not (user_ok and password_ok):
            return codec.ConnectCode.BAD_USERNAME_OR_PASSWORD, ""
    return None


def keep_alive_s(connect: codec.Connect, config: BrokerConfig) -> int:
    """The keep alive the session is held to: the client's, or --mqtt-max-keep-alive-s when it asks none (0) or
    more (5.0 section 3.2.2.3.14: told so in the CONNACK's Server Keep Alive; a 3.1.1 client asking more was
    refused by ``refusal``)."""
    asked, cap = connect.keep_alive_s, config.mqtt_max_keep_alive_s
    return asked if 0 < asked <= cap else cap


def words(counted: str, config: BrokerConfig) -> str:
    """What a client refused by a cap is told (a 5.0 reason string)."""
    if counted == stats.KEEP_ALIVE:
        return f"the keep alive is over --mqtt-max-keep-alive-s ({config.mqtt_max_keep_alive_s} s)"
    if counted == stats.WILL_BYTES:
        return f"the will is over --mqtt-max-will-bytes ({config.mqtt_max_will_bytes} bytes)"
    if counted == stats.WILL_DELAY:
        return f"the will delay is over --mqtt-max-will-delay-s ({config.mqtt_max_will_delay_s} s)"
    return ""


def is_v5_connect(body: bytes) -> bool:
    return body[:_PROTOCOL_HEAD] == _V5_CONNECT


_V5_CONNECT: Final = b"\x00\x04MQTT\x05"
