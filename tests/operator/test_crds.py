"""The CRDs on a real apiserver: defaults, CEL rejections with readable messages, status round trip, printer
columns through the Table API. No operator runs here: this is what the schema alone guarantees.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from lmq_operator import model, status, testing

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def _rejected(call: Callable[[], Any]) -> str:
    with pytest.raises(testing.ApiError) as info:
        call()
    assert info.value.status == 422, info.value.body
    return info.value.message


def test_crds_are_established_with_short_names(kube: testing.KubeAPI, crds: list[str]) -> None:
    assert crds == ["litegroups.lmq.io", "litequotas.lmq.io", "parenttopics.lmq.io"]
    found = kube.get("/apis/lmq.io/v1alpha1")
    short = {r["kind"]: r.get("shortNames") for r in found["resources"] if "/" not in r["name"]}
    assert short == {"ParentTopic": ["pt"], "LiteGroup": ["lg"], "LiteQuota": ["lq"]}
    assert {r["name"] for r in found["resources"]} >= {"parenttopics/status", "litegroups/status"}


def test_defaults_are_filled_in(namespace: str, create: Callable[..., Any]) -> None:
    pt = create("ParentTopic", namespace, "orders", {})
    assert pt["spec"] == {
        "messageType": "LITE",
        "liteTopicExpirationMinutes": -1,
        "maxLiteTopics": -1,
        "deletionPolicy": "delete",
    }
    lg = create("LiteGroup", namespace, "workers", {"parentTopic": "orders"})
    assert lg["spec"]["subscriptionModel"] == "Shared"
    assert lg["spec"]["retryPolicy"]["maxAttempts"] == 17
    assert lg["spec"]["retryPolicy"]["backoff"][:3] == ["1s", "5s", "10s"]
    assert (lg["spec"]["clientSubscriptionQuota"], lg["spec"]["readySetCapacity"], lg["spec"]["fifo"]) == (
        2000,
        100,
        True,
    )
    lq = create("LiteQuota", namespace, "q", {"parentTopic": "orders"})
    assert lq["spec"]["maxLiteTopics"] == -1 and lq["spec"]["maxSendRate"] == -1


@pytest.mark.parametrize(
    ("name", "spec", "needle"),
    [
        ("bad-enum", {"messageType": "NORMAL"}, 'Unsupported value: "NORMAL"'),
        ("zero-exp", {"liteTopicExpirationMinutes": 0}, "must be -1 (never) or between 1 and 43200"),
        ("big-exp", {"liteTopicExpirationMinutes": 43201}, "less than or equal to 43200"),
        ("zero-max", {"maxLiteTopics": 0}, "spec.maxLiteTopics must be -1 (unlimited) or at least 1"),
        ("bad-policy", {"deletionPolicy": "orphan"}, 'Unsupported value: "orphan"'),
        ("bad-topic", {"topicName": "a$b"}, "spec.topicName a$b may only contain letters, digits, %, _ and -"),
        ("dotted.name", {}, "metadata.name dotted.name is not a valid broker topic name"),
    ],
)
def test_parent_topic_rejections_are_readable(
    namespace: str, create: Callable[..., Any], name: str, spec: dict[str, Any], needle: str
) -> None:
    assert needle in _rejected(lambda: create("ParentTopic", namespace, name, spec))


def test_dotted_name_is_fine_with_a_topic_name(namespace: str, create: Callable[..., Any]) -> None:
    assert create("ParentTopic", namespace, "orders.eu", {"topicName": "orders-eu"})["spec"]["topicName"]


def test_topic_name_is_immutable(kube: testing.KubeAPI, namespace: str, create: Callable[..., Any]) -> None:
    create("ParentTopic", namespace, "a", {"topicName": "alpha"})
    create("ParentTopic", namespace, "b", {})
    path_a, path_b = testing.cr_path("parenttopics", namespace, "a"), testing.cr_path("parenttopics", namespace, "b")
    needle = "spec.topicName is immutable: it cannot be added, changed or removed after creation"
    assert f"{needle} (was alpha, now beta)" in _rejected(
        lambda: kube.merge_patch(path_a, {"spec": {"topicName": "beta"}})
    )
    assert f"{needle} (was alpha, now unset)" in _rejected(
        lambda: kube.merge_patch(path_a, {"spec": {"topicName": None}})
    )
    assert f"{needle} (was unset, now b)" in _rejected(lambda: kube.merge_patch(path_b, {"spec": {"topicName": "b"}}))
    # other fields stay mutable
    patched = kube.merge_patch(path_a, {"spec": {"liteTopicExpirationMinutes": 5}})
    assert patched["spec"]["liteTopicExpirationMinutes"] == 5 and patched["metadata"]["generation"] == 2


def test_lite_group_rejections(kube: testing.KubeAPI, namespace: str, create: Callable[..., Any]) -> None:
    assert 'Unsupported value: "Broadcast"' in _rejected(
        lambda: create("LiteGroup", namespace, "g1", {"parentTopic": "t", "subscriptionModel": "Broadcast"})
    )
    assert "retryPolicy.backoff entry 5 sec is not a duration" in _rejected(
        lambda: create("LiteGroup", namespace, "g2", {"parentTopic": "t", "retryPolicy": {"backoff": ["5 sec"]}})
    )
    assert "spec.parentTopic: Required value" in _rejected(lambda: create("LiteGroup", namespace, "g3", {}))
    create("LiteGroup", namespace, "g4", {"parentTopic": "t"})
    path = testing.cr_path("litegroups", namespace, "g4")
    assert "spec.parentTopic is immutable: a lite group stays bound to its parent topic (was t, now other)" in (
        _rejected(lambda: kube.merge_patch(path, {"spec": {"parentTopic": "other"}}))
    )
    assert "spec.groupName is immutable: it cannot be added, changed or removed after creation (was unset, now x)" in (
        _rejected(lambda: kube.merge_patch(path, {"spec": {"groupName": "x"}}))
    )


def test_lite_quota_rejections(kube: testing.KubeAPI, namespace: str, create: Callable[..., Any]) -> None:
    both = {"rocketmqNamespace": "prod", "parentTopic": "orders"}
    one_msg = "exactly one of spec.rocketmqNamespace and spec.parentTopic must be set"
    assert one_msg in _rejected(lambda: create("LiteQuota", namespace, "q1", both))
    assert one_msg in _rejected(lambda: create("LiteQuota", namespace, "q2", {}))
    assert "greater than or equal to -1" in _rejected(
        lambda: create("LiteQuota", namespace, "q3", {"parentTopic": "o", "maxSendRate": -5})
    )
    create("LiteQuota", namespace, "q4", {"rocketmqNamespace": "prod"})
    path = testing.cr_path("litequotas", namespace, "q4")
    scope = "scope (spec.rocketmqNamespace / spec.parentTopic) is immutable: create another LiteQuota instead"
    assert f"{scope} (was rocketmqNamespace prod, now rocketmqNamespace dev)" in _rejected(
        lambda: kube.merge_patch(path, {"spec": {"rocketmqNamespace": "dev"}})
    )
    assert f"{scope} (was rocketmqNamespace prod, now parentTopic orders)" in _rejected(
        lambda: kube.merge_patch(path, {"spec": {"rocketmqNamespace": None, "parentTopic": "orders"}})
    )


def test_status_the_operator_writes_is_not_pruned(
    kube: testing.KubeAPI, namespace: str, create: Callable[..., Any]
) -> None:
    """Every field status.py produces survives the schema (kopf's patches would silently lose them otherwise)."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    b0 = model.Broker("b0", "10.0.0.1:8081", 0)
    b1 = model.Broker("b1", "10.0.0.2:8081", 1)
    cases = {
        ("ParentTopic", "parenttopics", "pt", model.Kind.PARENT_TOPIC): {},
        ("LiteGroup", "litegroups", "lg", model.Kind.LITE_GROUP): {"parentTopic": "pt"},
        ("LiteQuota", "litequotas", "lq", model.Kind.LITE_QUOTA): {"parentTopic": "pt"},
    }
    for (kind, plural, name, k), spec in cases.items():
        create(kind, namespace, name, spec)
        figures = tuple((f, 3) for f in status.FIGURES[k])
        run = model.ReclaimRun("lmq-reclaim-29000000", 1_767_225_600_000, 1_767_225_690_123, 5, 4, 2, 1, 0, 1, 0)
        syncs = [
            model.BrokerSync(b0, True, "missing", figures=figures, reclaim=run),
            model.BrokerSync(b1, False, "", model.Failure.UNAVAILABLE, "UNAVAILABLE: down"),
        ]
        st = status.applied(k, name, generation=1, syncs=syncs, previous={}, now=now)
        if k is model.Kind.PARENT_TOPIC:
            leaving = [model.Leaving(b1, 1, 5)]
            status.with_condition(st, status.drained(leaving, {}, now))
            assert set(st["lastReclaim"]) == {name for name, _ in status.RECLAIM_COUNTS} | {
                "runId", "startTime", "finishTime", "dryRun", "brokers",
            }  # fmt: skip
        back = kube.merge_patch(testing.cr_path(plural, namespace, name) + "/status", {"status": st})
        assert back["status"] == st, kind


def test_printer_columns_via_the_table_api(kube: testing.KubeAPI, namespace: str, create: Callable[..., Any]) -> None:
    create("ParentTopic", namespace, "orders", {"liteTopicExpirationMinutes": 30})
    now = datetime(2026, 1, 1, tzinfo=UTC)
    run = model.ReclaimRun("job-1", 1_767_225_600_000, 1_767_225_660_000, reclaimed=12)
    broker = model.Broker("b0", "h:1", 0)
    syncs = [model.BrokerSync(broker, True, figures=(("liteTopicCount", 4),), reclaim=run)]
    st = status.applied(model.Kind.PARENT_TOPIC, "orders", generation=1, syncs=syncs, previous={}, now=now)
    kube.merge_patch(testing.cr_path("parenttopics", namespace, "orders") + "/status", {"status": st})
    table = kube.get(testing.cr_path("parenttopics", namespace), accept=TABLE)
    assert table["kind"] == "Table"
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == [
        "Name", "Topic", "Type", "Expiration", "Lite-Topics", "Brokers", "Ready", "Reason",
        "Reclaimed", "Last-Reclaim", "Age",
    ]  # fmt: skip
    # The reclaim columns are for `kubectl get -o wide` only.
    assert [c["priority"] for c in table["columnDefinitions"]][8:10] == [1, 1]
    cells = table["rows"][0]["cells"]
    assert cells[:9] == ["orders", "orders", "LITE", 30, 4, "1/1", "True", "Applied", 12]
    assert re.fullmatch(r"\d+[smhdy]\w*", cells[9]), cells[9]  # a date column shows the age of finishTime

    create("LiteGroup", namespace, "workers", {"parentTopic": "orders"})
    lg_columns = [
        c["name"] for c in kube.get(testing.cr_path("litegroups", namespace), accept=TABLE)["columnDefinitions"]
    ]
    assert lg_columns == [
        "Name",
        "Group",
        "Parent",
        "Model",
        "Subscriptions",
        "Lag",
        "Brokers",
        "Ready",
        "Reason",
        "Age",
    ]
    create("LiteQuota", namespace, "quota", {"rocketmqNamespace": "prod", "maxLiteTopics": 100})
    lq = kube.get(testing.cr_path("litequotas", namespace), accept=TABLE)
    assert [c["name"] for c in lq["columnDefinitions"]][:5] == [
        "Name",
        "Scope",
        "Max-Lite-Topics",
        "Subs-Per-Client",
        "Send-Rate",
    ]
    assert lq["rows"][0]["cells"][2:5] == [100, -1, -1]
