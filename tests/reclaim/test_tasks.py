"""The executor-side functions outside Spark: they are plain functions over Arrow batches, so the delete
rate bound and the error-as-value paths are checked directly, with a fake clock, against a real broker."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pytest

from lmq_broker import model, testing
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.credentials import KeyPair
from lmq_reclaim import columns as c
from lmq_reclaim import keyspace, tasks
from lmq_reclaim.columns import Outcome


class Collect:
    """Stands in for a Spark accumulator: same ``add``, merged with the same AccumulatorParam."""

    def __init__(self, param: Any, zero: Any) -> None:
        self.param = param
        self.value = zero

    def add(self, term: Any) -> None:
        self.value = self.param.addInPlace(self.value, term)


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def candidates(broker: str, metas: list[model.LiteTopicMeta]) -> pa.RecordBatch:
    n = len(metas)
    return pa.RecordBatch.from_pydict(
        {
            c.BROKER: [broker] * n,
            c.PARENT: [m.parent for m in metas],
            c.LITE: [m.lite for m in metas],
            c.LAST_STORE_MS: [m.last_store_ms for m in metas],
            c.LAST_CONSUME_MS: [m.last_consume_ms for m in metas],
            c.MAX_OFFSET: [m.max_offset for m in metas],
            c.SUBSCRIBER_COUNT: pa.array([0] * n, pa.int32()),
            c.IDLE_MS: [1] * n,
            c.EXPIRATION_MINUTES: pa.array([0] * n, pa.int32()),
        }
    )


def test_deletes_of_one_broker_respect_the_rate(
    tmp_path: Path,
    seeder: Callable[..., None],
    start_brokers: Callable[[int], list[testing.BrokerProcess]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    seeds = [("Agent", f"t{i:02d}", 120, None) for i in range(30)]
    parents = [model.ParentTopic("Agent", expiration_minutes=60)]
    seeder(tmp_path / "broker-0", int(time.time() * 1000), parents, [], seeds)
    (broker,) = start_brokers(1)
    with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
        metas = [t.meta for t in admin.list_lite_topics("Agent", limit=100).topics]
    assert len(metas) == 30
    fake = FakeTime()
    stats = Collect(tasks.StatsParam(), {})
    messages = Collect(tasks.MessagesParam(), [])
    settings = tasks.DeleteSettings(
        endpoints={"broker-0": broker.admin_endpoint},
        max_deletes_per_second=10,
        batch_size=5,
        dry_run=False,
        timeout_s=30,
        credentials=KeyPair(broker.admin_access_key, broker.admin_secret_key),
    )
    run = tasks.delete_fn(settings, cast(Any, stats), cast(Any, messages), clock=fake.clock, sleep=fake.sleep)
    out = pa.Table.from_batches(list(run(iter([candidates("broker-0", metas)]))))
    assert out.column(c.OUTCOME).to_pylist() == [Outcome.DELETED.value] * 30
    assert out.schema == c.OUTCOMES
    # 10 tokens of burst, then 20 more at 10/s: at least 2 s of (fake) waiting, and not much more.
    assert 2.0 <= fake.now <= 2.5
    assert stats.value["delete_throttled_s:broker-0"] == fake.now
    assert stats.value[tasks.parent_stat(Outcome.DELETED.value, "broker-0", "Agent")] == 30.0  # summed over calls
    assert messages.value == []
    assert capsys.readouterr().err.splitlines() == ["lmq-reclaim: delete broker-0 done: 30 candidates processed"]


def test_a_dead_broker_is_an_error_value_not_a_failed_task(capsys: pytest.CaptureFixture[str]) -> None:
    stats = Collect(tasks.StatsParam(), {})
    messages = Collect(tasks.MessagesParam(), [])
    scan = tasks.scan_fn(
        [tasks.ScanTask("broker-x", "127.0.0.1:1", "Agent", keyspace.FULL_RANGE)],
        tasks.ScanSettings(batch_size=100, with_fully_consumed=False, timeout_s=10),
        cast(Any, stats),
        cast(Any, messages),
    )
    ids: Iterator[pa.RecordBatch] = iter([pa.RecordBatch.from_pydict({"id": [0]})])
    assert list(scan(ids)) == []
    assert stats.value["errors:broker-x"] == 1.0
    assert stats.value["scan_rows:broker-x"] == 0.0
    assert stats.value[tasks.parent_stat("errors", "broker-x", "Agent")] == 1.0
    assert messages.value and "UNAVAILABLE" in messages.value[0]
    assert re.fullmatch(
        r"lmq-reclaim: scan task 1/1 failed: broker-x Agent: 0 row\(s\) in \d+\.\ds\n", capsys.readouterr().err
    )

    settings = tasks.DeleteSettings({"broker-x": "127.0.0.1:1"}, 0, 100, False, 10)
    delete = tasks.delete_fn(settings, cast(Any, stats), cast(Any, messages))
    meta = model.LiteTopicMeta("Agent", "gone", 0, 0, 0, 0, 1)
    out = pa.Table.from_batches(list(delete(iter([candidates("broker-x", [meta])]))))
    assert out.column(c.OUTCOME).to_pylist() == [Outcome.ERROR.value]
    assert "UNAVAILABLE" in out.column(c.ERROR)[0].as_py()
    assert stats.value["errors:broker-x"] == 2.0
    # Per parent: one failed scan and one failed delete call; the failed row still counts as an outcome.
    assert stats.value[tasks.parent_stat("errors", "broker-x", "Agent")] == 2.0
    assert stats.value[tasks.parent_stat(Outcome.ERROR.value, "broker-x", "Agent")] == 1.0


def test_parent_stat_keys_split_back_and_other_keys_do_not() -> None:
    key = tasks.parent_stat("KEPT_CHANGED", "broker-0@10.0.0.1:8081", "orders")
    assert tasks.split_parent_stat(key) == ("KEPT_CHANGED", "broker-0@10.0.0.1:8081", "orders")
    assert tasks.split_parent_stat("errors:broker-0") is None
    assert tasks.split_parent_stat("scan_rows:a\x00b") is None
