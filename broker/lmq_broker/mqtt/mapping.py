"""How an MQTT publish's attributes travel as RocketMQ message properties, and back (docs/mqtt.md).

A RocketMQ message has one flat map of user properties, which the official clients show and set; MQTT 5 has
a list of user properties (a name may repeat) and a few typed ones. So MQTT 5 user properties become the
message's properties one to one (a repeated name keeps its last value), and everything MQTT itself needs to
remember rides under ``MQTT_`` names, which an MQTT 5 user property may therefore not use (it is dropped):
the publish QoS 0 (deliveries stay at QoS 0), a 5.0 publisher's client id (no-local; a 3.1.1 publish is
left without it, so that its messages cost what they did before 5.0: no properties to store), the retain flag
(retain-as-published), and content type, payload format, response topic, correlation data and the message
expiry as an absolute deadline (so the interval a subscriber gets is what is left of it). A RocketMQ
producer's properties reach MQTT 5 subscribers as user properties; its ``MQTT_`` names are not passed on.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Final

from lmq_broker.mqtt import wire
from lmq_broker.mqtt.properties import Properties

PREFIX: Final = "MQTT_"
QOS: Final = "MQTT_QOS"  # "0"/"2": published at QoS 0/2, delivered at most at that QoS (absent: QoS 1)
CLIENT: Final = "MQTT_CLIENT_ID"
RETAIN: Final = "MQTT_RETAIN"
CONTENT_TYPE: Final = "MQTT_CONTENT_TYPE"
PAYLOAD_FORMAT: Final = "MQTT_PAYLOAD_FORMAT"
RESPONSE_TOPIC: Final = "MQTT_RESPONSE_TOPIC"
CORRELATION_DATA: Final = "MQTT_CORRELATION_DATA"  # base64
EXPIRES_AT: Final = "MQTT_EXPIRES_AT_MS"  # wall clock, ms
MAX_PROPERTIES_BYTES: Final = 16 * 1024  # what the gRPC edge allows a RocketMQ producer
MAX_U32: Final = 0xFFFFFFFF


class PropertiesTooLarge(ValueError):
    pass


def incoming(props: Properties | None, *, qos: int, retain: bool, client_id: str, now_ms: int) -> dict[str, str]:
    """The RocketMQ properties of a publish (``props`` None for 3.1.1)."""
    out: dict[str, str] = {}
    size = 0
    if props is not None:
        for name, value in props.user:
            if name.startswith(PREFIX) or not name.strip():
                continue
            out[name] = value
            size += len(name.encode()) + len(value.encode())
        if size > MAX_PROPERTIES_BYTES:
            raise PropertiesTooLarge(f"user properties exceed {MAX_PROPERTIES_BYTES} bytes")
        if props.content_type is not None:
            out[CONTENT_TYPE] = props.content_type
        if props.payload_format:
            out[PAYLOAD_FORMAT] = "1"
        if props.response_topic is not None:
            out[RESPONSE_TOPIC] = props.response_topic
        if props.correlation_data is not None:
            out[CORRELATION_DATA] = base64.b64encode(props.correlation_data).decode()
        if props.message_expiry_s is not None:
            out[EXPIRES_AT] = str(now_ms + props.message_expiry_s * 1000)
        out[CLIENT] = client_id  # 5.0 only: a 3.1.1 publish stays without properties, as before 5.0 came
    if qos != 1:
        out[QOS] = str(qos)
    if retain:
        out[RETAIN] = "1"
    return out


def expired(stored: Mapping[str, str], now_ms: int) -> bool:
    deadline = stored.get(EXPIRES_AT)
    return deadline is not None and deadline.isdigit() and int(deadline) <= now_ms


def outgoing(
    stored: Mapping[str, str], now_ms: int, subscription_ids: Sequence[int] = (), alias: int | None = None
) -> bytes:
    """The encoded MQTT 5 property section a subscriber gets for a message with RocketMQ properties ``stored``
    (per delivery: written straight to bytes), with the identifiers of the subscriptions it matched (5.0
    section 3.3.2.3.8, one property each). A name or value holding U+0000, which MQTT strings may not, is
    left out. ``alias``: the topic alias it travels under (``aliases``)."""
    out = bytearray() if alias is None else bytearray(b"\x23" + alias.to_bytes(2, "big"))
    for sid in subscription_ids:
        out += b"\x0b" + wire.varint(sid)
    for name, value in stored.items():
        if "\x00" in name or "\x00" in value:
            continue
        if not name.startswith(PREFIX):
            out += b"\x26" + wire.string(name) + wire.string(value)
        elif name == CONTENT_TYPE:
            out += b"\x03" + wire.string(value)
        elif name == PAYLOAD_FORMAT and value == "1":
            out += b"\x01\x01"
        elif name == RESPONSE_TOPIC:
            out += b"\x08" + wire.string(value)
        elif name == EXPIRES_AT and value.isdigit():
            left = min(MAX_U32, max(1, -(-(int(value) - now_ms) // 1000)))  # what is left, rounded up
            out += b"\x02" + left.to_bytes(4, "big")
        elif name == CORRELATION_DATA:
            try:
                out += b"\x09" + wire.binary(base64.b64decode(value, validate=True))
            except ValueError:
                continue
    return wire.varint(len(out)) + bytes(out)
