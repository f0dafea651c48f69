"""Hostile or careless MQTT clients on raw sockets against a broker process: what they send is refused with
the specification's code, and what they leave unread is not kept for them without bound."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
from raw_mqtt import Raw
from raw_v2 import metric
from testing_mqtt import Peer
from waiting import eventually

from lmq_broker.mqtt import codec
from lmq_broker.mqtt.properties import NONE, Properties, Reason
from lmq_broker.testing import BrokerProcess

Connect = Callable[..., Peer]


def _connack(port: int, connect: codec.Connect) -> codec.Packet:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(codec.encode(connect))
        decoder = codec.Decoder(level=connect.level)
        while not (got := decoder.feed(sock.recv(65536))):
            pass
    return got[0]  # the socket closes unannounced: a will accepted would be published now


@pytest.mark.parametrize("topic", ["{}/w/#", "{}/+/x", "w/#"])
def test_mqtt_4_7_0_1_a_will_topic_with_a_wildcard_is_refused_and_never_published(
    broker: BrokerProcess, parent: str, connect: Connect, topic: str
) -> None:
    """MQTT-4.7.0-1: wildcards "MUST NOT be used within a Topic Name", and a will's topic is one: it is refused
    at CONNECT (5.0 ``0x90`` Topic Name invalid; 3.1.1 return code 5, as for any will never publishable)
    rather than accepted and, at the connection's end, published under a wildcard name that subscribers
    would receive (and, retained, every later subscriber)."""
    port, name = broker.mqtt_port, topic.format(parent)
    watcher = connect(port)
    assert watcher.subscribe((f"{parent}/#", 1), ("w/#", 1)) == [1, 1]
    will = codec.Will(name, b"bye", 1, True, NONE)
    answer = _connack(port, codec.Connect("will-5", will=will, level=codec.LEVEL_5, properties=NONE))
    assert isinstance(answer, codec.ConnAck) and answer.code == Reason.TOPIC_NAME_INVALID, answer
    answer = _connack(port, codec.Connect("will-3", will=codec.Will(name, b"bye", 1, True)))
    assert answer == codec.ConnAck(False, codec.ConnectCode.NOT_AUTHORIZED), answer
    watcher.publish(f"{parent}/w/mark", b"mark", qos=1)  # after the wills would have been published
    got = watcher.wait_count(1)
    assert [(m.topic, m.payload) for m in got] == [(f"{parent}/w/mark", b"mark")]


def _flood_unread(port: int, client_id: str, keep_alive_s: int, limit: int) -> tuple[socket.socket, int]:
    """A client that sends PINGREQs and never reads their PINGRESPs: (its socket, bytes sent until the broker
    stopped reading them or ended the connection, or ``limit``)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    sock.connect(("127.0.0.1", port))
    sock.sendall(codec.encode(codec.Connect(client_id, True, keep_alive_s)))
    sock.settimeout(3)
    pings, sent = bytes((codec.PINGREQ << 4, 0)) * 32768, 0
    try:
        while sent < limit:
            sock.sendall(pings)
            sent += len(pings)
    except (TimeoutError, ConnectionError):
        pass
    return sock, sent


def test_a_client_that_never_reads_its_answers_is_read_no_further_and_its_connection_ends(
    broker: BrokerProcess, connect: Connect
) -> None:
    """What the broker answers (PINGRESP here; PUBACK, SUBACK...) waits in the connection's write buffer until
    the client reads it. A client that keeps sending and never reads made that buffer grow without bound (300
    MiB of PINGREQs: the broker's RSS +294 MiB); now the broker stops reading it once 64 KiB of answers wait (the
    kernel's socket buffers hold the rest), its keep-alive runs meanwhile and ends it, and its client id can be
    taken over at once."""
    limit = 16 * 2**20
    sock, sent = _flood_unread(broker.mqtt_port, "never-reads", 60, limit)
    try:
        assert sent < limit, "the broker kept reading a client that reads nothing"
        newcomer = connect(broker.mqtt_port, "never-reads")  # MQTT-3.1.4-2: takes over the stuck connection
        assert newcomer.accepted, newcomer.connack
    finally:
        sock.close()
    sock, sent = _flood_unread(broker.mqtt_port, "never-reads-2", 2, limit)
    with sock:
        deadline = time.monotonic() + 20  # keep alive 2 s: ended within 3 s of the broker's last read
        sock.settimeout(1)
        ended = False
        while not ended and time.monotonic() < deadline:
            try:
                ended = not sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                ended = True
        assert ended, "the connection of a client that reads nothing was not ended by its keep-alive"


