"""The MQTT listener's way into the cluster (``mqtt.owners.Owners``): publishes stored at their owners.

An MQTT publish (or will) read by any broker becomes the same ``SendMessage`` a RocketMQ producer's send would
be, handed to this broker's ``forwarding.Forwarder``: what this broker owns is stored here, the rest at its
owners (one hop, batched per owner), and the answer is per message. Only when every message is stored does
``store`` return, so the listener acknowledges (PUBACK, PUBREC) nothing that an owner did not store; an owner
that does not answer is ``errors.BrokerUnavailable`` ("nothing was stored, try again").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from google.protobuf import timestamp_pb2

from lmq_broker import errors, model
from lmq_broker.cluster.peers import Peers
from lmq_broker.protocol import status
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb


class MqttLink:
    """``mqtt.owners.Owners`` over this broker's peers; ``peers`` answers None while the broker runs alone."""

    def __init__(self, peers: Callable[[], Peers | None]) -> None:
        self._peers = peers

    @property
    def active(self) -> bool:
        return self._peers() is not None

    async def store(self, messages: Sequence[model.NewMessage]) -> None:
        peers = self._peers()
        if peers is None:
            raise errors.BrokerUnavailable("this broker left its cluster meanwhile; nothing was stored, try again")
        if not messages:
            return
        request = spb.SendMessageRequest(messages=[message_to_pb(m) for m in messages])
        reply = await peers.forwarder.send(request, peer_copy=False)
        if reply.status.code == pb.OK and len(reply.entries) == len(messages):
            return
        failed = next((e.status for e in reply.entries if e.status.code != pb.OK), reply.status)
        raise status.error_of(failed)  # a 5.0 publisher gets its reason code, or 0x80 and a close


def message_to_pb(m: model.NewMessage) -> pb.Message:
    """The v2 message a producer would have sent for ``m`` (a LITE message of an MQTT publish)."""
    born = timestamp_pb2.Timestamp(seconds=m.born_timestamp_ms // 1000, nanos=m.born_timestamp_ms % 1000 * 1_000_000)
    return pb.Message(
        topic=pb.Resource(name=m.topic),
        body=m.body,
        user_properties=m.user_properties,
        system_properties=pb.SystemProperties(
            message_id=m.message_id,
            message_type=pb.LITE,
            lite_topic=m.lite_topic or "",
            body_encoding=pb.IDENTITY,
            born_host=m.born_host,
            born_timestamp=born,
        ),
    )
