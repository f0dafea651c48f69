"""Delayed wills wait in the store (``<data_dir>/mqtt.sqlite3``), not in memory: they survive a restart and
fire after it; a client id that comes back takes its will out, restart or not."""

from __future__ import annotations

import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import pytest
from raw_mqtt import Raw

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec, durable
from lmq_broker.mqtt.properties import Properties, Reason
from lmq_broker.testing import BrokerProcess, start_broker

WAIT_S: Final = 20.0
DELAY_S: Final = 6


def eventually(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout} s"
        time.sleep(0.05)


def read_packet(sock: socket.socket) -> codec.Packet:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the broker closed the socket"
            data += chunk
        return data

    first = exactly(1)[0]
    length, shift = 0, 0
    while True:
        digit = exactly(1)[0]
        length |= (digit & 0x7F) << shift
        shift += 7
        if not digit & 0x80:
            break
    return codec.decode_packet(first, exactly(length), codec.LEVEL_5)


def connect(broker: BrokerProcess, client_id: str, will: codec.Will | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", broker.mqtt_port), timeout=WAIT_S)
    props = Properties(session_expiry_s=3600)
    sock.sendall(codec.encode(codec.Connect(client_id, False, 0, will, level=codec.LEVEL_5, properties=props)))
    answer = read_packet(sock)
    assert isinstance(answer, codec.ConnAck) and answer.code == Reason.SUCCESS, answer
    return sock


def wills_waiting(data_dir: Path) -> set[str]:
    with sqlite3.connect(data_dir / durable.FILE_NAME) as db:
        return {row[0] for row in db.execute("SELECT client_id FROM wills")}


def retained_topics(data_dir: Path) -> set[str]:
    with sqlite3.connect(data_dir / durable.FILE_NAME) as db:
        return {row[0] for row in db.execute("SELECT lite FROM retained")}


def test_delayed_wills_survive_a_restart_and_fire_unless_their_client_comes_back(tmp_path: Path) -> None:
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic("W", model.MessageType.LITE))
        # both vanish without DISCONNECT: their wills start waiting. "back"'s delay is long enough for any restart
        # (it returns before it is due); "gone"'s outlives the stop and may fall due during a slow restart
        for client_id, delay_s in (("gone", DELAY_S), ("back", 10 * DELAY_S)):
            delayed = Properties(will_delay_s=delay_s)
            will = codec.Will(f"W/{client_id}", f"{client_id} for good".encode(), 1, True, delayed)
            connect(broker, client_id, will).close()
        eventually(lambda: wills_waiting(broker.data_dir) == {"gone", "back"}, "both wills in the store")
        assert broker.stop() == 0, broker.log()[-4000:]
        assert wills_waiting(broker.data_dir) == {"gone", "back"}, "a stop dropped or published them"
        assert not retained_topics(broker.data_dir), "a will was published before its delay"
        broker = broker.restart()
        connect(broker, "back").close()  # it came back: its will is taken out, never published
        assert wills_waiting(broker.data_dir) <= {"gone"}  # "gone"'s is still waiting, or already published
        with connect(broker, "watcher") as watcher:
            watcher.sendall(codec.encode(codec.Subscribe(1, (("W/#", 1),), Properties())))
            assert isinstance(read_packet(watcher), codec.SubAck)
            publish = read_packet(watcher)  # retained (published meanwhile) or live, within the delay
            assert isinstance(publish, codec.Publish), publish
            assert (publish.topic, publish.payload) == ("W/gone", b"gone for good")
        eventually(lambda: not wills_waiting(broker.data_dir), "the published will's row deleted")
        eventually(lambda: "gone" in retained_topics(broker.data_dir), "the will recorded as retained")
        assert retained_topics(broker.data_dir) == {"gone"}, "the will of the client that came back was published"
    finally:
        assert broker.stop() == 0, broker.log()[-4000:]


