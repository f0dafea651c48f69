"""A LITE parent created while MQTT sessions are connected (issue 27): how long until every live session whose
filter can match it (``#``) gets a message published there right after it was created, and what the change
costs the broker, beside many sessions whose filters cannot match it (they are not visited: ``mqtt.following``
keeps an index of the sessions concerned). Prints ``FIGURE`` lines.

One broker process (``--mqtt-port``), ``--plain`` sessions subscribed to ``plain/<i>`` and ``--wild`` sessions
subscribed to ``#``, all raw sockets through our codec on one asyncio loop. Per round: ``PutParentTopic`` through
the admin API, then at once a QoS 0 publish to ``<parent>/x``; the time from the admin call's start until the
last ``#`` session read it, and the broker's CPU seconds over the round.

    python bench/bench_mqtt_new_parents.py                     # 2,000 plain + 200 wildcard sessions, 5 rounds
    python bench/bench_mqtt_new_parents.py --plain 8000 --wild 1000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.mqtt import codec
from lmq_broker.testing import BrokerProcess, start_broker


def figure(name: str, value: float, unit: str, extra: str = "") -> None:
    print(f"FIGURE {name}: {value:,.3f} {unit}{extra}", flush=True)


class Session:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = codec.Decoder(level=codec.LEVEL_3_1_1)
        self.got: dict[str, float] = {}  # topic -> when it arrived
        self.arrived = asyncio.Event()

    @classmethod
    async def open(cls, port: int, client_id: str, topic_filter: str) -> Session:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        session = cls(reader, writer)
        writer.write(codec.encode(codec.Connect(client_id, True, 0)))
        writer.write(codec.encode(codec.Subscribe(1, ((topic_filter, 0),))))
        seen: list[codec.Packet] = []
        while not any(isinstance(p, codec.SubAck) for p in seen):
            data = await reader.read(65536)
            assert data, "closed"
            seen += session.decoder.feed(data)
        return session

    async def read(self) -> None:
        while data := await self.reader.read(65536):
            for packet in self.decoder.feed(data):
                if isinstance(packet, codec.Publish):
                    self.got[packet.topic] = time.perf_counter()
                    self.arrived.set()


async def run(broker: BrokerProcess, plain: int, wild: int, rounds: int) -> None:
    port = broker.mqtt_port
    sessions = [await Session.open(port, f"plain-{i}", f"plain/{i}") for i in range(plain)]
    wilds = [await Session.open(port, f"wild-{i}", "#") for i in range(wild)]
    readers = [asyncio.create_task(s.read()) for s in [*sessions, *wilds]]
    publisher = await Session.open(port, "publisher", "nothing/here")
    process = psutil.Process(broker.process.pid)
    admin = AdminClient(broker.admin_endpoint, timeout_s=30, **broker.admin_keys)
    waits, cpus = [], []
    try:
        for n in range(rounds):
            parent = f"NEWP{n}"
            cpu = process.cpu_times()
            start = time.perf_counter()
            await asyncio.to_thread(admin.put_parent_topic, model.ParentTopic(parent, model.MessageType.LITE))
            publisher.writer.write(codec.encode(codec.Publish(f"{parent}/x", b"hello", 0)))
            async with asyncio.timeout(60):
                while not all(f"{parent}/x" in s.got for s in wilds):
                    await asyncio.sleep(0.005)
            last = max(s.got[f"{parent}/x"] for s in wilds) if wilds else time.perf_counter()
            waits.append(last - start)
            after = process.cpu_times()
            cpus.append(after.user + after.system - cpu.user - cpu.system)
        assert not any(s.got for s in sessions), "a plain session got a message its filter does not match"
    finally:
        admin.close()
        for task in readers:
            task.cancel()
    note = f" ({plain:,} plain + {wild:,} '#' sessions, median of {rounds}; max {max(waits):.3f} s)"
    figure("new parent -> all '#' sessions got its first message", statistics.median(waits), "s", note)
    figure("broker CPU per new parent", statistics.median(cpus), "s", note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plain", type=int, default=2000)
    parser.add_argument("--wild", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--mqtt-port", "0", "--mqtt-max-connections-per-address", "100000"]
        extra += ["--mqtt-max-connections", "100000"]
        broker = start_broker(Path(tmp) / "data", extra_args=extra)
        try:
            asyncio.run(run(broker, args.plain, args.wild, args.rounds))
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