def test_a_slow_reader_taking_large_deliveries_is_kept_while_it_takes_them(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """The other side of the rule above: a subscriber on a slow link takes a backlog of large deliveries for
    longer than its keep-alive (1 s) while it sends PINGREQs. The broker reads it no further while more than 64
    KiB wait for it, but each bit it takes counts as alive: it is not ended, and it gets every message."""
    port, topic = broker.mqtt_port, f"{parent}/slow"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(10)
    decoder = codec.Decoder(level=codec.LEVEL_3_1_1)
    got: list[codec.Packet] = []

    def take(size: int) -> None:
        data = sock.recv(size)
        assert data, "the broker ended a client that was taking what it was sent"
        got.extend(decoder.feed(data))

    with sock:
        sock.sendall(codec.encode(codec.Connect("slow-reader", True, 1)))
        sock.sendall(codec.encode(codec.Subscribe(1, ((topic, 0),))))
        while not any(isinstance(p, codec.SubAck) for p in got):
            take(65536)
        publisher = connect(port)
        count, size = 6, 1024 * 1024
        sending = threading.Thread(
            target=lambda: [publisher.publish(topic, bytes([n]) * size, qos=1) for n in range(count)], daemon=True
        )
        sending.start()
        began = time.monotonic()
        while sum(isinstance(p, codec.Publish) for p in got) < count and time.monotonic() < began + 120:
            sock.sendall(bytes((codec.PINGREQ << 4, 0)))  # alive, as a client's keep-alive would say
            take(128 * 1024)
            time.sleep(0.02)  # at most 16 KiB a read (its receive buffer): the backlog takes several keep-alives
        sending.join(30)
        published = [p for p in got if isinstance(p, codec.Publish)]
        assert [(p.payload[:1], len(p.payload)) for p in published] == [(bytes([n]), size) for n in range(count)]
        assert time.monotonic() - began > 3, "taken faster than the keep-alive: nothing was tested"


def test_mqtt5_3_3_2_14_a_response_topic_with_a_wildcard_is_a_protocol_error_and_nothing_is_stored(
    broker: BrokerProcess, parent: str, connect: Connect
) -> None:
    """MQTT-3.3.2-14: "The Response Topic MUST NOT contain wildcard characters". A PUBLISH carrying one ends its
    connection with DISCONNECT ``0x82`` and is not stored, and a will carrying one is refused at CONNECT
    (``0x82``), instead of handing subscribers a response topic they cannot publish to."""
    port = broker.mqtt_port
    watcher = connect(port)
    assert watcher.subscribe((f"{parent}/r/+", 1)) == [1]
    wild = Properties(response_topic=f"{parent}/replies/#")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        decoder = codec.Decoder(level=codec.LEVEL_5)
        sock.sendall(codec.encode(codec.Connect("reply-wild", True, 30, level=codec.LEVEL_5, properties=NONE)))
        sock.sendall(codec.encode(codec.Publish(f"{parent}/r/a", b"ask", 1, packet_id=1, properties=wild)))
        got: list[codec.Packet] = []
        while data := sock.recv(65536):
            got += decoder.feed(data)
    assert [type(p) for p in got] == [codec.ConnAck, codec.Disconnect], got
    assert isinstance(got[1], codec.Disconnect) and got[1].reason == Reason.PROTOCOL_ERROR, got[1]
    will = codec.Will(f"{parent}/r/will", b"bye", 1, False, wild)
    answer = _connack(port, codec.Connect("will-reply-wild", will=will, level=codec.LEVEL_5, properties=NONE))
    assert isinstance(answer, codec.ConnAck) and answer.code == Reason.PROTOCOL_ERROR, answer
    watcher.publish(f"{parent}/r/mark", b"mark", qos=1)
    assert [(m.topic, m.payload) for m in watcher.wait_count(1)] == [(f"{parent}/r/mark", b"mark")]


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5])
def test_a_session_holds_at_most_1000_topic_filters_and_the_refusals_are_counted(
    broker: BrokerProcess, parent: str, level: int
) -> None:
    """One SUBSCRIBE of 1,001 filters: the first 1,000 are granted, the last is refused (5.0 ``0x97`` quota
    exceeded, 3.1.1 ``0x80``) and counted; a filter already held is still granted (docs/security.md)."""
    before = metric(broker, "lmq_mqtt_refused_total", reason="filters_per_client")
    client = Raw(broker.mqtt_port, f"many-filters-{level}", level)
    try:
        wanted = tuple((f"{parent}/f{level}/{i}", 1) for i in range(1001))
        client.send(codec.Subscribe(1, wanted, NONE if level == codec.LEVEL_5 else None))
        suback = client.next()
        assert isinstance(suback, codec.SubAck) and suback.codes[:1000] == (1,) * 1000, suback
        assert suback.codes[1000] == (Reason.QUOTA_EXCEEDED if level == codec.LEVEL_5 else codec.SUBACK_FAILURE)
        assert client.subscribe(f"{parent}/f{level}/0", 1) == [1]
    finally:
        client.close()
    assert metric(broker, "lmq_mqtt_refused_total", reason="filters_per_client") == before + 1


