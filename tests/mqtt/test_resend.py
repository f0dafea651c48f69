"""MQTT-4.4.0-1 (3.1.1 and 5.0 section 4.4): a resumed persistent session gets its unacknowledged PUBLISH
packets again "using their original Packet Identifiers", DUP set: QoS 1 deliveries without a PUBACK (their
messages handed out again) and retained messages sent at QoS 1 or 2 on SUBSCRIBE without their PUBACK or PUBREC
(kept in ``mqtt.sqlite3`` by the session: nothing else holds them). The first delivery of each test is
acknowledged so the one left owed is not the first packet id a new connection would give. Raw sockets speak
MQTT through our codec (a client library hides packet ids)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from raw_mqtt import Raw

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec, durable, releasing
from lmq_broker.mqtt.properties import NONE
from lmq_broker.testing import BrokerProcess, start_broker

LEVELS = pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5], ids=["3.1.1", "5.0"])


def new_parent(broker: BrokerProcess, name: str) -> str:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(name, model.MessageType.LITE))
    return name


def publish(raw: Raw, topic: str, payload: bytes, qos: int, packet_id: int, *, retain: bool = False) -> None:
    """One publish at ``qos`` (1 or 2), its flow complete."""
    raw.send(codec.Publish(topic, payload, qos, retain, packet_id=packet_id, properties=NONE if raw.v5 else None))
    if qos == 1:
        raw.expect(codec.PUBACK, packet_id)
        return
    raw.expect(codec.PUBREC, packet_id)
    raw.ack(codec.PUBREL, packet_id)
    raw.expect(codec.PUBCOMP, packet_id)


def settle(raw: Raw, got: codec.Publish) -> None:
    """The client acknowledges a delivery (QoS 2: the whole flow), and the broker has read it (a PINGRESP after)."""
    assert got.packet_id is not None
    if got.qos == 1:
        raw.ack(codec.PUBACK, got.packet_id)
    else:
        raw.ack(codec.PUBREC, got.packet_id)
        raw.expect(codec.PUBREL, got.packet_id)
        raw.ack(codec.PUBCOMP, got.packet_id)
    nothing_more(raw)


def nothing_more(raw: Raw) -> None:
    raw.send(codec.Bare(codec.PINGREQ))
    got = raw.next()
    assert got == codec.Bare(codec.PINGRESP), got


def publishes(raw: Raw, count: int) -> dict[bytes, codec.Publish]:
    """The next ``count`` packets, each a PUBLISH, by payload."""
    got = [raw.next() for _ in range(count)]
    assert all(isinstance(p, codec.Publish) for p in got), got
    return {p.payload: p for p in got if isinstance(p, codec.Publish)}


def end(broker: BrokerProcess, how: str, raw: Raw) -> BrokerProcess:
    """The connection lost (``reconnect``), or the broker stopped (``restart``) or killed (``kill -9``) and
    started again on its data."""
    if how == "kill -9":
        broker.kill()
    raw.close()
    if how == "reconnect":
        return broker
    if how == "restart":
        assert broker.stop() == 0, broker.log()[-4000:]
    return start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(broker.mqtt_port)])


@LEVELS
@pytest.mark.parametrize(
    ("qos", "how"), [(1, "reconnect"), (1, "restart"), (1, "kill -9"), (2, "reconnect"), (2, "kill -9")]
)
def test_4_4_a_delivery_without_its_ack_is_sent_again_under_its_original_packet_id(
    tmp_path: Path, level: int, qos: int, how: str
) -> None:
    """A QoS 1 delivery without its PUBACK, a QoS 2 one without its PUBREC, comes again after a reconnect (and
    after a broker restart) under the packet id it had, DUP set: a client that took it (its answer lost with the
    connection) knows it by that id and does not pass it on twice. Its acknowledgement by that id settles it: the
    next reconnect gets nothing. Its id is recorded before it is written, so it survives a kill -9 too (a QoS 1
    one's was recorded as its connection ended: after a kill -9 it came again under a new id)."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = new_parent(broker, "R")
        port = broker.mqtt_port
        sub = Raw(port, "owed", level=level, clean=False)
        assert sub.subscribe(f"{parent}/o", qos) == [qos]
        pub = Raw(port, "owed-pub", level=level)
        for packet_id, body in ((1, b"done"), (2, b"owed")):
            publish(pub, f"{parent}/o", body, qos, packet_id)
        pub.close()
        got = publishes(sub, 2)
        done, owed = got[b"done"], got[b"owed"]
        assert owed.packet_id is not None and owed.packet_id != done.packet_id
        settle(sub, done)
        broker = end(broker, how, sub)
        back = Raw(port, "owed", level=level, clean=False)
        assert back.session_present
        again = back.next()
        assert isinstance(again, codec.Publish), again
        assert (again.payload, again.qos, again.dup, again.packet_id) == (b"owed", qos, True, owed.packet_id), again
        settle(back, again)
        back.close()
        last = Raw(port, "owed", level=level, clean=False)
        nothing_more(last)  # acknowledged by its original id: settled, not sent a third time
        last.close()
    finally:
        broker.stop()


@LEVELS
@pytest.mark.parametrize("qos", [1, 2])
def test_4_4_a_retained_message_without_its_ack_is_sent_again_under_its_original_packet_id(
    broker: BrokerProcess, parent: str, level: int, qos: int
) -> None:
    """A retained message sent at QoS 1 or 2 on SUBSCRIBE and not acknowledged (no PUBACK, no PUBREC) when the
    connection ends is sent again right after the resumed session's CONNACK, under its packet id, DUP and RETAIN
    set; acknowledged, it is not sent again. (It was lost: nothing kept a retained delivery in flight.)"""
    topic = f"{parent}/ret{qos}{level}"
    pub = Raw(broker.mqtt_port, f"ret-pub-{qos}-{level}", level=level)
    for packet_id, name in ((1, "a"), (2, "b")):
        publish(pub, f"{topic}/{name}", name.encode(), qos, packet_id, retain=True)
    pub.close()
    client = f"ret-sub-{qos}-{level}"
    sub = Raw(broker.mqtt_port, client, level=level, clean=False)
    assert sub.subscribe(f"{topic}/+", qos) == [qos]
    got = publishes(sub, 2)
    done, owed = got[b"a"], got[b"b"]
    assert (owed.qos, owed.retain) == (qos, True) and owed.packet_id != done.packet_id, got
    settle(sub, done)
    sub.close()
    back = Raw(broker.mqtt_port, client, level=level, clean=False)
    assert back.session_present
    again = back.next()
    assert isinstance(again, codec.Publish), again
    seen = (again.payload, again.qos, again.dup, again.retain, again.packet_id)
    assert seen == (b"b", qos, True, True, owed.packet_id), again
    if level == codec.LEVEL_5:  # the topic itself or an alias bound on this connection: sent with its name
        assert again.topic == f"{topic}/b", again
    settle(back, again)
    back.close()
    last = Raw(broker.mqtt_port, client, level=level, clean=False)
    nothing_more(last)
    last.close()


@pytest.mark.parametrize("how", ["restart", "kill -9"])
def test_4_4_a_retained_message_without_its_ack_is_sent_again_after_a_broker_restart(tmp_path: Path, how: str) -> None:
    """The retained delivery in flight is kept in ``mqtt.sqlite3`` before it is written: a broker stopped (or
    killed) and started again sends it too, under its packet id; a PUBREC by that id moves it on to PUBREL as any
    other. (Killed, it was lost: the row was written only as the connection ended.)"""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        parent = new_parent(broker, "S")
        port = broker.mqtt_port
        pub = Raw(port, "kept-pub")
        for packet_id, name in ((1, "a"), (2, "b")):
            publish(pub, f"{parent}/k/{name}", name.encode(), 2, packet_id, retain=True)
        pub.close()
        sub = Raw(port, "kept-sub", clean=False)
        assert sub.subscribe(f"{parent}/k/+", 2) == [2]
        got = publishes(sub, 2)
        settle(sub, got[b"a"])
        owed = got[b"b"]
        broker = end(broker, how, sub)
        back = Raw(port, "kept-sub", clean=False)
        again = back.next()
        assert isinstance(again, codec.Publish), again
        assert (again.payload, again.dup, again.retain, again.packet_id) == (b"b", True, True, owed.packet_id), again
        assert again.packet_id is not None
        back.ack(codec.PUBREC, again.packet_id)
        back.expect(codec.PUBREL, again.packet_id)
        back.close()  # PUBCOMP lost: the PUBREL comes again, not the PUBLISH
        once_more = Raw(port, "kept-sub", clean=False)
        once_more.expect(codec.PUBREL, again.packet_id)
        once_more.ack(codec.PUBCOMP, again.packet_id)
        nothing_more(once_more)
        once_more.close()
        last = Raw(port, "kept-sub", clean=False)
        nothing_more(last)
        last.close()
    finally:
        broker.stop()


def test_mqtt5_3_3_4_retained_messages_sent_again_keep_within_the_receive_maximum_of_now(
    broker: BrokerProcess, parent: str
) -> None:
    """MQTT-3.3.4-9: four retained messages in flight when the connection ended, the session resumed with a
    Receive Maximum of 2: two come again after the CONNACK, the next one only once one of those is acknowledged
    (they all came at once before, over the client's maximum)."""
    topic = f"{parent}/rm"
    pub = Raw(broker.mqtt_port, "rm-pub", level=codec.LEVEL_5)
    for packet_id, name in enumerate("abcd", start=1):
        publish(pub, f"{topic}/{name}", name.encode(), 1, packet_id, retain=True)
    pub.close()
    sub = Raw(broker.mqtt_port, "rm-sub", level=codec.LEVEL_5, clean=False)
    assert sub.subscribe(f"{topic}/+", 1) == [1]
    first = publishes(sub, 4)
    sub.close()  # none acknowledged
    back = Raw(broker.mqtt_port, "rm-sub", level=codec.LEVEL_5, clean=False, receive_max=2)
    again = [back.next() for _ in range(2)]
    assert all(isinstance(p, codec.Publish) and p.dup for p in again), again
    nothing_more(back)  # no third before an acknowledgement
    one = again[0]
    assert isinstance(one, codec.Publish) and one.packet_id is not None
    back.ack(codec.PUBACK, one.packet_id)
    third = back.next()
    assert isinstance(third, codec.Publish) and third.dup, third
    nothing_more(back)
    seen = [p for p in (*again, third) if isinstance(p, codec.Publish)]
    for p in seen:
        assert p.packet_id == first[p.payload].packet_id, p
    for p in seen[1:]:
        assert p.packet_id is not None
        back.ack(codec.PUBACK, p.packet_id)
    last = back.next()
    assert isinstance(last, codec.Publish) and last.payload not in {p.payload for p in seen}, last
    assert last.packet_id == first[last.payload].packet_id
    settle(back, last)
    back.close()


def test_a_late_forget_of_a_packet_ids_old_row_keeps_the_row_of_the_delivery_that_took_the_id_since(
    tmp_path: Path,
) -> None:
    """The rows of acknowledged deliveries are forgotten with a later write (``Deliveries.unkept``), and two delivery
    loops' writes may reach the store in either order: the old row's deletion names its message, so the row of a
    new delivery under the same packet id, written first, stays. Those unsynced writes (QoS 1) leave
    ``changes`` as it was (replication copies them with the next other change); a QoS 2 one's counts."""
    rows = durable.Durable(tmp_path)
    rows.qos2_promise("c", durable.PUBLISHED, [(5, "old")], [], lasting=False)
    before = rows.changes()
    rows.qos2_promise("c", durable.PUBLISHED, [(5, "new")], [], lasting=False)  # over the old row
    rows.qos2_promise("c", durable.PUBLISHED, [], [(durable.PUBLISHED, 5, "old")], lasting=False)  # late
    assert rows.qos2_ids("c", durable.PUBLISHED) == {5: "new"}
    assert rows.changes() == before
    rows.qos2_promise("c", durable.PUBLISHED, [(6, "two")], [(durable.PUBLISHED, 5, "new")], lasting=True)
    assert rows.qos2_ids("c", durable.PUBLISHED) == {6: "two"}
    assert rows.changes() > before
    rows.close()


def test_a_resumed_session_over_its_1024_owed_ids_drops_qos1_rows_before_a_qos2_delivery_still_owed(
    tmp_path: Path,
) -> None:
    """Rows of acknowledged QoS 1 deliveries are deleted with the next write, so each kill -9 can leave a window of
    them behind, never removed but by the 1,024 cap of a resumed session. That cap used to drop the lowest packet
    ids, whatever their QoS: a QoS 2 delivery still owed (no PUBREC), under a low id after the ids wrapped, lost
    its row, and its message came again under a new id, which the client takes as a new message (exactly once
    broken). QoS 1 rows go first now (red-team review)."""
    rows = durable.Durable(tmp_path)
    stale = [(packet_id, f"acked-{packet_id}") for packet_id in range(100, 100 + releasing.MAX_PROMISED)]
    rows.qos2_promise("c", durable.PUBLISHED, stale, [], lasting=False, qos1={i for i, _ in stale})
    rows.qos2_promise("c", durable.PUBLISHED, [(3, "owed-qos2")], [], lasting=True)
    deliveries = SimpleNamespace(out={}, promised={})

    async def run(fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        return fn(*args, **kwargs)

    link = SimpleNamespace(client_id="c", dispatcher=SimpleNamespace(run=run), host=SimpleNamespace(durable=rows))
    asyncio.run(releasing.Releases(link, deliveries).resume())  # type: ignore[arg-type]
    assert deliveries.promised.get("owed-qos2") == 3
    assert len(deliveries.promised) == releasing.MAX_PROMISED
    assert len(rows.qos2_ids("c", durable.PUBLISHED)) == releasing.MAX_PROMISED
    rows.close()
