"""lmq's side of the comparison with Apache RocketMQ 5.5.0 (docs/rocketmq.md), measured here with the official
Python client (rocketmq-python-client 5.1.2) against a broker process with default settings (sync flush):

* cold start: launch of ``python -m lmq_broker serve`` on a fresh data dir -> first acknowledged send;
* memory and disk per lite topic: RSS and data-dir growth over ``--topics`` lite topics of one 1 KiB message;
* idle CPU over ``--idle-s`` seconds after that fill, in % of one core;
* first delivery after subscribe: a message waits in a lite topic; a LitePushConsumer subscribes to it; the time
  from ``subscribe_lite`` until the consumer has it;
* kill -9 -> restart -> first acknowledged send (a new producer: the broker's part, not the old client's backoff).

No target: these are the figures docs/rocketmq.md sets beside RocketMQ's (which that page takes from an
independent side-by-side run on this kind of machine; this script does not start RocketMQ).

    python bench/bench_footprint.py           # 50,000 lite topics, 60 s idle
    python bench/bench_footprint.py --quick   # 5,000 lite topics, 10 s idle
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil

from lmq_broker.testing import BrokerProcess, Inbox, send_lite, start_broker, started_lite_consumer, started_producer

PARENT, GROUP = "AGENT_TASK_NS", "executor-group"  # what a fresh broker bootstraps
BODY = b"x" * 1024
IN_FLIGHT = 256


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fill(producer: Any, topics: int) -> None:
    from rocketmq import Message  # noqa: PLC0415 - the official client, in this interpreter only

    pending: list[Future[Any]] = []
    for i in range(topics):
        m = Message()
        m.topic, m.lite_topic, m.body = PARENT, f"fill-{i}", BODY
        pending.append(producer.send_async(m))
        if len(pending) >= IN_FLIGHT:
            for f in pending:
                f.result(60)
            pending.clear()
    for f in pending:
        f.result(60)


def idle_cpu_percent(broker: BrokerProcess, seconds: float) -> float:
    proc = psutil.Process(broker.process.pid)
    before, began = proc.cpu_times(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = proc.cpu_times(), time.monotonic() - began
    return 100 * ((after.user - before.user) + (after.system - before.system)) / elapsed


def first_delivery_after_subscribe(broker: BrokerProcess, clients: list[Any], producer: Any) -> float:
    send_lite(producer, PARENT, "waiting-1", b"waiting")
    inbox = Inbox()
    consumer = started_lite_consumer(broker, clients, GROUP, PARENT, inbox)
    began = time.monotonic()
    consumer.subscribe_lite("waiting-1")
    if not inbox.wait_for(lambda i: len(i.accepted) >= 1, 60):
        raise SystemExit("the waiting message was not delivered within 60 s")
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topics", type=int, default=50_000)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="5,000 topics, 10 s idle")
    args = parser.parse_args()
    topics, idle_s = (5_000, 10.0) if args.quick else (args.topics, args.idle_s)
    clients: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="lmq-footprint-") as tmp:
        data = Path(tmp) / "data"
        began = time.monotonic()
        broker = start_broker(data)
        try:
            producer = started_producer(broker, clients, PARENT)
            send_lite(producer, PARENT, "first", b"first")
            cold = time.monotonic() - began
            proc = psutil.Process(broker.process.pid)
            rss0, disk0 = proc.memory_info().rss, dir_bytes(data)
            filled = time.monotonic()
            fill(producer, topics)
            fill_s = time.monotonic() - filled
            rss1, disk1 = proc.memory_info().rss, dir_bytes(data)
            idle = idle_cpu_percent(broker, idle_s)
            delivery = first_delivery_after_subscribe(broker, clients, producer)
            for client in reversed(clients):
                client.shutdown()
            clients.clear()
            killed = time.monotonic()
            broker.kill()
            broker = broker.restart()
            again = started_producer(broker, clients, PARENT)
            send_lite(again, PARENT, "after-kill", b"after")
            restart = time.monotonic() - killed
        finally:
            for client in reversed(clients):
                client.shutdown()
            broker.stop()
    print(f"FIGURE cold start, launch -> first acknowledged send: {cold:.2f} s")
    rate = f"{topics / fill_s:,.0f} msg/s, {IN_FLIGHT} in flight"
    print(f"FIGURE fill: {topics:,} lite topics x 1 KiB in {fill_s:.1f} s ({rate})")
    per_topic, mib = (rss1 - rss0) / topics, f"{rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB"
    print(f"FIGURE RSS growth per lite topic: {per_topic:,.0f} B (RSS {mib})")
    print(f"FIGURE disk per lite topic (incl. the 1 KiB body): {(disk1 - disk0) / topics / 1000:.2f} kB")
    print(f"FIGURE idle CPU over {idle_s:.0f} s after the fill: {idle:.2f} % of a core")
    print(f"FIGURE first delivery after subscribe_lite (a message waiting): {delivery:.2f} s")
    print(f"FIGURE kill -9 -> restart -> first acknowledged send: {restart:.2f} s")


if __name__ == "__main__":
    main()
