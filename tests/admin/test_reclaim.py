"""ScanLiteTopics and CompareAndDeleteLiteTopics as the reclaim job uses them: columns in, columns out."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.admin import client as client_module
from lmq_broker.admin.client import COMPARE_COLUMNS, LITE_TOPIC_COLUMNS, DeleteOutcome
from lmq_broker.admin.testing import Broker
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc
from lmq_broker.storage.memory import ManualClock


def _concat(batches: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    joined: dict[str, list[Any]] = {}
    for batch in batches:
        for name, values in batch.items():
            joined.setdefault(name, []).extend(values)
    return joined


def _take(columns: dict[str, list[Any]], lites: set[str]) -> dict[str, list[Any]]:
    """The rows of ``columns`` whose lite name is in ``lites``, still as columns."""
    keep = [i for i, lite in enumerate(columns["lite"]) if lite in lites]
    return {name: [values[i] for i in keep] for name, values in columns.items()}


# --- scan ---------------------------------------------------------------------------------------------------
def test_scan_streams_batches_in_key_order(broker: Broker) -> None:
    names = [f"l{i:02d}" for i in range(25)]
    for name in reversed(names):
        broker.send("p", name)
    broker.send("q", "l00")

    batches = list(broker.client().scan_lite_topics_columns("p", batch_size=10))

    assert [len(b["lite"]) for b in batches] == [10, 10, 5]
    assert all(list(b) == list(LITE_TOPIC_COLUMNS) for b in batches)
    rows = _concat(batches)
    assert rows["lite"] == names
    assert set(rows["parent"]) == {"p"}
    assert rows["max_offset"] == [1] * 25
    assert all(ms > 0 for ms in rows["last_store_ms"])
    assert all(len(values) == 25 for values in rows.values())


def test_scan_honours_exclusive_bounds_within_a_parent(broker: Broker) -> None:
    for i in range(25):
        broker.send("p", f"l{i:02d}")

    batches = list(broker.client().scan_lite_topics_columns("p", start_after="l04", end_before="l20", batch_size=10))

    assert [len(b["lite"]) for b in batches] == [10, 5]
    assert _concat(batches)["lite"] == [f"l{i:02d}" for i in range(5, 20)]


def test_scan_across_parents_resumes_from_parent_dollar_lite_keys(broker: Broker) -> None:
    for parent in ("p", "q"):
        for i in range(4):
            broker.send(parent, f"l{i}")

    batches = list(broker.client().scan_lite_topics_columns(start_after="p$l1", end_before="q$l3", batch_size=2))

    rows = _concat(batches)
    assert list(zip(rows["parent"], rows["lite"], strict=True)) == [
        ("p", "l2"),
        ("p", "l3"),
        ("q", "l0"),
        ("q", "l1"),
        ("q", "l2"),
    ]
    assert [len(b["lite"]) for b in batches] == [2, 2, 1]


def test_scan_of_an_empty_range_yields_nothing(memory_broker: Broker) -> None:
    assert list(memory_broker.client().scan_lite_topics_columns("nothing-here")) == []


def test_scan_adds_subscriber_counts_and_fully_consumed_when_asked(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    admin.put_group(model.LiteGroup("g1", bind_topic="orders"))
    admin.put_group(model.LiteGroup("g2", bind_topic="orders"))
    broker.send("orders", "all-consumed", count=2)
    broker.consume("orders", "all-consumed", "g1", 2)
    broker.consume("orders", "all-consumed", "g2", 2)
    broker.send("orders", "half-consumed", count=2)
    broker.consume("orders", "half-consumed", "g1", 2)
    broker.send("orphans", "no-group")
    broker.subscribe("orders", "half-consumed", "c1", "c2")

    rows = _concat(list(admin.scan_lite_topics_columns(with_subscribers=True, with_fully_consumed=True)))

    assert list(rows) == [*LITE_TOPIC_COLUMNS, "subscriber_count", "fully_consumed"]
    by_lite = {lite: i for i, lite in enumerate(rows["lite"])}
    assert rows["subscriber_count"][by_lite["half-consumed"]] == 2
    assert rows["subscriber_count"][by_lite["all-consumed"]] == 0
    assert rows["fully_consumed"][by_lite["all-consumed"]] is True
    assert rows["fully_consumed"][by_lite["half-consumed"]] is False
    assert rows["fully_consumed"][by_lite["no-group"]] is False


def test_scan_refuses_a_batch_size_out_of_range(memory_broker: Broker) -> None:
    with pytest.raises(errors.InvalidArgument, match="batch_size"):
        list(memory_broker.client().scan_lite_topics_columns(batch_size=-1))


def test_scan_pushes_the_idle_filter_down_and_pages_over_skipped_rows(
    clocked_broker: Broker, clock: ManualClock
) -> None:
    broker = clocked_broker
    for i in range(30):
        broker.send("p", f"l{i:02d}")
        clock.advance(1)
    cut = clock()
    clock.advance(1)
    fresh = {f"l{i:02d}" for i in range(30) if i % 3}  # two thirds become active after the cut
    for lite in sorted(fresh):
        if lite < "l15":
            broker.send("p", lite)
        else:
            broker.consume("p", lite, "g", 1)
    admin = broker.client()

    batches = list(admin.scan_lite_topics_columns("p", batch_size=4, idle_since_before_ms=cut, with_subscribers=True))

    rows = _concat(batches)
    assert rows["lite"] == [f"l{i:02d}" for i in range(0, 30, 3)]
    assert [len(b["lite"]) for b in batches] == [4, 4, 2]  # batch_size counts returned rows
    assert all(len(values) == 10 for values in rows.values())
    assert max(rows["last_store_ms"]) < cut
    everything = _concat(list(admin.scan_lite_topics_columns("p")))
    assert len(everything["lite"]) == 30  # 0: no filter


def test_scan_refuses_a_negative_idle_filter(memory_broker: Broker) -> None:
    with pytest.raises(errors.InvalidArgument, match="idle_since_before_ms"):
        list(memory_broker.client().scan_lite_topics_columns(idle_since_before_ms=-1))


def test_a_scan_can_be_abandoned_midway(broker: Broker) -> None:
    for i in range(6):
        broker.send("p", f"l{i}")
    admin = broker.client()
    batches = admin.scan_lite_topics_columns("p", batch_size=2)

    first = next(batches)
    batches.close()

    assert first["lite"] == ["l0", "l1"]
    assert admin.list_lite_topics("p", limit=1).topics[0].meta.lite == "l0"  # the channel still serves


# --- compare-and-delete -------------------------------------------------------------------------------------
def test_compare_and_delete_keeps_what_changed_or_is_subscribed(broker: Broker) -> None:
    for lite in ("idle-1", "idle-2", "written", "consumed", "subscribed"):
        broker.send("orders", lite)
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders")))
    broker.send("orders", "written")  # a message after the scan
    broker.consume("orders", "consumed", "g", 1)  # a consume after the scan
    broker.subscribe("orders", "subscribed", "client-1")

    outcomes = admin.compare_and_delete(scanned, require_no_subscribers=True)

    assert dict(zip(scanned["lite"], outcomes, strict=True)) == {
        "consumed": DeleteOutcome.KEPT_CHANGED,
        "idle-1": DeleteOutcome.DELETED,
        "idle-2": DeleteOutcome.DELETED,
        "subscribed": DeleteOutcome.KEPT_SUBSCRIBED,
        "written": DeleteOutcome.KEPT_CHANGED,
    }
    assert broker.store.lite_topic("orders", "idle-1") is None
    assert broker.store.lite_topic("orders", "written") is not None
    assert broker.store.lite_topic("orders", "subscribed") is not None
    assert sorted(broker.live.forgotten) == [
        model.QueueId.lmq("orders", "idle-1"),
        model.QueueId.lmq("orders", "idle-2"),
    ]


def test_compare_and_delete_rerun_is_idempotent(broker: Broker) -> None:
    for lite in ("a", "b"):
        broker.send("orders", lite)
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders")))

    first = admin.compare_and_delete(scanned)
    again = admin.compare_and_delete(scanned)

    assert first == [DeleteOutcome.DELETED, DeleteOutcome.DELETED]
    assert again == [DeleteOutcome.NOT_FOUND, DeleteOutcome.NOT_FOUND]
    assert len(broker.live.forgotten) == 2


def test_a_topic_recreated_after_its_deletion_is_kept(broker: Broker) -> None:
    broker.send("orders", "s1", count=2)
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders")))
    assert admin.compare_and_delete(scanned) == [DeleteOutcome.DELETED]

    broker.send("orders", "s1")  # a producer re-creates it; a stale re-run must not delete it

    assert admin.compare_and_delete(scanned) == [DeleteOutcome.KEPT_CHANGED]
    assert broker.store.lite_topic("orders", "s1") is not None


def test_dry_run_reports_without_deleting(broker: Broker) -> None:
    for lite in ("a", "b", "c"):
        broker.send("orders", lite)
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders")))
    broker.send("orders", "b")
    broker.subscribe("orders", "c", "client-1")

    outcomes = admin.compare_and_delete(scanned, dry_run=True)

    assert outcomes == [DeleteOutcome.WOULD_DELETE, DeleteOutcome.KEPT_CHANGED, DeleteOutcome.KEPT_SUBSCRIBED]
    assert broker.store.lite_topic_count("orders") == 3
    assert broker.live.forgotten == []


def test_subscribers_do_not_protect_a_topic_unless_asked(broker: Broker) -> None:
    broker.send("orders", "s1")
    broker.subscribe("orders", "s1", "client-1")
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders")))

    assert admin.compare_and_delete(scanned, require_no_subscribers=False) == [DeleteOutcome.DELETED]
    assert broker.live.forgotten == [model.QueueId.lmq("orders", "s1")]
    assert broker.live.subscribers(model.QueueId.lmq("orders", "s1")) == []


def test_only_subscribers_beyond_those_the_scan_saw_keep_a_topic(broker: Broker) -> None:
    for lite in ("seen", "grew", "none"):
        broker.send("orders", lite)
    broker.subscribe("orders", "seen", "client-1")
    broker.subscribe("orders", "grew", "client-1")
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders", with_subscribers=True)))
    broker.subscribe("orders", "grew", "client-2")  # after the scan

    outcomes = admin.compare_and_delete(scanned, subscribers_seen=True)

    assert dict(zip(scanned["lite"], outcomes, strict=True)) == {
        "grew": DeleteOutcome.KEPT_SUBSCRIBED,
        "none": DeleteOutcome.DELETED,
        "seen": DeleteOutcome.DELETED,
    }
    assert broker.store.lite_topic("orders", "grew") is not None


def test_expected_subscriber_counts_must_be_one_per_row_and_not_negative(broker: Broker) -> None:
    broker.send("orders", "s1")
    meta = broker.store.lite_topic("orders", "s1")
    assert meta is not None
    row = {
        "parent": ["orders"],
        "lite": ["s1"],
        "expected_max_offset": [meta.max_offset],
        "expected_last_store_ms": [meta.last_store_ms],
        "expected_last_consume_ms": [meta.last_consume_ms],
        "require_no_subscribers": True,
    }
    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = admin_pb2_grpc.LmqAdminStub(channel)
        for counts, message in (([0, 0], "differ in length"), ([-1], "expected_subscriber_count")):
            with pytest.raises(grpc.RpcError) as raised:
                request = pb.CompareAndDeleteRequest(**row, expected_subscriber_count=counts)  # type: ignore[arg-type]
                stub.CompareAndDeleteLiteTopics(request, timeout=10)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (raised.value.details() or "")
    assert broker.store.lite_topic("orders", "s1") is not None


def test_only_the_compare_columns_are_needed_and_calls_are_chunked(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "DELETE_ROWS_PER_CALL", 2)
    for i in range(5):
        broker.send("orders", f"s{i}")
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders", with_subscribers=True)))
    broker.send("orders", "s3")
    rows = {name: scanned[name] for name in COMPARE_COLUMNS}

    outcomes = admin.compare_and_delete(rows)

    assert outcomes == [DeleteOutcome.DELETED] * 3 + [DeleteOutcome.KEPT_CHANGED, DeleteOutcome.DELETED]


def test_compare_and_delete_refuses_ragged_or_invalid_rows(broker: Broker) -> None:
    broker.send("orders", "s1")
    admin = broker.client()
    scanned = _concat(list(admin.scan_lite_topics_columns("orders")))

    with pytest.raises(errors.InvalidArgument, match="last_store_ms"):
        admin.compare_and_delete({k: v for k, v in scanned.items() if k != "last_store_ms"})
    bad = {**scanned, "parent": ["orders", "orders"], "lite": ["s1", "not valid"]}
    bad = {k: (v * 2 if len(v) == 1 else v) for k, v in bad.items()}
    with pytest.raises(errors.InvalidLiteTopic, match=r"lite\[1\]"):
        admin.compare_and_delete(bad)
    assert broker.store.lite_topic("orders", "s1") is not None  # a refused request deletes nothing

    with grpc.insecure_channel(broker.endpoint) as channel:
        stub = admin_pb2_grpc.LmqAdminStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.CompareAndDeleteLiteTopics(pb.CompareAndDeleteRequest(parent=["orders"], lite=["s1"]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "differ in length" in (raised.value.details() or "")
