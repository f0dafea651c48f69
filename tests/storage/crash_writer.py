"""A writer process for test_crash.py (run as a script, never collected).

It appends batches forever in ``sync`` mode and prints ``<message id> <parent offset> <lite topic> <lmq offset>
<body crc32>`` for every message once ``append`` has returned, i.e. once the store says it is durable. The test
SIGKILLs it at random points."""

from __future__ import annotations

import random
import sys
import zlib
from pathlib import Path

from lmq_broker import config, model
from lmq_broker.storage import store as store_mod

LITES = 7


def main() -> None:
    data_dir, run = Path(sys.argv[1]), sys.argv[2]
    cfg = config.StoreConfig(data_dir=data_dir, segment_max_bytes=64 * 1024, flush_mode=config.FlushMode.SYNC)
    store = store_mod.open_store(cfg)
    rec = store.recovery
    print(f"recovery reindexed={rec.records_reindexed} truncated={rec.truncated_bytes}", file=sys.stderr, flush=True)
    rng = random.Random(run)
    parent_q = model.QueueId("P", 0)
    i = 0
    while True:
        batch = []
        for _ in range(rng.randint(1, 20)):
            mid = f"{run}-{i}"
            lite = f"t{rng.randrange(LITES)}"
            queues = (parent_q, model.QueueId.lmq("P", lite))
            batch.append(model.NewMessage(mid, "P", rng.randbytes(rng.randint(1, 3000)), queues, lite_topic=lite))
            i += 1
        results = store.append(batch)
        lines = []
        for m, r in zip(batch, results, strict=True):
            offsets = f"{r.offsets[parent_q]} {m.lite_topic} {r.offsets[m.queues[1]]}"
            lines.append(f"{m.message_id} {offsets} {zlib.crc32(m.body)}\n")
        sys.stdout.write("".join(lines))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
