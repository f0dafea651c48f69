"""What a session's delivery loop leased and had not yet written when the connection ended goes back to the
session's group: the reconnected session gets it at once (its lease is renewed while the session's consumer is
registered, so a lease left behind hid the message for up to ``--lease-renew-max-ms``, 3 hours), once the
retained messages in flight, sent again first, are acknowledged."""

from __future__ import annotations

import time

from raw_mqtt import Raw

from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import NONE
from lmq_broker.testing import BrokerProcess

LEASED_S = 0.5  # lets the loop lease the live message (ms); the outcome asserted holds whether it did or not


def test_a_message_leased_while_retained_ones_wait_for_room_comes_again_after_a_reconnect(
    broker: BrokerProcess,
) -> None:
    port = broker.mqtt_port
    publisher = Raw(port, "give-back-pub", codec.LEVEL_5)
    for packet_id in (1, 2, 3):
        publisher.send(codec.Publish(f"gb/r/{packet_id}", b"retained", qos=1, retain=True, packet_id=packet_id,
                                     properties=NONE))  # fmt: skip
        publisher.expect(codec.PUBACK, packet_id)
    session = Raw(port, "give-back-sub", codec.LEVEL_5, clean=False, receive_max=2)
    assert session.subscribe("gb/live", 1) == [1]
    # two retained messages fill the window (never PUBACKed); the third, and with it the live deliveries, wait
    session.send(codec.Subscribe(2, (("gb/r/#", 1),), NONE))
    assert [type(session.next()) for _ in range(3)] == [codec.SubAck, codec.Publish, codec.Publish]
    publisher.send(codec.Publish("gb/live", b"M", qos=1, packet_id=9, properties=NONE))
    publisher.expect(codec.PUBACK, 9)
    time.sleep(LEASED_S)
    session.close()  # the delivery loop stops holding M's lease

    again = Raw(port, "give-back-sub", codec.LEVEL_5, clean=False, receive_max=2, timeout_s=5)
    assert again.session_present
    resent = [again.next() for _ in range(2)]  # first the two retained ones in flight, again (MQTT-4.4.0-1)
    for p in resent:
        assert isinstance(p, codec.Publish) and (p.payload, p.dup, p.retain) == (b"retained", True, True), p
        assert p.packet_id is not None
        again.ack(codec.PUBACK, p.packet_id)  # room for M
    got = again.next()
    assert isinstance(got, codec.Publish) and (got.topic, got.payload, got.dup) == ("gb/live", b"M", True), got
    again.close()
    publisher.close()
