"""What MQTT clients can make a broker hold (issue 26, item 5): bytes per idle MQTT connection, and the
broker's RSS under each flood, with the caps at their defaults. Prints ``FIGURE`` lines.

- idle connections: N sockets open without a CONNECT, then the same N after a CONNECT (keep-alive 0), idle;
  the broker's RSS growth divided by N.
- CONNECT flood: 40 sockets each announcing a 4 MiB CONNECT and sending all of it but its last byte.
- PUBLISH flood: 80 connections (keep-alive 0) each sending a 4 MiB PUBLISH but its last byte: bounded by
  ``--mqtt-max-read-bytes`` (256 MiB; the connections past it are ended with DISCONNECT 0x97), and each cut
  60 s after its last byte (not waited for here).
- retained flood: 31 MiB of retained messages (256 KiB each) matched by 10 subscribers that never read.
- will flood: 60 connections with a 4 MB will (user properties) and the longest will delay (136 years), ended
  without DISCONNECT; then 60 with a 60 KB will and a one-day delay (within the caps: they wait on disk).

Each flood runs on a fresh broker; its RSS peak over its baseline while it lasts, and what stays 2 s after
it ended. For the figures of other code, put its tree first (the broker runs from the tree ``lmq_broker`` is
imported from):

    python bench/bench_mqtt_memory.py                                   # this tree (~1 min)
    PYTHONPATH=/work/main/broker python bench/bench_mqtt_memory.py      # another tree, e.g. before the caps
    python bench/bench_mqtt_memory.py --quick                           # smoke run (small floods)
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import psutil

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec, wire
from lmq_broker.mqtt.properties import Properties
from lmq_broker.testing import BrokerProcess, start_broker

MiB: Final = 1024 * 1024
NEVER: Final = 0xFFFFFFFF  # a 5.0 interval of 136 years
PARENT: Final = "MEM"


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.1f} {unit}{extra}", flush=True)


class Peak:
    """The broker's RSS, sampled every 20 ms while the block runs."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.base = self.rss()
        self.peak = self.base
        self._stop = threading.Event()

    def rss(self) -> int:
        return int(self._process.memory_info().rss)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        def sample() -> None:
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, self.rss())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
            self.peak = max(self.peak, self.rss())


def flood(broker: BrokerProcess, name: str, run: Callable[[], Callable[[], None]], hold_s: float) -> None:
    """``run`` starts a flood and returns what ends it; RSS growth at its peak, and 2 s after it ended."""
    peak = Peak(broker.pid)
    with peak.watching():
        end = run()
        time.sleep(hold_s)
    end()
    time.sleep(2.0)
    after = peak.rss()
    figure(f"RSS under the {name}", (peak.peak - peak.base) / MiB, "MiB",
           f" (peak over {peak.base / MiB:.0f} MiB; {(after - peak.base) / MiB:+.1f} MiB held 2 s after)")  # fmt: skip


