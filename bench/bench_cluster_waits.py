"""What waiting MQTT sessions cost the other brokers of a cluster, and how soon they get those brokers' messages:
parked waits (``AwaitLiteReady``, ``cluster.readiness``) against the polling they replaced, in the same run.

Three ``--peers`` broker processes; ``--sessions`` MQTT 3.1.1 sessions (raw sockets, this process) connect to
broker 0 and subscribe ``P/#``, then stay idle. Figures per mode:

* idle CPU of each broker over ``--idle`` seconds (psutil), and the calls brokers 1 and 2 answered meanwhile
  for broker 0's sessions (ReceiveMessage + AwaitLiteReady, from their /metrics);
* cross-broker latency: one more session on broker 0 subscribes ``Q/#``; ``--count`` messages are sent (gRPC
  SendMessage, paced ``--gap`` apart so they fall anywhere in a polling interval) to their owners, brokers 1 and 2
  in turn; latency = the PUBLISH read by the subscriber - the moment before the send.

``polling`` runs the brokers with the previous session loop put back by this script alone (``_polling_gather``,
applied by a wrapper around ``python -m lmq_broker``; the broker has no switch): without waiting at the other
brokers, then 200 ms waiting here, again and again.

    python bench/bench_cluster_waits.py           # 200 sessions, 10 s idle, 100 messages, both modes
    python bench/bench_cluster_waits.py --quick   # 50 sessions, 4 s idle, 30 messages
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import membership as mb
from lmq_broker.mqtt import codec
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

IDLE, LATENCY = "P", "Q"
HEADERS = (("x-mq-client-id", "bench-producer"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.2.0"))
POLL_MS = 200  # the polling interval of the previous session loop


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.2f} {unit}{extra}", flush=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


# --- the previous session loop, put back in the broker processes of the "polling" mode ------------------------
async def _polling_gather(  # noqa: PLR0917 (``Deliveries._gather``'s signature)
    self: Any, remote: Any, parent: str, consumer: str, room: int, share: Any = None
) -> bool:
    """The session loop's round before parked waits: this broker's messages and, without waiting, every other
    broker's; while none come, wait here ``POLL_MS`` and ask them all again (sessions only: ``share`` unused)."""
    link = self.link  # the session's shared state (``mqtt.link``); ``self`` is its ``delivering.Deliveries``
    cluster = link.cluster
    found = await self._receive(parent, consumer, room, 0)
    room = link.max_inflight - self.busy
    if room > 0 and cluster is not None:
        pulled = await cluster.pull(consumer, link.group, parent, min(room, link.config.receive_batch_size))
        if pulled:
            await self._deliver(parent, consumer, pulled, remote=True)
            found = True
    if found:
        return True
    room = link.max_inflight - self.busy
    return room > 0 and bool(await self._receive(parent, consumer, room, POLL_MS))


def _serve_polling() -> None:
    """``python -m lmq_broker ...`` with ``_polling_gather`` in place (run by the wrapper, in the broker)."""
    import runpy  # noqa: PLC0415 - only in the broker processes of the polling mode

    from lmq_broker.mqtt import delivering  # noqa: PLC0415

    delivering.Deliveries._gather = _polling_gather  # type: ignore[method-assign]
    sys.argv = ["lmq_broker", *sys.argv[3:]]  # after "-m lmq_broker"
    runpy.run_module("lmq_broker", run_name="__main__", alter_sys=True)


def _polling_python(tmp: Path) -> str:
    """An interpreter for ``start_broker`` that runs ``_serve_polling``."""
    wrapper = tmp / "polling-python"
    here = Path(__file__).resolve()
    wrapper.write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "import sys; sys.path.insert(0, {str(here.parent)!r}); '
        f'import {here.stem}; {here.stem}._serve_polling()" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


# --- MQTT sessions on raw sockets -----------------------------------------------------------------------------
class Session:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder(level=codec.LEVEL_3_1_1)
        self.pending: list[codec.Packet] = []

    @classmethod
    async def subscribed(cls, port: int, client_id: str, topic_filter: str) -> Session:
        session = cls(*await asyncio.open_connection("127.0.0.1", port))
        session.writer.write(codec.encode(codec.Connect(client_id, True, keep_alive_s=600, level=codec.LEVEL_3_1_1)))
        assert isinstance(await session.next(), codec.ConnAck)
        session.writer.write(codec.encode(codec.Subscribe(1, ((topic_filter, 1),))))
        assert isinstance(await session.next(), codec.SubAck)
        return session

    async def next(self, timeout_s: float = 30.0) -> codec.Packet:
        async with asyncio.timeout(timeout_s):
            while not self.pending:
                data = await self.reader.read(65536)
                if not data:
                    raise ConnectionError("the broker closed the connection")
                self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    def close(self) -> None:
        self.writer.close()


def owned_by(members: Sequence[str], slot: int, prefix: str) -> str:
    membership = mb.Membership(tuple(members), (len(members),))
    return next(
        f"{prefix}-{i}"
        for i in range(100_000)
        if mb.owner(membership, model.QueueId.lmq(LATENCY, f"{prefix}-{i}").topic) == slot
    )


