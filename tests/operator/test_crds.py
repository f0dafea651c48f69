"""The CRDs on a real apiserver: defaults, CEL rejections with readable messages, the broker's name limits at
admission, status round trip, printer columns through the Table API, descriptions in the served OpenAPI v3.
No operator runs here: this is what the schema alone guarantees.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from lmq_operator import crd, desired, model, status, testing

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def _rejected(call: Callable[[], Any]) -> str:
    with pytest.raises(testing.ApiError) as info:
        call()
    assert info.value.status == 422, info.value.body
    return info.value.message


def test_crds_are_established_with_short_names(kube: testing.KubeAPI, crds: list[str]) -> None:
    assert crds == ["litegroups.lmq.io", "litequotas.lmq.io", "lmqusers.lmq.io", "parenttopics.lmq.io"]
    found = kube.get("/apis/lmq.io/v1alpha1")
    short = {r["kind"]: r.get("shortNames") for r in found["resources"] if "/" not in r["name"]}
    assert short == {"ParentTopic": ["pt"], "LiteGroup": ["lg"], "LiteQuota": ["lq"], "LmqUser": ["lu"]}
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
    assert "spec.retryPolicy.backoff: Invalid value: 0: spec.retryPolicy.backoff in body should have at least 1" in (
        _rejected(lambda: create("LiteGroup", namespace, "g7", {"parentTopic": "t", "retryPolicy": {"backoff": []}}))
    )
    assert "spec.litePatterns needs spec.wildcard: true" in _rejected(
        lambda: create("LiteGroup", namespace, "g5", {"parentTopic": "t", "litePatterns": ["s-*"]})
    )
    assert "spec.litePatterns entry a b may only contain" in _rejected(
        lambda: create("LiteGroup", namespace, "g6", {"parentTopic": "t", "wildcard": True, "litePatterns": ["a b"]})
    )
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
        ("LmqUser", "lmqusers", "lu", model.Kind.LMQ_USER): {"secretRef": {"name": "s"}},
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
        if k is model.Kind.LMQ_USER:
            st["secretVersion"] = "s/secretKey@123"
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


LONGEST = "n" * 127  # the broker's MAX_RESOURCE_NAME_BYTES
TOO_LONG = "n" * 128


@pytest.mark.parametrize(
    "case",
    [
        ("ParentTopic", "long-topic", {"topicName": TOO_LONG}, "spec.topicName: Too long: may not be more than 127"),
        ("ParentTopic", TOO_LONG, {}, f"metadata.name {TOO_LONG} is not a valid broker topic name"),
        ("LiteGroup", "long-group", {"parentTopic": "t", "groupName": TOO_LONG}, "spec.groupName: Too long"),
        ("LiteGroup", "long-parent", {"parentTopic": TOO_LONG}, "spec.parentTopic: Too long"),
        ("LiteGroup", TOO_LONG, {"parentTopic": "t"}, f"metadata.name {TOO_LONG} is not a valid broker group name"),
        ("LiteQuota", "long-ns", {"rocketmqNamespace": TOO_LONG}, "spec.rocketmqNamespace: Too long"),
        ("LiteQuota", "long-scope", {"parentTopic": TOO_LONG}, "spec.parentTopic: Too long"),
        ("LiteQuota", "dotted-ns", {"rocketmqNamespace": "team.a"}, "spec.rocketmqNamespace team.a may only contain"),
        ("LiteQuota", "wide", {"parentTopic": "t", "maxSubscriptionsPerClient": 2**31}, "2147483647"),
        ("LiteGroup", "zero-delay", {"parentTopic": "t", "retryPolicy": {"backoff": ["0s"]}}, "(at least 1ms)"),
    ],
)
def test_what_a_broker_would_refuse_is_refused_at_admission(
    namespace: str, create: Callable[..., Any], case: tuple[str, str, dict[str, Any], str]
) -> None:
    """Names longer than the broker accepts (127), or with characters it refuses, never reach the operator."""
    kind, name, spec, needle = case
    assert needle in _rejected(lambda: create(kind, namespace, name, spec))


def test_the_longest_names_the_broker_accepts_are_admitted(namespace: str, create: Callable[..., Any]) -> None:
    assert create("ParentTopic", namespace, LONGEST, {})["metadata"]["name"] == LONGEST
    assert create("ParentTopic", namespace, TOO_LONG, {"topicName": LONGEST})["spec"]["topicName"] == LONGEST
    group = create("LiteGroup", namespace, "g", {"parentTopic": LONGEST, "groupName": LONGEST})
    assert group["spec"]["groupName"] == LONGEST
    quota = create("LiteQuota", namespace, "q", {"rocketmqNamespace": LONGEST})
    assert quota["spec"]["rocketmqNamespace"] == LONGEST
    for name in (LONGEST, TOO_LONG):  # what the operator parses agrees with what the apiserver admitted
        assert not isinstance(
            desired.config(model.Kind.PARENT_TOPIC, name, {"topicName": LONGEST}), desired.InvalidSpec
        )
    assert isinstance(desired.config(model.Kind.PARENT_TOPIC, TOO_LONG, {}), desired.InvalidSpec)


def _served_schemas(kube: testing.KubeAPI) -> dict[str, Any]:
    """What `kubectl explain` reads: the apiserver's OpenAPI v3 document of lmq.io/v1alpha1, once it is published
    for every kind (the apiserver builds it a moment after the CRDs are established)."""
    wanted = {f"io.lmq.{model.VERSION}.{r.kind.value}" for r in crd.RESOURCES}

    def published() -> dict[str, Any] | None:
        url = kube.get("/openapi/v3")["paths"][f"apis/{model.GROUP}/{model.VERSION}"]["serverRelativeURL"]
        schemas: dict[str, Any] = kube.get(url)["components"]["schemas"]
        return schemas if wanted <= schemas.keys() else None

    return testing.wait_for(published, 30.0, f"/openapi/v3 to describe {sorted(wanted)}")


def _described(node: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    """(path, description) of ``node`` and of every field below it, array entries that are objects included
    (`kubectl explain` describes those; an entry that is a plain string or number has only its array's)."""
    yield path, node.get("description", "")
    for name, child in node.get("properties", {}).items():
        yield from _described(child, f"{path}.{name}")
    items = node.get("items")
    if isinstance(items, dict) and items.get("type") == "object":
        yield from _described(items, f"{path}[]")


def test_the_apiserver_serves_a_description_for_every_field(kube: testing.KubeAPI, crds: list[str]) -> None:
    """`kubectl explain parenttopic.spec.<field>` shows text, never `<empty>`: every spec and status field of
    every kind has a description in the apiserver's /openapi/v3, and it is the model's."""
    schemas = _served_schemas(kube)
    for resource in crd.RESOURCES:
        served = schemas[f"io.lmq.{model.VERSION}.{resource.kind.value}"]
        assert (
            served["description"]
            == crd.manifest(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"]
        )
        fields = [
            *_described(served["properties"]["spec"], "spec"),
            *_described(served["properties"]["status"], "status"),
        ]
        assert len(fields) > 10, resource.kind
        assert [path for path, text in fields if not text.strip()] == [], resource.kind
    lite_group = schemas[f"io.lmq.{model.VERSION}.LiteGroup"]["properties"]["spec"]["properties"]
    assert (
        lite_group["readySetCapacity"]["description"]
        == model.LiteGroupSpec.model_fields["ready_set_capacity"].description
    )
    assert lite_group["parentTopic"]["description"].endswith("Immutable.")
