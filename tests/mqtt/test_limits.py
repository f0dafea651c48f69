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
from lmq_broker.mqtt import codec, durable, wire
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


def persistent(client_id: str, level: int = codec.LEVEL_3_1_1, expiry_s: int = 3600) -> codec.Connect:
    """A CONNECT that makes or resumes a persistent session (3.1.1: clean session 0; 5.0: an expiry above 0)."""
    if level == codec.LEVEL_5:
        return v5(client_id, clean_session=False, properties=Properties(session_expiry_s=expiry_s))
    return codec.Connect(client_id, clean_session=False)


def session(broker: BrokerProcess, connect: codec.Connect, source: str = "127.0.0.1") -> codec.ConnAck:
    """``connect``'s CONNACK; the connection then ends with a DISCONNECT (a persistent session stays)."""
    with dial(broker, source) as sock:
        answer = connack(sock, connect)
        assert answer is not None
        if answer.code == 0:
            sock.sendall(codec.encode_disconnect())
        return answer


def test_persistent_sessions_past_the_cap_are_refused_and_resuming_one_never_is(tmp_path: Path) -> None:
    """``--mqtt-max-sessions``: a client making ever new persistent sessions (ever new client ids, each left
    behind in mqtt.sqlite3) is refused the one past the cap (5.0: 0x97 and why; 3.1.1: 0x03) and counted; a
    clean session, a resumed or replaced one are not; a session ended frees its place. Before the cap there was
    none: every CONNECT below was accepted."""
    args = ["--mqtt-port", "0", "--mqtt-max-sessions", "3"]
    with start_broker(tmp_path / "data", extra_args=args) as broker:
        assert session(broker, persistent("s1")).code == 0
        assert session(broker, persistent("s2", codec.LEVEL_5)).code == 0
        assert session(broker, persistent("s3", codec.LEVEL_5, expiry_s=0xFFFFFFFF)).code == 0
        refused = session(broker, persistent("s4"))
        assert refused == codec.ConnAck(False, codec.ConnectCode.SERVER_UNAVAILABLE), refused
        refused = session(broker, persistent("s5", codec.LEVEL_5))
        assert refused.code == Reason.QUOTA_EXCEEDED, refused
        assert refused.properties is not None and "--mqtt-max-sessions" in (refused.properties.reason_string or "")
        assert metric(broker, "lmq_mqtt_refused_total", "sessions") == 2
        assert session(broker, codec.Connect("clean")).code == 0  # a clean session leaves nothing behind
        assert session(broker, v5("clean-5")).code == 0
        resumed = session(broker, persistent("s1"))  # resumed: never refused
        assert resumed == codec.ConnAck(True, codec.ConnectCode.ACCEPTED), resumed
        replaced = session(broker, v5("s2", clean_session=True, properties=Properties(session_expiry_s=60)))
        assert replaced.code == Reason.SUCCESS and not replaced.session_present  # clean start: a new one, in its place
        ended = session(broker, v5("s2", clean_session=False))  # resumed with expiry 0: it ends with this connection
        assert ended.code == Reason.SUCCESS and ended.session_present, ended
        assert session(broker, persistent("s4")).code == codec.ConnectCode.ACCEPTED  # its place
        assert session(broker, persistent("s6", codec.LEVEL_5)).code == Reason.QUOTA_EXCEEDED
        assert metric(broker, "lmq_mqtt_refused_total", "sessions") == 3


def test_a_persistent_session_outlives_its_connection_at_most_the_max_session_expiry(tmp_path: Path) -> None:
    """``--mqtt-max-session-expiry-s``: a 3.1.1 persistent session (3.1.1 has no expiry) and a 5.0 one asking
    never (0xFFFFFFFF) or more expire after it; a 5.0 client is told so in its CONNACK (5.0 section 3.2.2.3.2),
    one asking less is told nothing. Before, both lived for ever: a reconnect found them present."""
    args = ["--mqtt-port", "0", "--mqtt-max-session-expiry-s", "2"]
    with start_broker(tmp_path / "data", extra_args=args) as broker:
        forever = session(broker, persistent("never-5", codec.LEVEL_5, expiry_s=0xFFFFFFFF))
        assert forever.code == Reason.SUCCESS and forever.properties is not None
        assert forever.properties.session_expiry_s == 2, forever
        shorter = session(broker, persistent("short-5", codec.LEVEL_5, expiry_s=1))
        assert shorter.properties is not None and shorter.properties.session_expiry_s is None, shorter
        assert session(broker, persistent("old-3")) == codec.ConnAck(False, codec.ConnectCode.ACCEPTED)
        assert session(broker, persistent("old-3")).session_present  # within its 2 s
        time.sleep(2.5)  # the 2 s from the last connection's end, and a margin
        assert session(broker, persistent("old-3")) == codec.ConnAck(False, codec.ConnectCode.ACCEPTED)
        again = session(broker, persistent("never-5", codec.LEVEL_5, expiry_s=0xFFFFFFFF))
        assert again.code == Reason.SUCCESS and not again.session_present, again


READ_CAPS: Final = [
    "--mqtt-port", "0",
    "--mqtt-max-read-bytes", str(MiB),
    "--mqtt-max-read-bytes-per-address", str(600 * 1024),
    "--mqtt-min-read-rate", str(32 * 1024),
]  # fmt: skip


def begin_large(broker: BrokerProcess, source: str, client_id: str, topic: str, sent: int) -> socket.socket:
    """A connection from ``source`` that began a 256 KiB publish (``sent`` bytes of it) and leaves it there."""
    sock = dial(broker, source)
    assert connack(sock, v5(client_id)) is not None
    sock.sendall(codec.encode_publish(topic, bytes(256 * 1024), 1, 1, props=b"\x00")[:sent])
    return sock