def calls_answered(broker: BrokerProcess) -> int:
    """ReceiveMessage calls and ready waits this broker answered (its /metrics)."""
    with urllib.request.urlopen(broker.metrics_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if (line.startswith("lmq_rpc_total{") and 'method="ReceiveMessage"' in line) or line.startswith(
            "lmq_ready_waits_total "
        ):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def cpu_percent(processes: list[psutil.Process], seconds: float) -> list[float]:
    before = [p.cpu_times() for p in processes]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    after = [p.cpu_times() for p in processes]
    return [100 * ((a.user + a.system) - (b.user + b.system)) / elapsed for a, b in zip(after, before, strict=True)]


async def measure(brokers: list[BrokerProcess], members: list[str], args: argparse.Namespace, mode: str) -> None:
    port = brokers[0].mqtt_port
    sessions = []
    for i in range(args.sessions):
        sessions.append(await Session.subscribed(port, f"idle-{mode}-{i}", f"{IDLE}/#"))
    listener = await Session.subscribed(port, f"listener-{mode}", f"{LATENCY}/#")
    await asyncio.sleep(3)  # past the subscriptions' own calls
    processes = [psutil.Process(b.pid) for b in brokers]
    before = [calls_answered(b) for b in brokers[1:]]
    t0 = time.monotonic()
    cpu = await asyncio.to_thread(cpu_percent, processes, args.idle)
    elapsed = time.monotonic() - t0
    calls = [(calls_answered(b) - n) / elapsed for b, n in zip(brokers[1:], before, strict=True)]
    name = f"{mode}, {args.sessions} idle MQTT sessions on broker 0 of 3"
    figure(f"{name}: idle CPU of broker 0", cpu[0], "% of a core")
    figure(f"{name}: idle CPU of brokers 1 and 2, mean", statistics.mean(cpu[1:]), "% of a core")
    figure(f"{name}: calls each other broker answered", statistics.mean(calls), "calls/s")

    lites = [owned_by(members, 1, "one"), owned_by(members, 2, "two")]
    latencies: list[float] = []
    channels = [grpc.aio.insecure_channel(brokers[slot].endpoint) for slot in (1, 2)]
    try:
        stubs = [service_pb2_grpc.MessagingServiceStub(c) for c in channels]
        for n in range(args.count):
            which = n % 2
            message = pb.Message(
                topic=pb.Resource(name=LATENCY),
                body=f"{n}".encode(),
                system_properties=pb.SystemProperties(
                    message_id=f"{mode}-{n}", message_type=pb.LITE, lite_topic=lites[which], body_encoding=pb.IDENTITY
                ),
            )
            sent = time.monotonic()
            reply = await stubs[which].SendMessage(spb.SendMessageRequest(messages=[message]), metadata=HEADERS)
            assert reply.status.code == pb.OK, reply.status
            packet = await listener.next()
            latencies.append(time.monotonic() - sent)
            assert isinstance(packet, codec.Publish) and packet.packet_id is not None, packet
            listener.writer.write(codec.encode(codec.PacketId(codec.PUBACK, packet.packet_id)))
            await asyncio.sleep(args.gap)
    finally:
        for channel in channels:
            await channel.close(None)
    extra = f" (p99 {percentile(latencies, 99) * 1000:.1f} ms, {len(latencies)} messages)"
    figure(f"{mode}: send -> MQTT subscriber on another broker, p50", percentile(latencies, 50) * 1000, "ms", extra)
    for session in [*sessions, listener]:
        session.close()


def run(tmp: Path, args: argparse.Namespace, mode: str) -> None:
    ports = free_ports("127.0.0.1", 3)
    members = [f"127.0.0.1:{p}" for p in ports]
    python = _polling_python(tmp) if mode == "polling" else sys.executable
    brokers: list[BrokerProcess] = []
    try:
        for i in range(3):
            flags = ["--peers", ",".join(members), "--ordinal", str(i), "--no-bootstrap", "--mqtt-port", "0"]
            brokers.append(start_broker(tmp / f"{mode}-b{i}", port=ports[i], extra_args=flags, env=SHARED_ADMIN_ENV,
                                        python=python))  # fmt: skip
        with AdminClient(brokers[0].endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
            for parent in (IDLE, LATENCY):
                admin.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
        time.sleep(2)  # past start-up work
        asyncio.run(measure(brokers, members, args, mode))
    finally:
        for broker in brokers:
            broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured")
    parser.add_argument("--count", type=int, default=100, help="messages timed")
    parser.add_argument("--gap", type=float, default=0.037, help="seconds between two timed messages")
    parser.add_argument("--modes", default="polling,parked")
    a = parser.parse_args()
    if a.quick:
        a.sessions, a.idle, a.count = 50, 4.0, 30
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            run(Path(tmp), a, mode)


if __name__ == "__main__":
    main()