def test_a_subscribe_of_200000_filters_is_refused_past_what_a_session_may_hold_without_reading_them(
    broker: BrokerProcess, parent: str
) -> None:
    """One 3.6 MB SUBSCRIBE repeating a filter 200,000 times held the event loop (every client of the broker)
    for 2.2 s, granted each copy and queued a retained send for each. Filters past what a session may hold
    (1,000 filters and ``--mqtt-max-shares-per-client`` shares) are now refused ``0x97`` unread, and counted."""
    before = metric(broker, "lmq_mqtt_refused_total", reason="filters_per_client")
    client = Raw(broker.mqtt_port, "subscribe-flood", codec.LEVEL_5)
    try:
        client.send(codec.Subscribe(1, ((f"{parent}/flood/x", 1),) * 200_000, NONE))
        suback = client.next()
        assert isinstance(suback, codec.SubAck), suback
        assert suback.codes == (1,) * 1100 + (Reason.QUOTA_EXCEEDED,) * 198_900  # the broker's default caps
        assert client.subscribe(f"{parent}/flood/y", 1) == [1]  # the session holds 1 filter: it takes more
    finally:
        client.close()
    assert metric(broker, "lmq_mqtt_refused_total", reason="filters_per_client") == before + 198_900


def _pings(port: int, stop: threading.Event, gaps: list[float]) -> None:
    """Another client's PINGREQs, one at a time until ``stop``: how long each waited for its PINGRESP."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(codec.encode(codec.Connect("pings", True, 60)))
        sock.recv(4)  # CONNACK
        while not stop.is_set():
            began = time.monotonic()
            sock.sendall(codec.encode(codec.Bare(codec.PINGREQ)))
            assert sock.recv(2) == codec.PINGRESP_BYTES
            gaps.append(time.monotonic() - began)
            time.sleep(0.01)


def test_an_unsubscribe_of_500000_filters_leaves_other_clients_served_meanwhile(
    broker: BrokerProcess, parent: str
) -> None:
    """An UNSUBSCRIBE may name any number of filters (each is answered); 200,000 in one 3.4 MB packet held the
    event loop, every other client, for 1.6 s (500,000: ~4 s). It now lets the others in every 256 filters."""
    client = Raw(broker.mqtt_port, "unsubscribe-flood", codec.LEVEL_5)
    stop, gaps = threading.Event(), list[float]()
    pinging = threading.Thread(target=_pings, args=(broker.mqtt_port, stop, gaps))
    pinging.start()
    try:
        eventually(lambda: len(gaps) >= 5, "the other client pinging")
        client.send(codec.Unsubscribe(1, (f"{parent}/x",) * 500_000, NONE))
        unsuback = client.next()
        count = len(gaps)
        eventually(lambda: len(gaps) >= count + 5, "pings after the UNSUBACK")
    finally:
        stop.set()
        pinging.join()
        client.close()
    assert isinstance(unsuback, codec.UnsubAck) and unsuback.codes == (Reason.NO_SUBSCRIPTION_EXISTED,) * 500_000
    assert max(gaps) < 1.5, f"another client waited {max(gaps):.2f} s for its PINGRESP"