def test_one_address_holds_at_most_its_share_of_the_large_packets_being_read(tmp_path: Path) -> None:
    """A hostile address opening connections that each announce a large packet and send a trickle of it held
    the whole --mqtt-max-read-bytes before (every other client's large publish refused, DISCONNECT 0x97): now it
    holds --mqtt-max-read-bytes-per-address (600 KiB: two 256 KiB packets), its next one is refused so and
    counted, and another address's large publish is read and stored meanwhile."""
    with start_broker(tmp_path / "data", extra_args=READ_CAPS) as broker:
        parent = parent_of(broker, "Pshare")
        held = [begin_large(broker, "127.0.0.2", f"h{i}", f"{parent}/h", 1024) for i in range(2)]
        try:
            eventually(lambda: gauge(broker, "lmq_mqtt_read_bytes") > 500 * 1024, "two packets being read")
            for i in range(2, 4):
                with begin_large(broker, "127.0.0.2", f"h{i}", f"{parent}/h", 1024) as over:
                    refusal = read_packet(over, codec.LEVEL_5)
                    assert isinstance(refusal, codec.Disconnect) and refusal.reason == Reason.QUOTA_EXCEEDED, refusal
            assert metric(broker, "lmq_mqtt_refused_total", "read_bytes_per_address") == 2
            with dial(broker, "127.0.0.3") as honest:
                assert connack(honest, v5("honest")) is not None
                honest.sendall(codec.encode_publish(f"{parent}/o", bytes(256 * 1024), 1, 1, props=b"\x00"))
                ack = read_packet(honest, codec.LEVEL_5)
                assert isinstance(ack, codec.PacketId) and ack.reason == Reason.SUCCESS, ack
            assert metric(broker, "lmq_mqtt_refused_total", "read_bytes") == 0
        finally:
            for sock in held:
                sock.close()


def test_a_large_packet_trickled_below_the_min_read_rate_ends_its_connection(tmp_path: Path) -> None:
    """A begun large packet must come at --mqtt-min-read-rate on average (32 KiB/s here; up to 64 KiB behind):
    a client sending a byte every 0.2 s (before: alive for ever, a byte within each 60 s is enough) is ended
    with DISCONNECT 0x97 within (1 KiB + 64 KiB) / 32 KiB/s ~ 2 s, counted, and gives its share back; an honest
    client on a slow link (128 KiB/s, in 32 KiB pieces every 0.25 s) is stored."""
    with start_broker(tmp_path / "data", extra_args=READ_CAPS) as broker:
        parent = parent_of(broker, "Prate")
        with begin_large(broker, "127.0.0.2", "trickle", f"{parent}/t", 1024) as slow:
            slow.settimeout(0.2)
            started, refusal = time.monotonic(), None
            while refusal is None and time.monotonic() - started < WAIT_S:
                with contextlib.suppress(TimeoutError):
                    head = slow.recv(1, socket.MSG_PEEK)
                    refusal = read_packet(slow, codec.LEVEL_5) if head else None
                    break
                with contextlib.suppress(OSError):
                    slow.sendall(b"\x00")
            assert isinstance(refusal, codec.Disconnect) and refusal.reason == Reason.QUOTA_EXCEEDED, refusal
            assert time.monotonic() - started < 8.0
        assert metric(broker, "lmq_mqtt_refused_total", "read_rate") == 1
        eventually(lambda: gauge(broker, "lmq_mqtt_read_bytes") == 0, "its share given back")
        data = codec.encode_publish(f"{parent}/s", bytes(256 * 1024), 1, 1, props=b"\x00")
        with dial(broker, "127.0.0.3") as steady:
            assert connack(steady, v5("steady")) is not None
            for at in range(0, len(data), 32 * 1024):
                steady.sendall(data[at : at + 32 * 1024])
                time.sleep(0.25)
            ack = read_packet(steady, codec.LEVEL_5)
            assert isinstance(ack, codec.PacketId) and ack.reason == Reason.SUCCESS, ack
        assert metric(broker, "lmq_mqtt_refused_total", "read_rate") == 1


def test_the_session_count_follows_every_write_of_the_sessions_table(tmp_path: Path) -> None:
    """``Durable.sessions`` (what --mqtt-max-sessions is checked against, no count(*) per CONNECT) is the table's
    row count after each kind of write, a take-over's merge included; a row written as "never" (NULL, an older
    version's 3.1.1 session) expires after the max expiry too."""
    rows = durable.Durable(tmp_path, max_expiry_s=10)

    def counted() -> int:
        assert rows.sessions == rows.session_count()
        return rows.sessions

    rows.save_session("a", {}, None)
    rows.save_session("a", {"x/#": 1}, None)  # rewritten: no new row
    rows.save_session("b", {}, 5)
    assert counted() == 2
    rows.session_ended("a", 1_000, None)
    rows.session_ended("b", 1_000, 5)
    merged: list[dict[str, object]] = [
        {"client_id": "b", "filters": "{}"},
        {"client_id": "c", "filters": "{}", "expiry_s": 100},
    ]
    rows.merge("sessions", merged, 1_000)  # "b" is this broker's already: only "c" is added
    assert counted() == 3
    assert rows.expire_sessions(6_000) == 1  # "b" (5 s)
    assert counted() == 2
    assert rows.load_session("a", 11_000) is None  # NULL: at most 10 s
    assert counted() == 1
    assert rows.drop_session("c") and not rows.drop_session("c")
    assert counted() == 0
    rows.close()
    assert durable.Durable(tmp_path).sessions == 0
