"""The send path's fast twins against their plain twins, CPU per message in one process (issue 30 item 1).

``MessageReader.read_all`` and ``codec.prepare`` are the fast twins the broker runs; ``read_all_plain`` and
``prepare_plain`` say the same thing plainly, and tests check each pair gives the same values and errors
(tests/broker/protocol/test_convert.py, tests/storage/test_codec.py). A fast twin stays only while it pays:
this prints both, alternating rounds in one process (so the machine's load moves both alike), 1,000 LITE
messages of 128 B over 10,000 lite topics, every name already cached.

    python bench/bench_send_twins.py            # ~10 s
    python bench/bench_send_twins.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lmq_broker import model
from lmq_broker.dispatch import metadata
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol import convert
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.storage import codec, keys

MESSAGES = 1000


def request() -> spb.SendMessageRequest:
    sent = [
        pb.Message(
            topic=pb.Resource(name="P"),
            body=b"x" * 128,
            system_properties=pb.SystemProperties(
                message_id=f"ID{i:024d}",
                message_type=pb.LITE,
                lite_topic=f"t{i % 10_000}",
                born_host="10.0.0.1",
                born_timestamp=convert.timestamp_of(1_700_000_000_000),
            ),
        )
        for i in range(MESSAGES)
    ]
    return spb.SendMessageRequest.FromString(spb.SendMessageRequest(messages=sent).SerializeToString())


def twins(tmp: Path) -> dict[str, Callable[[], object]]:
    config = config_for(tmp)
    snap = metadata.Metadata(config, {"P": model.ParentTopic("P", model.MessageType.LITE)})
    cache, names, sent = convert.SendCache(), keys.NameCache(), request().messages

    def reader() -> convert.MessageReader:
        return convert.MessageReader(snap, config, 1, 0, cache)

    read = reader().read_all(sent)
    for m in read:
        codec.prepare(m, names, 1 << 20, 5)
    return {
        "read_all (fast)": lambda: reader().read_all(sent),
        "read_all_plain": lambda: reader().read_all_plain(sent),
        "prepare (fast)": lambda: [codec.prepare(m, names, 1 << 20, 5) for m in read],
        "prepare_plain": lambda: [codec.prepare_plain(m, names, 1 << 20, 5) for m in read],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        fns = twins(Path(tmp))
        cpu: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.process_time()
                fn()
                cpu[name].append((time.process_time() - start) / MESSAGES * 1e6)
    median = {name: statistics.median(values) for name, values in cpu.items()}
    for name, values in cpu.items():
        print(f"{name}: {median[name]:.2f} us/msg (range {min(values):.2f}-{max(values):.2f}, {rounds} rounds)")
    for fast, plain in (("read_all (fast)", "read_all_plain"), ("prepare (fast)", "prepare_plain")):
        print(f"FIGURE {plain} / {fast}: {median[plain] / median[fast]:.2f} (a fast twin stays while > 1)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