def dial(broker: BrokerProcess, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", broker.mqtt_port))
    return sock


def read_some(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except (ConnectionError, TimeoutError):
        return b""


def connack_code(sock: socket.socket, connect: codec.Connect) -> int:
    """The CONNACK's code (-1: closed unanswered)."""
    with contextlib.suppress(ConnectionError):
        sock.sendall(codec.encode(connect))
    data = read_some(sock)
    return data[3] if len(data) >= 4 and data[0] >> 4 == codec.CONNACK else -1


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def idle_connections(broker: BrokerProcess, count: int) -> None:
    process = psutil.Process(broker.pid)
    time.sleep(1.0)
    base = process.memory_info().rss
    socks = [dial(broker) for _ in range(count)]
    time.sleep(1.0)
    bare = process.memory_info().rss
    codes = [connack_code(sock, codec.Connect(f"idle-{i}")) for i, sock in enumerate(socks)]
    time.sleep(1.0)
    connected = process.memory_info().rss
    close_all(socks)
    accepted = sum(1 for c in codes if c == 0)
    figure("bytes per idle MQTT socket before CONNECT", (bare - base) / count, "B", f" ({count} sockets)")
    figure("bytes per idle MQTT connection after CONNECT", (connected - base) / count, "B",
           f" ({accepted} of {count} accepted, keep-alive 0)")  # fmt: skip


def connect_flood(broker: BrokerProcess, count: int, announced: int) -> Callable[[], None]:
    socks = [dial(broker) for _ in range(count)]
    header = bytes((codec.CONNECT << 4,)) + wire.varint(announced)
    chunk = bytes(64 * 1024)
    for sock in socks:
        with contextlib.suppress(ConnectionError, TimeoutError):
            sock.sendall(header)
            sent = 0
            while sent < announced - 1:  # all but the last byte: the broker waits for it
                piece = chunk[: min(len(chunk), announced - 1 - sent)]
                sock.sendall(piece)
                sent += len(piece)
    return lambda: close_all(socks)


def publish_flood(broker: BrokerProcess, count: int, size: int) -> Callable[[], None]:
    socks = []
    for i in range(count):
        sock = dial(broker)
        if connack_code(sock, codec.Connect(f"partial-{i}")) != 0:
            sock.close()
            continue
        data = codec.encode_publish(f"{PARENT}/partial", bytes(size), 1, 1)
        with contextlib.suppress(ConnectionError, TimeoutError):
            sock.sendall(data[:-1])  # the broker waits for the last byte
        socks.append(sock)
    return lambda: close_all(socks)


def publish_retained(broker: BrokerProcess, parent: str, total_mib: int) -> None:
    with dial(broker) as publisher:
        assert connack_code(publisher, codec.Connect("retainer")) == 0
        count = total_mib * 4  # 256 KiB each
        for i in range(count):
            publisher.sendall(codec.encode_publish(f"{parent}/r{i:04}", bytes(256 * 1024), 1, i % 65535 + 1,
                                                   retain=True))  # fmt: skip
        acked = 0
        while acked < count:  # PUBACKs: 4 bytes each
            data = read_some(publisher)
            assert data, "the retained publishes were not all acknowledged"
            acked += len(data) // 4


def retained_flood(broker: BrokerProcess, parent: str, subscribers: int) -> Callable[[], None]:
    socks = []
    for i in range(subscribers):
        sock = dial(broker, rcvbuf=16 * 1024)
        assert connack_code(sock, codec.Connect(f"never-reads-{i}")) == 0
        sock.sendall(codec.encode(codec.Subscribe(1, ((f"{parent}/#", 0),))))
        socks.append(sock)
    return lambda: close_all(socks)


def will_flood(broker: BrokerProcess, parent: str, count: int, will_bytes: int, delay_s: int) -> Callable[[], None]:
    values = will_bytes // 60_000 or 1
    user = tuple((f"k{i}", "v" * min(60_000, will_bytes)) for i in range(values))
    props = Properties(will_delay_s=delay_s, user=user) if will_bytes > 60_000 else Properties(will_delay_s=delay_s)
    payload = b"" if will_bytes > 60_000 else bytes(will_bytes)
    codes = []
    for i in range(count):
        sock = dial(broker)
        will = codec.Will(f"{parent}/will-{i}", payload or b"gone", 1, False, props)
        connect = codec.Connect(f"will-{will_bytes}-{i}", False, 0, will, level=codec.LEVEL_5,
                                properties=Properties(session_expiry_s=NEVER))  # fmt: skip
        codes.append(connack_code(sock, connect))
        sock.close()  # no DISCONNECT: the will starts its delay
    accepted = sum(1 for c in codes if c == 0)
    print(f"  {count} wills of {will_bytes:,} bytes, delay {delay_s} s: {accepted} accepted, "
          f"refused with {sorted({hex(c) for c in codes if c != 0})}", flush=True)  # fmt: skip
    return lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small floods (a smoke run)")
    args = parser.parse_args()
    idle, flooders, partial, retained_mib, wills = (50, 10, 10, 4, 10) if args.quick else (400, 40, 80, 31, 60)
    with fresh_broker() as broker:
        idle_connections(broker, idle)
    with fresh_broker() as broker:
        flood(broker, f"CONNECT flood ({flooders} x 4 MiB announced)",
              lambda: connect_flood(broker, flooders, 4 * MiB), 2.0)  # fmt: skip
    with fresh_broker() as broker:
        flood(broker, f"PUBLISH flood ({partial} x 4 MiB unfinished, keep-alive 0)",
              lambda: publish_flood(broker, partial, 4 * MiB - 1024), 2.0)  # fmt: skip
    with fresh_broker() as broker:
        publish_retained(broker, PARENT, retained_mib)
        time.sleep(2.0)
        flood(broker, f"retained flood ({retained_mib} MiB x 10 subscribers that never read)",
              lambda: retained_flood(broker, PARENT, 10), 4.0)  # fmt: skip
    with fresh_broker() as broker:
        flood(broker, f"will flood ({wills} x 4 MB wills, 136-year delay)",
              lambda: will_flood(broker, PARENT, wills, 4_000_000, NEVER), 1.0)  # fmt: skip
    with fresh_broker() as broker:
        flood(broker, f"will flood ({wills} x 60 KB wills, one-day delay)",
              lambda: will_flood(broker, PARENT, wills, 60_000, 86_400), 1.0)  # fmt: skip


@contextlib.contextmanager
def fresh_broker() -> Iterator[BrokerProcess]:
    """Each flood on its own broker: memory one flood freed does not hide what the next one takes."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_broker(Path(tmp) / "data", extra_args=["--mqtt-port", "0"]) as broker,
    ):
        with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
            admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        time.sleep(1.0)
        yield broker
        assert broker.alive()


if __name__ == "__main__":
    main()
