"""What a slot holder's look at its state rows costs (``lmq_broker.replication.stating``): the rows of one slot
read from a registry export of CLIENTS clients x TOPICS lite subscriptions each (the ring's hash per topic), the
diff against what was shipped, and the encoded batch, for a first look (everything) and a look after one
client changed. The rows are made on a thread (the export, on the event loop, copies references); the holder
waits at least ten times a look's cost before the next.

    python bench/bench_state_rows.py [--clients 1000] [--topics 100] [--brokers 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from typing import Any, cast

from lmq_broker import model
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.replication import states, stating


class _Leadership:
    me = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--brokers", type=int, default=3)
    args = parser.parse_args()
    membership = mb.Membership.parse(",".join(f"b{i}:1" for i in range(args.brokers)))
    records = [
        saved_subscriptions.ClientRecord(
            f"client-{c}", 1, "G", "P", tuple(model.QueueId.lmq("P", f"t-{c}-{t}").topic for t in range(args.topics))
        )
        for c in range(args.clients)
    ]
    current = list(records)
    version = [0]
    rows = stating.States(
        cast(Any, _Leadership()), lambda topic: mb.owner(membership, topic), lambda: current,
        lambda _: None, lambda: version[0], lambda: None, lambda: 0,
    )  # fmt: skip
    tracker = states.Tracker("bench")
    for what in ("first look (every row)", "after one client changed"):
        began = time.perf_counter()
        found = asyncio.run(rows.rows(0))
        read = time.perf_counter() - began
        changes = tracker.diff(found)
        data = states.encode(states.Batch(0, 1, "bench", 1, changes))
        total = time.perf_counter() - began
        print(
            f"{what}: {len(found):,} clients' rows of slot 0 ({args.clients * args.topics:,} subscriptions on "
            f"{args.brokers} brokers): read {read * 1000:.1f} ms, read+diff+encode {total * 1000:.1f} ms, "
            f"{len(changes):,} rows shipped in {len(data):,} bytes"
        )
        current[0] = replace(current[0], lmqs=(*current[0].lmqs, model.QueueId.lmq("P", "one-more").topic))
        version[0] += 1


if __name__ == "__main__":
    main()
