"""paho-mqtt clients steered by tests and benchmarks (a dev dependency: import only where paho is installed).

``Peer`` wraps one paho client: it connects and waits for the CONNACK, records what arrives (topic, payload,
QoS, retain, dup; with MQTT 5 its properties, the reason codes of PUBACKs and of a DISCONNECT) and lets a
test wait for a condition with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

WAIT_S = 15.0


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    mid: int
    properties: Any = None  # MQTT 5: paho's Properties of the PUBLISH


class Peer:
    def __init__(  # noqa: PLR0913 (one scenario told start to end)
        self,
        port: int,
        client_id: str,
        *,
        clean: bool = True,
        manual_ack: bool = False,
        keepalive: int = 30,
        will: tuple[str, bytes, int, bool] | tuple[str, bytes, int, bool, Any] | None = None,
        auth: tuple[str, str] | None = None,
        protocol: MQTTProtocolVersion = MQTTProtocolVersion.MQTTv311,
        properties: Any = None,
    ) -> None:
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean if protocol != MQTTProtocolVersion.MQTTv5 else None,
            protocol=protocol,
            manual_ack=manual_ack,
        )
        self.changed = threading.Condition()
        self.received: list[Received] = []
        self.connack: tuple[bool, str] | None = None  # (session present, reason)
        self.connack_properties: Any = None
        self.disconnected = False
        self.disconnect_reason: int | None = None  # MQTT 5: the code of the broker's DISCONNECT
        self.acks: dict[int, int] = {}  # mid -> PUBACK reason code
        self.client.on_publish = self._on_publish
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_disconnect = self._on_disconnect
        self.client.reconnect_delay_set(60, 60)  # a test reconnects itself, never paho behind its back
        if will is not None:
            self.client.will_set(*will)
        if auth is not None:
            self.client.username_pw_set(*auth)
        if protocol == MQTTProtocolVersion.MQTTv5:
            self.client.connect("127.0.0.1", port, keepalive=keepalive, clean_start=clean, properties=properties)
        else:
            self.client.connect("127.0.0.1", port, keepalive=keepalive)
        self.client.loop_start()
        self.wait(lambda p: p.connack is not None or p.disconnected, "CONNACK")

    def _on_connect(self, _c: Any, _u: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.changed:
            self.connack = (bool(flags.session_present), str(reason))
            self.connack_properties = props
            self.changed.notify_all()

    def _on_message(self, _c: Any, _u: Any, m: mqtt.MQTTMessage) -> None:
        with self.changed:
            props = getattr(m, "properties", None)
            self.received.append(Received(m.topic, bytes(m.payload), m.qos, bool(m.retain), bool(m.dup), m.mid, props))
            self.changed.notify_all()

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        with self.changed:
            self.acks[mid] = int(reason.value)
            self.changed.notify_all()

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, reason: Any, _p: Any) -> None:
        with self.changed:
            self.disconnected = True
            self.disconnect_reason = int(reason.value)
            self.changed.notify_all()

    def wait(self, condition: Callable[[Peer], bool], what: str, timeout: float = WAIT_S) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: condition(self), timeout), f"{what} not seen within {timeout} s"

    @property
    def accepted(self) -> bool:
        return self.connack is not None and self.connack[1] == "Success"

    def subscribe(self, *filters: tuple[str, Any], properties: Any = None) -> list[int]:
        """Subscribe and wait for the SUBACK; returns the granted QoS per filter (128: refused; MQTT 5: the
        reason code). A filter's second item: the QoS, or paho's SubscribeOptions (MQTT 5); ``properties``: the
        SUBSCRIBE's (MQTT 5: a subscription identifier)."""
        granted: list[int] = []
        done = threading.Event()

        def on_subscribe(_c: Any, _u: Any, _mid: int, codes: list[Any], _p: Any) -> None:
            granted.extend(c.value for c in codes)
            done.set()

        self.client.on_subscribe = on_subscribe
        result, _ = self.client.subscribe(list(filters), properties=properties)
        assert result == mqtt.MQTT_ERR_SUCCESS
        assert done.wait(WAIT_S), "no SUBACK"
        return granted

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties: Any = None) -> int:
        """Publish and wait for its acknowledgement; returns the PUBACK's reason code (MQTT 5; else 0)."""
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(WAIT_S)
        assert info.is_published(), f"{topic}: not acknowledged"
        with self.changed:
            return self.acks.get(info.mid, 0)

    def messages(self) -> list[Received]:
        with self.changed:
            return list(self.received)

    def payloads(self) -> list[bytes]:
        return [m.payload for m in self.messages()]

    def wait_count(self, count: int, timeout: float = WAIT_S) -> list[Received]:
        self.wait(lambda p: len(p.received) >= count, f"{count} messages (got {self.payloads()})", timeout)
        return self.messages()

    def quiet(self, seconds: float = 0.5) -> list[Received]:
        """What arrived after waiting ``seconds`` more (for 'nothing else comes')."""
        time.sleep(seconds)
        return self.messages()

    def disconnect(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def vanish(self) -> None:
        """Stop talking without DISCONNECT: the network loop ends, the socket stays open until the broker's
        keep-alive check (1.5 keep-alive periods) gives up on it."""
        self.client.loop_stop()
