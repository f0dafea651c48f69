"""A shared subscription (MQTT 5.0 section 4.8.2) across a cluster of two broker processes (``--peers``), with
paho-mqtt 5.0: members connected to different brokers, publishes through both, topics whose first level names no
parent (the default parent's, docs/mqtt.md "Topic mapping"); each message reaches one member."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from paho.mqtt.enums import MQTTProtocolVersion
from testing_mqtt import Peer

from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, BrokerProcess, start_broker

V5 = MQTTProtocolVersion.MQTTv5


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[BrokerProcess]]:
    ports = free_ports("127.0.0.1", 2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    brokers: list[BrokerProcess] = []
    try:
        for i, port in enumerate(ports):
            args = ["--peers", peers, "--ordinal", str(i), "--mqtt-port", "0"]
            data = tmp_path_factory.mktemp(f"share-b{i}") / "data"
            brokers.append(start_broker(data, port=port, extra_args=args, env=SHARED_ADMIN_ENV))
        yield brokers
    finally:
        for broker in brokers:
            broker.stop()


def test_mqtt5_4_8_2_paho_members_on_two_brokers_share_the_messages(cluster: list[BrokerProcess]) -> None:
    """Section 4.8.2: each message the share's filter matches goes to one member, wherever it was published;
    the CONNACK says nothing of Shared Subscription Available (available, section 3.2.2.3.15); QoS 2 granted."""
    members = [Peer(b.mqtt_port, f"member-{i}", protocol=V5) for i, b in enumerate(cluster)]
    publishers = [Peer(b.mqtt_port, f"pub-{i}", protocol=V5) for i, b in enumerate(cluster)]
    try:
        for member in members:
            assert getattr(member.connack_properties, "SharedSubscriptionAvailable", None) is None
            assert member.subscribe(("$share/workers/sensors/#", 2)) == [2]
        sent = set()
        for n in range(40):
            topic, payload = f"sensors/room{n % 8}/temp", f"m{n}".encode()
            publishers[n % 2].publish(topic, payload, qos=1)
            sent.add((topic, payload))
        members[0].wait(lambda _: sum(len(m.messages()) for m in members) >= len(sent), "40 across the members")
        members[0].quiet(1.0)
        got = [(m.topic, m.payload) for member in members for m in member.messages()]
        assert sorted(got) == sorted(sent), "each message once, across the members"
    finally:
        for peer in [*members, *publishers]:
            peer.disconnect()
