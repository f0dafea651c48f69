"""What one MQTT client may hold of a broker (docs/security.md "Resource caps"): sockets in all and per client
address, a will's size and delay; each refused with its reason code and counted; and the memory floods of
issue 26 (oversized CONNECTs, retained sets sent to clients that never read) kept bounded."""

from __future__ import annotations

import contextlib
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import psutil
import pytest

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec, wire
from lmq_broker.mqtt.properties import Properties, Reason
from lmq_broker.testing import BrokerProcess, start_broker

MiB: Final = 1024 * 1024
WAIT_S: Final = 15.0
CAPS: Final = [
    "--mqtt-port", "0",
    "--mqtt-max-connections", "6",
    "--mqtt-max-connections-per-address", "4",
    "--mqtt-max-will-bytes", "1024",
    "--mqtt-max-will-delay-s", "100",
    "--mqtt-max-read-bytes", str(300 * 1024),
]  # fmt: skip


@pytest.fixture(scope="module")
def broker_with_caps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("caps") / "data", extra_args=CAPS)
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture
def capped(broker_with_caps: BrokerProcess) -> BrokerProcess:
    """The capped broker once the sockets of the tests before are all closed there (each starts with none)."""
    eventually(lambda: gauge(broker_with_caps, "lmq_mqtt_sockets") == 0, "the earlier sockets closed")
    return broker_with_caps


