"""RecordReclaimRuns and the last run carried by GetParentTopic / ListParentTopics, against a real server
over the RocksDB-backed store."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lmq_broker import errors, model
from lmq_broker.admin.testing import Broker


def run_of(parent: str, run_id: str, start_ms: int, **counts: Any) -> model.ReclaimRun:
    return dataclasses.replace(model.ReclaimRun(parent, run_id, start_ms, start_ms + 60_000), **counts)


def test_a_recorded_run_comes_back_with_its_parent(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))
    admin.put_parent_topic(model.ParentTopic("jobs", expiration_minutes=-1))
    assert admin.get_parent_topic("orders").last_reclaim is None
    changes = broker.live.metadata_changes

    orders = model.ReclaimRun("orders", "lmq-reclaim-1", 1_000, 61_000, 7, 5, 3, 1, 1, 0, 2, dry_run=True)
    jobs = run_of("jobs", "lmq-reclaim-1", 1_000)
    done = admin.record_reclaim_runs([orders, jobs])

    assert (done.recorded, done.unknown_parents, done.superseded) == (("orders", "jobs"), (), ())
    assert admin.get_parent_topic("orders").last_reclaim == orders  # every field survives the round trip
    assert {i.topic.name: i.last_reclaim for i in admin.list_parent_topics()} == {"orders": orders, "jobs": jobs}
    assert broker.store.get_reclaim_run("orders") == orders  # kept by the store, not the service
    assert broker.live.metadata_changes == changes  # nothing the dispatcher caches has changed


def test_a_newer_run_replaces_the_record_and_an_older_one_does_not(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))
    newer = run_of("orders", "run-b", 2_000, reclaimed=9)
    older = run_of("orders", "run-a", 1_000, reclaimed=1)
    assert admin.record_reclaim_runs([newer]).recorded == ("orders",)

    late = admin.record_reclaim_runs([older])  # a slow run that started first finishes last

    assert (late.recorded, late.superseded) == ((), ("orders",))
    assert admin.get_parent_topic("orders").last_reclaim == newer
    again = run_of("orders", "run-b", 2_000, reclaimed=10)  # the same run recorded again (a retried Job)
    assert admin.record_reclaim_runs([again]).recorded == ("orders",)
    assert admin.get_parent_topic("orders").last_reclaim == again


def test_unknown_parents_are_skipped_not_refused(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))

    done = admin.record_reclaim_runs([run_of("gone", "r", 1), run_of("orders", "r", 1)])

    assert (done.recorded, done.unknown_parents) == (("orders",), ("gone",))
    assert broker.store.get_reclaim_run("gone") is None


def test_deleting_the_parent_drops_its_record(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))
    broker.send("orders", "s1")
    admin.record_reclaim_runs([run_of("orders", "r", 1, scanned=1)])

    with pytest.raises(errors.Conflict):  # delete-only-if-empty refuses: the record stays with its parent
        admin.delete_parent_topic("orders")
    assert admin.get_parent_topic("orders").last_reclaim is not None

    assert admin.delete_parent_topic("orders", purge_lite_topics=True).deleted
    assert broker.store.get_reclaim_run("orders") is None
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))
    assert admin.get_parent_topic("orders").last_reclaim is None  # a re-created parent starts without one


@pytest.mark.parametrize(
    ("run", "field"),
    [
        (model.ReclaimRun("bad$name", "r", 1, 2), "runs[0].parent"),
        (model.ReclaimRun("orders", "", 1, 2), "runs[0].run_id"),
        (model.ReclaimRun("orders", "a\nb", 1, 2), "runs[0].run_id"),
        (model.ReclaimRun("orders", "x" * 254, 1, 2), "runs[0].run_id"),
        (model.ReclaimRun("orders", "r", -1, 2), "runs[0].start_ms"),
        (model.ReclaimRun("orders", "r", 5, 4), "runs[0].finish_ms"),
        (model.ReclaimRun("orders", "r", 1, 2, reclaimed=-1), "runs[0].reclaimed"),
        (model.ReclaimRun("orders", "r", 1, 2, errors=-3), "runs[0].errors"),
    ],
)
def test_invalid_runs_are_refused_naming_the_field(broker: Broker, run: model.ReclaimRun, field: str) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))
    with pytest.raises(errors.InvalidArgument) as raised:
        admin.record_reclaim_runs([run])
    assert raised.value.message.startswith(field)
    assert broker.store.list_reclaim_runs() == []


def test_one_parent_twice_in_a_call_is_refused_and_nothing_is_stored(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders", expiration_minutes=60))
    with pytest.raises(errors.InvalidArgument, match="'orders' is listed more than once"):
        admin.record_reclaim_runs([run_of("orders", "a", 1), run_of("orders", "b", 2)])
    assert broker.store.list_reclaim_runs() == []