@pytest.mark.parametrize("level", [codec.LEVEL_3_1_1, codec.LEVEL_5], ids=["3.1.1", "5.0"])
def test_3_1_2_8_the_will_of_a_connection_that_died_with_a_killed_broker_is_published_after_its_restart(
    tmp_path: Path, level: int
) -> None:
    """MQTT-3.1.2-8: a will is published once its connection closes without DISCONNECT; a broker killed (SIGKILL)
    with the connection open defers it to its restart (5.0 section 3.1.2.5 allows that). The will is kept from
    the CONNECT on (``armed``): published after the restart; one dropped by a DISCONNECT is not; 5.0: one with a
    will delay waits it from the restart and is dropped when its client id connects within it. (Before, the will
    lived in the killed process only: never published.)"""
    v5 = level == codec.LEVEL_5
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic("K", model.MessageType.LITE))
        port = broker.mqtt_port
        watcher = Raw(port, "k-watcher", level=level, clean=False)
        assert watcher.subscribe("K/#", 1) == [1]
        watcher.close()
        delayed = Properties(will_delay_s=10 * DELAY_S) if v5 else None
        kept = {name: will_connection(port, name, level, will_delay=delayed if name == "back" else None)
                for name in ("dies", "left", "back")}  # fmt: skip
        kept["left"].sendall(codec.encode(codec.Disconnect(0, Properties()) if v5 else codec.Bare(codec.DISCONNECT)))
        eventually(lambda: armed(broker.data_dir) == {"dies", "back"}, "the wills kept while connected")
        broker.kill()
        for sock in kept.values():
            sock.close()
        broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
        if v5:  # back within its delay, resuming its session: its will is dropped (a clean start publishes it)
            with will_connection(port, "back", level, clean=False) as back:  # (then leaves: DISCONNECT)
                back.sendall(codec.encode(codec.Disconnect(0, Properties())))
        again = Raw(port, "k-watcher", level=level, clean=False)
        assert again.session_present
        expected = {b"dies gone"} if v5 else {b"dies gone", b"back gone"}  # 3.1.1: no delay, "back" died too
        seen = set()
        for _ in expected:
            got = again.next()
            assert isinstance(got, codec.Publish) and got.packet_id is not None, got
            seen.add(got.payload)
            again.ack(codec.PUBACK, got.packet_id)
        assert seen == expected
        eventually(lambda: not wills_waiting(broker.data_dir) and not armed(broker.data_dir), "no will left")
        again.send(codec.Bare(codec.PINGREQ))
        assert again.next() == codec.Bare(codec.PINGRESP)  # "left"'s (DISCONNECT) never came
        again.close()
    finally:
        assert broker.stop() == 0, broker.log()[-4000:]


def will_connection(
    port: int, client_id: str, level: int, *, will_delay: Properties | None = None, clean: bool = True
) -> socket.socket:
    """Connected with a will to ``K/<client id>`` (QoS 1; 5.0: ``will_delay`` its will properties and the
    session's), the CONNACK read."""
    v5 = level == codec.LEVEL_5
    will = codec.Will(f"K/{client_id}", f"{client_id} gone".encode(), 1, False, (will_delay or Properties()) if v5
                      else None)  # fmt: skip
    props = Properties(session_expiry_s=3600) if v5 else None
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(codec.encode(codec.Connect(client_id, clean, 0, will, level=level, properties=props)))
    decoder = codec.Decoder(level=level)
    got: list[codec.Packet] = []
    while not got:
        data = sock.recv(65536)
        assert data, "the broker closed the connection"
        got += decoder.feed(data)
    assert isinstance(got[0], codec.ConnAck) and got[0].code == 0, got
    return sock


def armed(data_dir: Path) -> set[str]:
    with sqlite3.connect(data_dir / durable.FILE_NAME) as db:
        return {row[0] for row in db.execute("SELECT client_id FROM armed")}


def test_a_will_left_armed_by_a_connection_end_a_broker_stop_cut_short_is_not_published_after_the_next_start(
    tmp_path: Path,
) -> None:
    """A broker stop publishes no will (docs/mqtt.md); a connection's ``armed`` row is deleted at its end. An end
    that a stop cancels past its grace (releasing leases at a peer that does not answer), or whose delete failed,
    left the row, and the next start published that will as a killed broker's. The stop now drops every row left
    once its connections have ended. The cut-short end is stood in for by a row written beside the broker's."""
    broker = start_broker(tmp_path / "data", extra_args=["--mqtt-port", "0"])
    try:
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic("K", model.MessageType.LITE))
        port = broker.mqtt_port
        watcher = Raw(port, "k-watcher", level=codec.LEVEL_3_1_1, clean=False)
        assert watcher.subscribe("K/#", 1) == [1]
        watcher.close()
        live = will_connection(port, "live", codec.LEVEL_3_1_1)
        eventually(lambda: armed(broker.data_dir) == {"live"}, "the live connection's will kept")
        with sqlite3.connect(broker.data_dir / durable.FILE_NAME) as db:
            db.execute(
                "INSERT INTO armed (connection, client_id, delay_s, topic, payload, qos, retain, properties, host)"
                " VALUES ('cut-short', 'cut', 0, 'K/cut', CAST('cut gone' AS BLOB), 1, 0, NULL, '127.0.0.1')"
            )
        assert broker.stop() == 0, broker.log()[-4000:]
        live.close()
        assert armed(broker.data_dir) == set()
        broker = start_broker(broker.data_dir, port=broker.port, extra_args=["--mqtt-port", str(port)])
        again = Raw(port, "k-watcher", level=codec.LEVEL_3_1_1, clean=False)
        assert again.session_present
        again.send(codec.Bare(codec.PINGREQ))
        assert again.next() == codec.Bare(codec.PINGRESP)  # no will came before it
        time.sleep(1.0)
        again.send(codec.Bare(codec.PINGREQ))
        assert again.next() == codec.Bare(codec.PINGRESP)  # nor since
        assert not wills_waiting(broker.data_dir)
        again.close()
    finally:
        if broker.alive():
            assert broker.stop() == 0, broker.log()[-4000:]