def metric(broker: BrokerProcess, name: str, label: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^{name}\{{\w+="{label}"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"{name}{{{label}}} not exported"
    return float(found.group(1))


def gauge(broker: BrokerProcess, name: str) -> float:
    with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not exported"
    return float(found.group(1))


def eventually(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout} s"
        time.sleep(0.05)


def dial(broker: BrokerProcess, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", broker.mqtt_port), timeout=WAIT_S, source_address=(source, 0))
    return sock


def read_packet(sock: socket.socket, level: int = codec.LEVEL_3_1_1) -> codec.Packet | None:
    """The next packet the broker sent; None when it closed the socket instead (a reset too: closed with
    bytes it never read)."""
    try:
        head = sock.recv(1)
    except ConnectionResetError:
        return None
    if not head:
        return None
    length, shift = 0, 0
    while True:
        digit = sock.recv(1)[0]
        length |= (digit & 0x7F) << shift
        shift += 7
        if not digit & 0x80:
            break
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        assert chunk, "closed inside a packet"
        body += chunk
    return codec.decode_packet(head[0], body, level)


def connack(sock: socket.socket, connect: codec.Connect) -> codec.ConnAck | None:
    sock.sendall(codec.encode(connect))
    answer = read_packet(sock, connect.level)
    assert answer is None or isinstance(answer, codec.ConnAck), answer
    return answer


def v5(client_id: str, **fields: object) -> codec.Connect:
    props = fields.pop("properties", Properties())
    assert isinstance(props, Properties)
    return codec.Connect(client_id, level=codec.LEVEL_5, properties=props, **fields)  # type: ignore[arg-type]


def parent_of(broker: BrokerProcess, name: str) -> str:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(name, model.MessageType.LITE))
    return name


def test_sockets_over_the_caps_are_refused_with_their_reason_code_and_counted(capped: BrokerProcess) -> None:
    held = [dial(capped) for _ in range(4)]  # --mqtt-max-connections-per-address 4
    for i, sock in enumerate(held):
        answer = connack(sock, codec.Connect(f"a{i}"))
        assert answer is not None and answer.code == codec.ConnectCode.ACCEPTED
    with dial(capped) as fifth:  # 3.1.1: 0x03 server unavailable
        answer = connack(fifth, codec.Connect("a-over"))
        assert answer is not None and answer.code == codec.ConnectCode.SERVER_UNAVAILABLE
        assert read_packet(fifth) is None, "the refused socket stays open"
    with dial(capped) as sixth:  # 5.0: 0x97 quota exceeded, and why
        answer = connack(sixth, v5("a-over-5"))
        assert answer is not None and answer.code == Reason.QUOTA_EXCEEDED
        assert answer.properties is not None and "per-address" in (answer.properties.reason_string or "")
    others = [dial(capped, "127.0.0.2") for _ in range(2)]  # another address: up to --mqtt-max-connections 6
    for i, sock in enumerate(others):
        answer = connack(sock, codec.Connect(f"b{i}"))
        assert answer is not None and answer.code == codec.ConnectCode.ACCEPTED
    with dial(capped, "127.0.0.3") as seventh:
        answer = connack(seventh, v5("c-over"))
        assert answer is not None and answer.code == Reason.QUOTA_EXCEEDED
    assert metric(capped, "lmq_mqtt_refused_total", "connections_per_address") == 2
    assert metric(capped, "lmq_mqtt_refused_total", "connections") == 1
    held.pop().close()  # a socket closed gives its place back

    def accepted_again() -> bool:
        with dial(capped) as sock:
            answer = connack(sock, codec.Connect("a-again"))
            return answer is not None and answer.code == codec.ConnectCode.ACCEPTED

    eventually(accepted_again, "a socket accepted once one closed")
    for sock in held + others:
        sock.close()


def test_sockets_past_the_refusals_under_way_are_closed_unanswered(capped: BrokerProcess) -> None:
    held = [dial(capped) for _ in range(4)]
    for i, sock in enumerate(held):
        answer = connack(sock, codec.Connect(f"u{i}"))
        assert answer is not None and answer.code == codec.ConnectCode.ACCEPTED
    before = metric(capped, "lmq_mqtt_refused_total", "unanswered")
    refused = metric(capped, "lmq_mqtt_refused_total", "connections_per_address")
    silent = [dial(capped) for _ in range(64)]  # over the cap, saying nothing: each a refusal under way (2 s)
    try:
        eventually(
            lambda: metric(capped, "lmq_mqtt_refused_total", "connections_per_address") == refused + 64,
            "64 refusals under way",
        )
        with dial(capped) as late:
            late.sendall(codec.encode(codec.Connect("late")))
            assert read_packet(late) is None, "answered while 64 refusals were under way"
        assert metric(capped, "lmq_mqtt_refused_total", "unanswered") > before
    finally:
        for sock in silent + held:
            sock.close()


def test_a_will_over_the_caps_is_refused_with_its_reason_code(capped: BrokerProcess) -> None:
    parent = parent_of(capped, "Pwill")
    big = codec.Will(f"{parent}/w", b"x" * 2000, 1, False, Properties())
    with dial(capped) as sock:
        answer = connack(sock, v5("big-will", will=big))
        assert answer is not None and answer.code == Reason.PACKET_TOO_LARGE
    with dial(capped) as sock:  # 3.1.1 has no such code: not authorized, as for a will never publishable
        answer = connack(sock, codec.Connect("big-will-3", will=codec.Will(f"{parent}/w", b"x" * 2000, 1, False)))
        assert answer is not None and answer.code == codec.ConnectCode.NOT_AUTHORIZED
    late = codec.Will(f"{parent}/w", b"bye", 1, False, Properties(will_delay_s=101))
    with dial(capped) as sock:
        answer = connack(sock, v5("late-will", will=late, properties=Properties(session_expiry_s=1000)))
        assert answer is not None and answer.code == Reason.QUOTA_EXCEEDED
    assert metric(capped, "lmq_mqtt_refused_total", "will_bytes") == 2
    assert metric(capped, "lmq_mqtt_refused_total", "will_delay") == 1
    ok = codec.Will(f"{parent}/w", b"x" * 900, 1, False, Properties(will_delay_s=100))
    with dial(capped) as sock:
        answer = connack(sock, v5("fine-will", will=ok, properties=Properties(session_expiry_s=1000)))
        assert answer is not None and answer.code == Reason.SUCCESS
        sock.sendall(codec.encode_disconnect())


def test_a_connect_announced_over_its_limit_is_refused_before_its_body_is_read(capped: BrokerProcess) -> None:
    before = metric(capped, "lmq_mqtt_refused_total", "connect_too_large")
    with dial(capped) as sock:  # 4 MiB announced, 7 bytes sent: answered at once, nothing more awaited
        sock.sendall(bytes((codec.CONNECT << 4,)) + wire.varint(4 * MiB) + b"\x00\x04MQTT\x05")
        answer = read_packet(sock, codec.LEVEL_5)
        assert isinstance(answer, codec.ConnAck) and answer.code == Reason.PACKET_TOO_LARGE
        assert read_packet(sock) is None
    assert metric(capped, "lmq_mqtt_refused_total", "connect_too_large") == before + 1


def test_a_large_packet_over_what_all_connections_may_be_reading_is_refused(capped: BrokerProcess) -> None:
    parent = parent_of(capped, "Pread")
    body = bytes(200 * 1024)  # two of them do not fit --mqtt-max-read-bytes 300 KiB
    first = codec.encode_publish(f"{parent}/big", body, 1, 1, props=b"\x00")
    with dial(capped) as slow, dial(capped) as other:
        assert connack(slow, v5("slow")) is not None and connack(other, v5("other")) is not None
        slow.sendall(first[: len(first) // 2])  # half of it: its 200 KiB are being read
        before = metric(capped, "lmq_mqtt_refused_total", "read_bytes")
        eventually(lambda: gauge(capped, "lmq_mqtt_read_bytes") > 0, "the first packet being read")
        other.sendall(codec.encode_publish(f"{parent}/big2", body, 1, 1, props=b"\x00")[:1024])
        refusal = read_packet(other, codec.LEVEL_5)
        assert isinstance(refusal, codec.Disconnect) and refusal.reason == Reason.QUOTA_EXCEEDED, refusal
        assert metric(capped, "lmq_mqtt_refused_total", "read_bytes") == before + 1
        slow.sendall(first[len(first) // 2 :])  # the first one, finished, is stored
        ack = read_packet(slow, codec.LEVEL_5)
        assert isinstance(ack, codec.PacketId) and ack.kind == codec.PUBACK and ack.reason == Reason.SUCCESS, ack


def test_keep_alive_counts_a_large_packet_s_bytes_and_ends_a_silent_client(capped: BrokerProcess) -> None:
    parent = parent_of(capped, "Palive")
    data = codec.encode_publish(f"{parent}/slow", bytes(200 * 1024), 1, 1, props=b"\x00")
    with dial(capped) as slow:  # keep-alive 1 s: 1.5 s without a packet ends it
        assert connack(slow, v5("slow-but-steady", keep_alive_s=1)) is not None
        for i in range(5):  # 2.4 s for one packet, a piece every 0.6 s: alive all along
            slow.sendall(data[i * len(data) // 5 : (i + 1) * len(data) // 5])
            if i < 4:
                time.sleep(0.6)
        ack = read_packet(slow, codec.LEVEL_5)
        assert isinstance(ack, codec.PacketId) and ack.reason == Reason.SUCCESS, ack
        started = time.monotonic()
        refusal = read_packet(slow, codec.LEVEL_5)  # then silence
        assert isinstance(refusal, codec.Disconnect) and refusal.reason == Reason.KEEP_ALIVE_TIMEOUT, refusal
        assert 1.0 < time.monotonic() - started < 4.0  # 1.5 s from the read after the PUBLISH began


def rss(broker: BrokerProcess) -> int:
    return int(psutil.Process(broker.pid).memory_info().rss)


def watch_peak(broker: BrokerProcess, seconds: float) -> int:
    """The highest RSS seen over ``seconds`` (a measurement window: the flood's cost peaks in it)."""
    peak, deadline = rss(broker), time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, rss(broker))
        time.sleep(0.05)
    return peak


def test_floods_leave_the_broker_s_memory_bounded(tmp_path: Path) -> None:
    """20 sockets each announcing a 4 MiB CONNECT and sending 1 MiB of it; then 10 subscribers that never
    read a 8 MiB retained set: before, each cost what it announced or matched (~20 MiB, ~80 MiB)."""
    with start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"]) as broker:
        parent = parent_of(broker, "Pflood")
        with dial(broker) as publisher:
            assert connack(publisher, codec.Connect("retainer")) is not None
            for i in range(32):  # 32 x 256 KiB retained
                publisher.sendall(codec.encode_publish(f"{parent}/r{i:02}", bytes(256 * 1024), 1, i + 1, retain=True))
            for _ in range(32):
                assert isinstance(read_packet(publisher), codec.PacketId)
        before = rss(broker)
        flood = [dial(broker) for _ in range(20)]
        for sock in flood:
            with contextlib.suppress(ConnectionError):  # refused at its header, while it was still sending
                sock.sendall(bytes((codec.CONNECT << 4,)) + wire.varint(4 * MiB) + bytes(MiB))
        peak = watch_peak(broker, 1.0)
        for sock in flood:
            sock.close()
        subscribers = []
        for i in range(10):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)  # the kernel holds little for it
            sock.connect(("127.0.0.1", broker.mqtt_port))
            assert connack(sock, codec.Connect(f"never-reads-{i}")) is not None
            sock.sendall(codec.encode(codec.Subscribe(1, ((f"{parent}/#", 0),))))
            subscribers.append(sock)
        peak = max(peak, watch_peak(broker, 3.0))  # time to queue what it would (before: all of it at once)
        for sock in subscribers:
            sock.close()
        assert broker.alive()
    growth_mib = (peak - before) / MiB
    assert growth_mib < 30, f"RSS grew {growth_mib:.0f} MiB under the floods"
