"""A replica copy's two layouts (issue 32, ``replication.wire``): CPU to encode (the owner) and decode (the
follower) one copy, binary against JSON (the plain twin), turn by turn in one process.

The copy is what ``bench_replication.py``'s load makes: ``--messages`` 1 KiB LITE messages with their two
queues (the parent's and the LMQ), as an owner ships them. CPU time (``time.process_time``), the best of
``--repeat`` turns of ``--number`` calls each, layouts alternating, so a busy host slows both alike. In a
broker the same code took about three times as long (the follower's decode, timed in place: JSON 30, binary
17.5 to 21 µs per message; bench/RESULTS.md), so read these as the ratio, not the price.

    python bench/bench_replication_wire.py
"""

from __future__ import annotations

import argparse
import os
import time
import timeit
from collections.abc import Callable

from lmq_broker import model
from lmq_broker.replication import wire

PARENT = "AGENT_TASK_NS"


def batch(count: int) -> tuple[list[model.NewMessage], list[model.AppendResult]]:
    messages, results = [], []
    for i in range(count):
        queues = (model.QueueId(PARENT, 0), model.QueueId.lmq(PARENT, f"t{i}"))
        m = model.NewMessage(
            message_id=f"m-{i}-{time.time_ns()}",
            topic=PARENT,
            body=b"x" * 1024,
            queues=queues,
            lite_topic=f"t{i}",
            message_type=model.MessageType.LITE,
            born_timestamp_ms=int(time.time() * 1000),
            born_host="10.0.0.7",
            epoch=3,
        )
        messages.append(m)
        results.append(model.AppendResult(m.message_id, queues, (1_000 + i, 50 + i), 0))
    return messages, results


def best_us(call: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeat, timer=time.process_time)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3, help="messages per copy (2.5 to 3 under the bench's load)")
    parser.add_argument("--number", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    messages, results = batch(args.messages)
    layouts = {"binary": wire.encode, "json": wire.encode_json}
    copies = {name: encode(0, 3, messages, results) for name, encode in layouts.items()}
    assert wire.decode(copies["binary"]) == wire.decode(copies["json"])
    print(f"load average {os.getloadavg()[0]:.1f}; {args.messages} x 1 KiB per copy")
    figures: dict[str, list[float]] = {}
    for name, encode in layouts.items():
        data = copies[name]
        enc = best_us(lambda e=encode: e(0, 3, messages, results), args.number, args.repeat)  # type: ignore[misc]
        dec = best_us(lambda d=data: wire.decode(d), args.number, args.repeat)  # type: ignore[misc]
        figures[name] = [enc / args.messages, dec / args.messages]
        print(
            f"{name:6s}: encode {figures[name][0]:5.1f} µs/msg, decode {figures[name][1]:5.1f} µs/msg, {len(data):,} B"
        )
    for i, step in enumerate(("encode", "decode")):
        print(f"FIGURE {step} binary ÷ json: {figures['binary'][i] / figures['json'][i]:.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
