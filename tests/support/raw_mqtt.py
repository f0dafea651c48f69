"""An MQTT client on a raw socket, packets built and read by lmq's own codec: it sends exactly what a test says
(a resend with DUP, a PUBREL withheld) and reads the broker's packets one by one."""

from __future__ import annotations

import socket

from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import NONE, Properties

FOREVER = 0xFFFFFFFF  # a 5.0 session that never expires


class Raw:
    """Connected (CONNACK 0 asserted) on creation; ``session_present`` is the CONNACK's."""

    def __init__(
        self,
        port: int,
        client_id: str,
        level: int = codec.LEVEL_3_1_1,
        *,
        clean: bool = True,
        timeout_s: float = 15,
        receive_max: int | None = None,
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.decoder = codec.Decoder(level=level)
        self.pending: list[codec.Packet] = []
        self.v5 = level == codec.LEVEL_5
        props = Properties(session_expiry_s=0 if clean else FOREVER, receive_max=receive_max) if self.v5 else None
        self.send(codec.Connect(client_id, clean, 60, level=level, properties=props))
        connack = self.next()
        assert isinstance(connack, codec.ConnAck) and connack.code == 0, connack
        self.session_present = connack.session_present

    def send(self, packet: codec.Packet) -> None:
        self.sock.sendall(codec.encode(packet))

    def next(self) -> codec.Packet:
        while not self.pending:
            data = self.sock.recv(65536)
            assert data, "the broker closed the connection"
            self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    def ack(self, kind: int, packet_id: int, reason: int = 0) -> None:
        self.send(codec.PacketId(kind, packet_id, reason, NONE if self.v5 else None))

    def expect(self, kind: int, packet_id: int, reason: int = 0) -> None:
        got = self.next()
        assert isinstance(got, codec.PacketId) and (got.kind, got.packet_id, got.reason) == (kind, packet_id, reason), (
            got
        )

    def publish(self, topic: str, payload: bytes, packet_id: int, *, dup: bool = False) -> None:
        """At QoS 2; its answers are the test's to read."""
        props = NONE if self.v5 else None
        self.send(codec.Publish(topic, payload, qos=2, dup=dup, packet_id=packet_id, properties=props))

    def published(self, topic: str, payload: bytes, packet_id: int) -> None:
        """At QoS 2, its flow complete."""
        self.publish(topic, payload, packet_id)
        self.expect(codec.PUBREC, packet_id)
        self.ack(codec.PUBREL, packet_id)
        self.expect(codec.PUBCOMP, packet_id)

    def subscribe(self, topic_filter: str, qos: int) -> list[int]:
        self.send(codec.Subscribe(1, ((topic_filter, qos),), NONE if self.v5 else None))
        suback = self.next()
        assert isinstance(suback, codec.SubAck), suback
        return list(suback.codes)

    def closed(self) -> bool:
        """True once the broker has closed the connection (what it sent before is kept in ``pending``)."""
        while data := self.sock.recv(65536):
            self.pending += self.decoder.feed(data)
        self.sock.close()
        return True

    def close(self) -> None:
        self.sock.close()
