"""The operator as a process against a real apiserver and real brokers: every admin call here is real.

Each test runs its own operator restricted to its own namespace; the two brokers are shared, so broker-side
names carry a unique suffix.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from lmq_broker import errors
from lmq_broker import model as broker_model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as v2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2, service_pb2_grpc
from lmq_operator import model, testing

Create = Callable[..., Any]
AdminOf = Callable[[str], AdminClient]
TIMEOUT_S = 30.0


def ready(obj: Any) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == "Ready":
            found: dict[str, Any] = cond
            return found
    return None


def wait_condition(
    kube: testing.KubeAPI, path: str, status: str, reason: str, *, current: bool = True, timeout_s: float = TIMEOUT_S
) -> Any:
    """Wait for Ready=<status>/<reason>; with ``current``, also for observedGeneration == generation."""

    def check() -> Any:
        obj = kube.get(path)
        cond = ready(obj)
        if cond is None or (cond["status"], cond["reason"]) != (status, reason):
            return None
        if current and obj["status"].get("observedGeneration") != obj["metadata"]["generation"]:
            return None
        return obj

    try:
        return testing.wait_for(check, timeout_s, f"{path} Ready={status}/{reason}")
    except TimeoutError:
        raise AssertionError(f"{path} never reached Ready={status}/{reason}: {kube.get(path).get('status')}") from None


def event_reasons(kube: testing.KubeAPI, namespace: str, name: str) -> set[str]:
    items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return {e["reason"] for e in items if e["involvedObject"]["name"] == name}


def event_messages(kube: testing.KubeAPI, namespace: str, name: str, reason: str) -> list[str]:
    items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return [e["message"] for e in items if e["involvedObject"]["name"] == name and e["reason"] == reason]


def has_topic(admin: AdminClient, name: str) -> bool:
    try:
        admin.get_parent_topic(name)
    except errors.NotFound:
        return False
    return True


def test_parent_topic_reaches_every_broker_and_reports_status(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    op = run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic = unique("orders")
    create("ParentTopic", namespace, "orders", {"topicName": topic, "liteTopicExpirationMinutes": 30})
    path = testing.cr_path("parenttopics", namespace, "orders")
    obj = wait_condition(kube, path, "True", "Applied")
    st = obj["status"]
    assert obj["metadata"]["finalizers"] == ["lmq.io/finalizer"]
    assert (st["topicName"], st["brokersReady"], st["liteTopicCount"]) == (topic, "2/2", 0)
    assert sorted(b["endpoint"] for b in st["brokers"]) == sorted(b.admin_endpoint for b in brokers)
    assert all(b["synced"] for b in st["brokers"])
    for b in brokers:
        info = admin_of(b.admin_endpoint).get_parent_topic(topic)
        assert (info.topic.expiration_minutes, info.topic.max_lite_topics) == (30, -1)
    testing.wait_for(lambda: "Created" in event_reasons(kube, namespace, "orders"), TIMEOUT_S, "Created event")

    kube.merge_patch(path, {"spec": {"liteTopicExpirationMinutes": 90, "maxLiteTopics": 1000}})
    obj = wait_condition(kube, path, "True", "Applied")
    assert obj["metadata"]["generation"] == 2 == obj["status"]["observedGeneration"]
    for b in brokers:
        info = admin_of(b.admin_endpoint).get_parent_topic(topic)
        assert (info.topic.expiration_minutes, info.topic.max_lite_topics) == (90, 1000)
    testing.wait_for(lambda: "Updated" in event_reasons(kube, namespace, "orders"), TIMEOUT_S, "Updated event")

    table = kube.get(testing.cr_path("parenttopics", namespace), accept="application/json;as=Table;v=v1;g=meta.k8s.io")
    assert table["rows"][0]["cells"][:8] == ["orders", topic, "LITE", 90, 0, "2/2", "True", "Applied"]
    assert "lastReclaim" not in kube.get(path)["status"]  # no run has recorded anything yet

    # A reclaim run leaves each broker's share on the topic; the next resync shows their sum.
    start_ms = 1_767_225_600_000
    for i, b in enumerate(brokers):
        finish_ms = start_ms + 60_000 + i
        share = broker_model.ReclaimRun(topic, "lmq-reclaim-1", start_ms, finish_ms, 5, 3, 2 + i, kept_changed=1)
        assert admin_of(b.admin_endpoint).record_reclaim_runs([share]).recorded == (topic,)

    def both_shares() -> Any:
        last = kube.get(path)["status"].get("lastReclaim")
        return last if last and last["brokers"] == 2 else None

    assert testing.wait_for(both_shares, TIMEOUT_S, "status.lastReclaim of both brokers") == {
        "runId": "lmq-reclaim-1",
        "startTime": "2026-01-01T00:00:00.000Z",
        "finishTime": "2026-01-01T00:01:00.001Z",
        "dryRun": False,
        "brokers": 2,
        "scanned": 10,
        "expired": 6,
        "reclaimed": 5,
        "keptByRace": 2,
        "notFound": 0,
        "errors": 0,
    }

    metrics = op.metrics()
    assert 'lmq_operator_reconciliations_total{kind="ParentTopic",trigger="create"}' in metrics
    assert "lmq_operator_reconcile_duration_seconds_bucket" in metrics
    assert "lmq_operator_brokers 2.0" in metrics


def test_lite_group_and_quota_are_applied(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic, group = unique("events"), unique("workers")
    # the group is created first: the brokers refuse it until its parent exists, and the operator retries
    create(
        "LiteGroup",
        namespace,
        "workers",
        {
            "groupName": group,
            "parentTopic": topic,
            "subscriptionModel": "Exclusive",
            "retryPolicy": {"maxAttempts": 4, "backoff": ["1s", "10s"]},
            "fifo": False,
        },
    )
    lg_path = testing.cr_path("litegroups", namespace, "workers")
    rejected = wait_condition(kube, lg_path, "False", "ParentTopicNotFound")
    assert "not found" in ready(rejected)["message"]  # type: ignore[index]
    create("ParentTopic", namespace, "events", {"topicName": topic})
    create("LiteQuota", namespace, "events-quota", {"parentTopic": topic, "maxLiteTopics": 500, "maxSendRate": 50})
    lg = wait_condition(kube, lg_path, "True", "Applied")
    assert (lg["status"]["groupName"], lg["status"]["subscriptionCount"], lg["status"]["lag"]) == (group, 0, 0)
    lq = wait_condition(kube, testing.cr_path("litequotas", namespace, "events-quota"), "True", "Applied")
    assert lq["status"]["scope"] == f"parent:{topic}"
    for b in brokers:
        admin = admin_of(b.admin_endpoint)
        stored = admin.get_group(group).group
        assert (stored.bind_topic, stored.model, stored.fifo) == (
            topic,
            broker_model.SubscriptionModel.EXCLUSIVE,
            False,
        )
        assert (stored.retry.max_attempts, stored.retry.backoff_ms) == (4, (1_000, 10_000))
        quota = next(q for q in admin.list_quotas() if q.scope == f"parent:{topic}")
        assert (quota.max_lite_topics, quota.max_send_rate, quota.max_subscriptions_per_client) == (500, 50, -1)


def test_delete_cleans_brokers_and_retain_keeps_them(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    gone, kept = unique("gone"), unique("kept")
    create("ParentTopic", namespace, "gone", {"topicName": gone})
    create("ParentTopic", namespace, "kept", {"topicName": kept, "deletionPolicy": "retain"})
    for name in ("gone", "kept"):
        wait_condition(kube, testing.cr_path("parenttopics", namespace, name), "True", "Applied")
    for name in ("gone", "kept"):
        kube.delete(testing.cr_path("parenttopics", namespace, name))
    for name in ("gone", "kept"):
        path = testing.cr_path("parenttopics", namespace, name)
        testing.wait_for(lambda path=path: not kube.exists(path), TIMEOUT_S, f"{path} deleted")  # type: ignore[misc]
    for b in brokers:
        assert not has_topic(admin_of(b.admin_endpoint), gone)
        assert has_topic(admin_of(b.admin_endpoint), kept)
    reasons = event_reasons(kube, namespace, "gone") | event_reasons(kube, namespace, "kept")
    assert {"Deleted", "Retained"} <= reasons


def test_create_adopts_what_brokers_already_hold_identical_or_not(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    b0, b1 = (b.admin_endpoint for b in brokers)
    same, mixed = unique("same"), unique("mixed")
    for endpoint in (b0, b1):  # already there, exactly as the spec below wants it
        admin_of(endpoint).put_parent_topic(broker_model.ParentTopic(same))
    admin_of(b0).put_parent_topic(broker_model.ParentTopic(mixed, expiration_minutes=5))  # different; b1 lacks it
    run_operator(namespace, [b0, b1])
    create("ParentTopic", namespace, "same", {"topicName": same})
    create("ParentTopic", namespace, "mixed", {"topicName": mixed})
    for name in ("same", "mixed"):
        wait_condition(kube, testing.cr_path("parenttopics", namespace, name), "True", "Applied")

    def posted(name: str, reason: str) -> str | None:
        found = event_messages(kube, namespace, name, reason)
        return found[0] if found else None

    adopted = testing.wait_for(lambda: posted("same", "Adopted"), TIMEOUT_S, "Adopted on identical copies")
    first, second = sorted((b0, b1))  # brokers are listed in order; here their names are their endpoints
    assert adopted == f"ParentTopic {same!r} adopted on {first} (already identical), {second} (already identical)"
    adopted = testing.wait_for(lambda: posted("mixed", "Adopted"), TIMEOUT_S, "Adopted on a different copy")
    assert adopted == f"ParentTopic {mixed!r} adopted on {b0} (differed, overwritten)"
    assert posted("mixed", "Created") == f"ParentTopic {mixed!r} created on {b1} (was missing)"
    assert admin_of(b0).get_parent_topic(mixed).topic.expiration_minutes == -1
    # a resync later finds the adopted copies identical: nothing was created, nothing drifted
    assert not {"Created", "DriftRepaired"} & event_reasons(kube, namespace, "same")


def test_unmanaged_and_paused_resources_leave_brokers_alone(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    paused, free = unique("paused"), unique("free")
    create("ParentTopic", namespace, "paused", {"topicName": paused, "liteTopicExpirationMinutes": 10})
    create("ParentTopic", namespace, "free", {"topicName": free})
    p_path = testing.cr_path("parenttopics", namespace, "paused")
    f_path = testing.cr_path("parenttopics", namespace, "free")
    wait_condition(kube, p_path, "True", "Applied")
    wait_condition(kube, f_path, "True", "Applied")
    admin0 = admin_of(brokers[0].admin_endpoint)

    kube.merge_patch(p_path, {"metadata": {"annotations": {"lmq.io/pause-reconciliation": "true"}}})
    paused_status = wait_condition(kube, p_path, "Unknown", "ReconciliationPaused")["status"]
    assert not {"brokersReady", "brokers", "liteTopicCount"} & set(paused_status)  # no stale "2/2" beside Unknown
    assert (paused_status["topicName"], paused_status["observedGeneration"]) == (paused, 1)
    obj = kube.merge_patch(p_path, {"spec": {"liteTopicExpirationMinutes": 20}})
    paused_obj = wait_condition(kube, p_path, "Unknown", "ReconciliationPaused", current=False)
    assert paused_obj["status"]["observedGeneration"] == 1 < obj["metadata"]["generation"]
    admin0.delete_parent_topic(paused)  # drift while paused is not repaired either
    assert not has_topic(admin0, paused)
    kube.merge_patch(p_path, {"metadata": {"annotations": {"lmq.io/pause-reconciliation": None}}})
    wait_condition(kube, p_path, "True", "Applied")
    assert admin0.get_parent_topic(paused).topic.expiration_minutes == 20

    kube.merge_patch(f_path, {"metadata": {"annotations": {"lmq.io/managed": "false"}}})
    wait_condition(kube, f_path, "True", "Unmanaged")
    kube.merge_patch(f_path, {"spec": {"liteTopicExpirationMinutes": 5}})
    wait_condition(kube, f_path, "True", "Unmanaged")
    kube.delete(f_path)
    testing.wait_for(lambda: not kube.exists(f_path), TIMEOUT_S, "unmanaged resource deleted")
    for b in brokers:
        assert admin_of(b.admin_endpoint).get_parent_topic(free).topic.expiration_minutes == -1


def test_younger_claim_of_a_topic_is_a_conflict(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic = unique("shared")
    create("ParentTopic", namespace, "first", {"topicName": topic, "liteTopicExpirationMinutes": 10})
    first = testing.cr_path("parenttopics", namespace, "first")
    wait_condition(kube, first, "True", "Applied")
    create("ParentTopic", namespace, "second", {"topicName": topic, "liteTopicExpirationMinutes": 99})
    second = testing.cr_path("parenttopics", namespace, "second")
    obj = wait_condition(kube, second, "False", "ResourceConflict")
    assert f"{namespace}/first already manages topicName" in ready(obj)["message"]  # type: ignore[index]
    assert "ResourceConflict" in event_reasons(kube, namespace, "second")
    for b in brokers:
        assert admin_of(b.admin_endpoint).get_parent_topic(topic).topic.expiration_minutes == 10

    # the owner goes (retaining the topic); the younger one takes over on its next resync
    kube.merge_patch(first, {"spec": {"deletionPolicy": "retain"}})
    wait_condition(kube, first, "True", "Applied")
    kube.delete(first)
    wait_condition(kube, second, "True", "Applied")
    for b in brokers:
        assert admin_of(b.admin_endpoint).get_parent_topic(topic).topic.expiration_minutes == 99


def test_drift_on_a_broker_is_repaired(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    op = run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic, group = unique("drift"), unique("drift-g")
    create("ParentTopic", namespace, "drift", {"topicName": topic, "liteTopicExpirationMinutes": 15})
    create("LiteGroup", namespace, "drift-g", {"groupName": group, "parentTopic": topic})
    wait_condition(kube, testing.cr_path("parenttopics", namespace, "drift"), "True", "Applied")
    wait_condition(kube, testing.cr_path("litegroups", namespace, "drift-g"), "True", "Applied")
    a0, a1 = admin_of(brokers[0].admin_endpoint), admin_of(brokers[1].admin_endpoint)
    a0.put_parent_topic(broker_model.ParentTopic(topic, expiration_minutes=1))  # changed by hand
    a1.delete_group(group)  # removed by hand

    testing.wait_for(
        lambda: a0.get_parent_topic(topic).topic.expiration_minutes == 15, TIMEOUT_S, "topic drift repaired"
    )
    testing.wait_for(lambda: a1.get_group(group).group.bind_topic == topic, TIMEOUT_S, "group re-created")
    testing.wait_for(lambda: "DriftRepaired" in event_reasons(kube, namespace, "drift"), TIMEOUT_S, "event")
    assert 'lmq_operator_drift_repaired_total{kind="LiteGroup"}' in op.metrics()


def test_broker_that_appears_later_and_empty_disk_get_everything(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
    start_broker: Callable[..., Any],
) -> None:
    late_port = testing.free_port()
    late_endpoint = f"127.0.0.1:{late_port}"
    run_operator(namespace, [brokers[0].admin_endpoint, late_endpoint])
    topic = unique("late")
    create("ParentTopic", namespace, "late", {"topicName": topic})
    path = testing.cr_path("parenttopics", namespace, "late")
    obj = wait_condition(kube, path, "False", "BrokerUnavailable")
    assert obj["status"]["brokersReady"] == "1/2"
    assert ready(obj)["message"].startswith("1/2 brokers in sync")  # type: ignore[index]

    late = start_broker("late", port=late_port)
    obj = wait_condition(kube, path, "True", "Applied")
    assert obj["status"]["brokersReady"] == "2/2"
    assert has_topic(admin_of(late_endpoint), topic)
    # the retries found the first broker's copy again: it was put there by this create, not adopted
    assert "Adopted" not in event_reasons(kube, namespace, "late")

    # the pod restarts with an empty disk: the next resync puts everything back
    late.stop()
    shutil.rmtree(late.data_dir)
    start_broker("late", port=late_port)
    with AdminClient(late_endpoint, timeout_s=5.0, **late.admin_keys) as fresh:
        testing.wait_for(lambda: has_topic(fresh, topic), TIMEOUT_S, "topic re-created on an empty broker")


def test_operator_restart_mid_reconcile_converges(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    endpoints = [b.admin_endpoint for b in brokers]
    op = run_operator(namespace, endpoints)
    names = [unique(f"r{i}") for i in range(20)]
    for i, topic in enumerate(names):
        create("ParentTopic", namespace, f"r{i}", {"topicName": topic})
    op.kill()  # SIGKILL while the creations are being handled
    run_operator(namespace, endpoints)
    for i in range(len(names)):
        wait_condition(kube, testing.cr_path("parenttopics", namespace, f"r{i}"), "True", "Applied")
    for b in brokers:
        listed = {t.topic.name for t in admin_of(b.admin_endpoint).list_parent_topics()}
        assert set(names) <= listed


def _send_lite_message(endpoint: str, topic: str, lite: str) -> None:
    """One LITE message over the real v2 wire, so a broker holds something no group has consumed."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        props = v2.SystemProperties(
            message_id=uuid.uuid4().hex.upper(),
            message_type=v2.LITE,
            lite_topic=lite,
            body_encoding=v2.IDENTITY,
            born_host="tests",
        )
        props.born_timestamp.GetCurrentTime()
        message = v2.Message(topic=v2.Resource(name=topic), body=b"undrained", system_properties=props)
        reply = stub.SendMessage(
            service_pb2.SendMessageRequest(messages=[message]), metadata=(("x-mq-client-id", "tests"),), timeout=5
        )
        assert reply.status.code == v2.OK, reply.status


def _run_with_slices(
    run_operator: Callable[..., testing.OperatorProcess], namespace: str, **env: str
) -> testing.OperatorProcess:
    """The operator finding brokers as in a cluster: the headless Service's EndpointSlices and the StatefulSet."""
    return run_operator(
        namespace,
        None,
        LMQ_OPERATOR_BROKER_SERVICE="lmq-broker",
        LMQ_OPERATOR_BROKER_NAMESPACE=namespace,
        LMQ_OPERATOR_BROKER_STATEFULSET="lmq-broker",
        **env,
    )


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == kind)


def test_endpoint_slice_discovery_and_undrained_scale_down(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
    start_broker: Callable[..., Any],
) -> None:
    """Brokers found through the headless Service's EndpointSlices, as in a cluster; then a scale-down."""
    ip = testing.host_ip()  # EndpointSlices refuse loopback addresses
    pods = [start_broker(f"pod{i}", extra=["--host", "0.0.0.0"]) for i in range(2)]
    testing.publish_brokers(kube, namespace, "lmq-broker", [(ip, pod.port) for pod in pods], replicas=2)
    claims = testing.claim_volumes(kube, namespace, "lmq-broker", range(2))
    _run_with_slices(run_operator, namespace)
    topic, group = unique("sliced"), unique("sliced-g")
    create("ParentTopic", namespace, "sliced", {"topicName": topic})
    create("LiteGroup", namespace, "sliced-g", {"groupName": group, "parentTopic": topic})
    path = testing.cr_path("parenttopics", namespace, "sliced")
    obj = wait_condition(kube, path, "True", "Applied")
    wait_condition(kube, testing.cr_path("litegroups", namespace, "sliced-g"), "True", "Applied")
    assert [(b["name"], b["endpoint"]) for b in obj["status"]["brokers"]] == [
        (f"lmq-broker-{i}", f"{ip}:{pod.port}") for i, pod in enumerate(pods)
    ]
    drained = _condition(obj, "BrokersDrained")
    assert drained["status"] == "True"

    _send_lite_message(pods[1].endpoint, topic, "session-1")
    assert admin_of(pods[1].admin_endpoint).broker_info().undrained_messages == 1
    kube.merge_patch(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/lmq-broker", {"spec": {"replicas": 1}})

    def reported(status: str, reason: str) -> Any:
        got = kube.get(path)
        cond = _condition(got, "BrokersDrained")
        return got if (cond["status"], cond["reason"]) == (status, reason) else None

    obj = testing.wait_for(
        lambda: reported("False", "UndrainedBrokerLeaving"), TIMEOUT_S, "BrokersDrained=False after the scale-down"
    )
    drained = _condition(obj, "BrokersDrained")
    assert drained["message"] == "lmq-broker-1 (ordinal 1 >= replicas 1) still holds 1 undrained messages"
    assert obj["status"]["brokersReady"] == "1/1"
    assert [b["name"] for b in obj["status"]["brokers"]] == ["lmq-broker-0"]

    # As in a cluster, the pod is deleted at once and leaves the EndpointSlice; its claim and data stay.
    testing.set_broker_endpoint(kube, namespace, "lmq-broker", 1, None)
    obj = testing.wait_for(
        lambda: reported("False", "LeavingBrokerUnreachable"), TIMEOUT_S, "BrokersDrained=False without the pod"
    )
    drained = _condition(obj, "BrokersDrained")
    assert drained["message"] == (
        "lmq-broker-1 (ordinal 1 >= replicas 1) cannot be asked whether it is drained, "
        f"and its claim {claims[1]} still exists"
    )
    kube.delete(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claims[1]}")  # the data is let go
    testing.wait_for(lambda: reported("True", "Drained"), TIMEOUT_S, "BrokersDrained=True once the claim is gone")


def _counter(metrics: str, sample: str) -> float:
    """The value of one sample line of the Prometheus text format (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_delete_keeps_the_finalizer_while_brokers_are_absent_or_down(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
    start_broker: Callable[..., Any],
) -> None:
    """No broker discovered (every pod gone) or a broker that does not answer: the topic is not known to be
    deleted, so the resource stays Terminating until a broker confirms it."""
    ip = testing.host_ip()
    pod = start_broker("pod0", extra=["--host", "0.0.0.0"])
    testing.publish_brokers(kube, namespace, "lmq-broker", [(ip, pod.port)], replicas=1)
    op = run_operator(
        namespace, None, LMQ_OPERATOR_BROKER_SERVICE="lmq-broker", LMQ_OPERATOR_BROKER_NAMESPACE=namespace
    )
    topic = unique("orphan")
    create("ParentTopic", namespace, "orphan", {"topicName": topic})
    path = testing.cr_path("parenttopics", namespace, "orphan")
    wait_condition(kube, path, "True", "Applied")

    testing.set_broker_endpoint(kube, namespace, "lmq-broker", 0, None)  # the pod is gone
    wait_condition(kube, path, "False", "NoBrokers")
    kube.delete(path)

    def delete_failed(needle: str) -> Any:
        items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        found = [
            e["message"]
            for e in items
            if e["involvedObject"]["name"] == "orphan" and e["reason"] == "DeleteFailed" and needle in e["message"]
        ]
        return found[0] if found else None

    text = testing.wait_for(lambda: delete_failed("no broker pod is discovered"), TIMEOUT_S, "DeleteFailed (none)")
    assert "lmq.io/finalizer stays" in text
    sample = 'lmq_operator_reconciliations_failed_total{kind="ParentTopic",trigger="delete"}'
    testing.wait_for(lambda: _counter(op.metrics(), sample) >= 2, TIMEOUT_S, "failed deletes counted")
    # the status says why it stays Terminating, not the NoBrokers (or Ready=True) of before the delete
    obj = wait_condition(kube, path, "False", "DeleteFailed")
    assert "no broker pod is discovered; lmq.io/finalizer stays" in ready(obj)["message"]  # type: ignore[index]
    assert obj["metadata"]["deletionTimestamp"] and obj["metadata"]["finalizers"] == ["lmq.io/finalizer"]
    assert has_topic(admin_of(pod.admin_endpoint), topic)

    # The pod is listed again but its broker does not answer: still not deleted.
    pod.stop()
    testing.set_broker_endpoint(kube, namespace, "lmq-broker", 0, ip)
    testing.wait_for(lambda: delete_failed("not deleted on lmq-broker-0"), TIMEOUT_S, "DeleteFailed (down)")
    testing.wait_for(
        lambda: "not deleted on lmq-broker-0" in (ready(kube.get(path)) or {}).get("message", ""),
        TIMEOUT_S,
        "the status names the broker that does not answer",
    )

    back = start_broker("pod0", port=pod.port, extra=["--host", "0.0.0.0"])  # same disk: it still holds the topic
    testing.wait_for(lambda: not kube.exists(path), TIMEOUT_S, f"{path} deleted once the broker answers")
    with AdminClient(back.admin_endpoint, timeout_s=5.0, **back.admin_keys) as admin:
        assert not has_topic(admin, topic)
    assert "Deleted" in event_reasons(kube, namespace, "orphan")


def has_group(admin: AdminClient, name: str) -> bool:
    try:
        admin.get_group(name)
    except errors.NotFound:
        return False
    return True


def quota_scopes(admin: AdminClient) -> set[str]:
    return {q.scope for q in admin.list_quotas()}


def test_deleted_groups_and_quotas_leave_every_broker(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    """The finalizer of a LiteGroup / LiteQuota deletes it on every broker before the resource goes. Only
    ParentTopics have a deletionPolicy (the other CRDs prune the field); a group that must outlive its
    resource is marked unmanaged first."""
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic, group, kept, rmq_ns = unique("gq"), unique("gq-g"), unique("gq-kept"), unique("gq-ns")
    create("ParentTopic", namespace, "gq", {"topicName": topic})
    create("LiteGroup", namespace, "gq-g", {"groupName": group, "parentTopic": topic})
    create("LiteGroup", namespace, "gq-kept", {"groupName": kept, "parentTopic": topic})
    create("LiteQuota", namespace, "gq-parent", {"parentTopic": topic, "maxLiteTopics": 7})
    create("LiteQuota", namespace, "gq-ns", {"rocketmqNamespace": rmq_ns, "maxSendRate": 9})
    paths = {
        "gq": testing.cr_path("parenttopics", namespace, "gq"),
        "gq-g": testing.cr_path("litegroups", namespace, "gq-g"),
        "gq-kept": testing.cr_path("litegroups", namespace, "gq-kept"),
        "gq-parent": testing.cr_path("litequotas", namespace, "gq-parent"),
        "gq-ns": testing.cr_path("litequotas", namespace, "gq-ns"),
    }
    for path in paths.values():
        assert wait_condition(kube, path, "True", "Applied")["metadata"]["finalizers"] == ["lmq.io/finalizer"]
    scopes = {f"parent:{topic}", f"namespace:{rmq_ns}"}
    for b in brokers:
        admin = admin_of(b.admin_endpoint)
        assert has_group(admin, group) and has_group(admin, kept)
        assert scopes <= quota_scopes(admin)

    kube.merge_patch(paths["gq-kept"], {"metadata": {"annotations": {"lmq.io/managed": "false"}}})
    wait_condition(kube, paths["gq-kept"], "True", "Unmanaged")
    for name in ("gq-g", "gq-kept", "gq-parent", "gq-ns"):
        kube.delete(paths[name])
    for name in ("gq-g", "gq-kept", "gq-parent", "gq-ns"):
        testing.wait_for(lambda name=name: not kube.exists(paths[name]), TIMEOUT_S, f"{name} deleted")  # type: ignore[misc]

    for b in brokers:
        admin = admin_of(b.admin_endpoint)
        assert not has_group(admin, group)
        assert not scopes & quota_scopes(admin)
        assert has_group(admin, kept)  # unmanaged: left alone
        assert has_topic(admin, topic)  # deleting a group or a quota leaves its topic
    assert event_messages(kube, namespace, "gq-g", "Deleted") == [f"LiteGroup {group!r} deleted on 2 brokers"]
    assert event_messages(kube, namespace, "gq-parent", "Deleted") == [
        f"LiteQuota 'parent:{topic}' deleted on 2 brokers"
    ]
    assert event_messages(kube, namespace, "gq-ns", "Deleted") == [
        f"LiteQuota 'namespace:{rmq_ns}' deleted on 2 brokers"
    ]
    assert "Deleted" not in event_reasons(kube, namespace, "gq-kept")
    assert "Retained" in event_reasons(kube, namespace, "gq-kept")


def test_a_pod_joining_the_service_gets_existing_topics_within_one_resync(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
    start_broker: Callable[..., Any],
) -> None:
    """Scale-out through discovery: the StatefulSet grows and the new pod's endpoint appears in the headless
    Service's EndpointSlices; the resync timer applies every existing ParentTopic to it within one resync
    interval plus one discovery refresh (and the time a reconcile takes on a loaded machine)."""
    resync_s, discovery_s, slack_s = 2.0, 0.3, 6.0
    ip = testing.host_ip()
    pods = [start_broker(f"pod{i}", extra=["--host", "0.0.0.0"]) for i in range(2)]
    testing.publish_brokers(kube, namespace, "lmq-broker", [(ip, pods[0].port)], replicas=1)
    _run_with_slices(
        run_operator,
        namespace,
        LMQ_OPERATOR_RESYNC_SECONDS=str(resync_s),
        LMQ_OPERATOR_DISCOVERY_SECONDS=str(discovery_s),
    )
    topic = unique("scaled")
    create("ParentTopic", namespace, "scaled", {"topicName": topic, "liteTopicExpirationMinutes": 45})
    path = testing.cr_path("parenttopics", namespace, "scaled")
    obj = wait_condition(kube, path, "True", "Applied")
    assert (obj["status"]["brokersReady"], [b["name"] for b in obj["status"]["brokers"]]) == ("1/1", ["lmq-broker-0"])
    new = admin_of(pods[1].admin_endpoint)
    assert not has_topic(new, topic)

    kube.merge_patch(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/lmq-broker", {"spec": {"replicas": 2}})
    testing.add_broker_pod(kube, namespace, "lmq-broker", 1, (ip, pods[1].port))

    def listed() -> Any:
        st = kube.get(path)["status"]
        rows = [(b["name"], b["endpoint"], b["synced"]) for b in st["brokers"]]
        return st if st["brokersReady"] == "2/2" and ("lmq-broker-1", f"{ip}:{pods[1].port}", True) in rows else None

    bound_s = resync_s + discovery_s + slack_s
    st = testing.wait_for(listed, bound_s, "status listing the new pod in sync", interval_s=0.1)
    assert [b["name"] for b in st["brokers"]] == ["lmq-broker-0", "lmq-broker-1"]
    assert new.get_parent_topic(topic).topic.expiration_minutes == 45
    assert event_messages(kube, namespace, "scaled", "DriftRepaired") == [
        f"ParentTopic {topic!r} repaired on lmq-broker-1 (was missing)"
    ]


def test_operator_never_writes_spec(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    """After create, update and a drift-repairing resync, the operator's field managers own only status, its
    finalizer and its own lmq.io/ progress annotations; every spec is the one the test wrote (plus the CRD's
    defaults, which the apiserver filled in at create)."""
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic, group = unique("spec"), unique("spec-g")
    wrote = {
        testing.cr_path("parenttopics", namespace, "spec"): create(
            "ParentTopic", namespace, "spec", {"topicName": topic, "liteTopicExpirationMinutes": 30}
        ),
        testing.cr_path("litegroups", namespace, "spec-g"): create(
            "LiteGroup", namespace, "spec-g", {"groupName": group, "parentTopic": topic, "readySetCapacity": 50}
        ),
        testing.cr_path("litequotas", namespace, "spec-q"): create(
            "LiteQuota", namespace, "spec-q", {"parentTopic": topic, "maxLiteTopics": 11}
        ),
    }
    for path in wrote:
        wait_condition(kube, path, "True", "Applied")
    topic_path = testing.cr_path("parenttopics", namespace, "spec")
    kube.merge_patch(topic_path, {"spec": {"liteTopicExpirationMinutes": 60}})
    wait_condition(kube, topic_path, "True", "Applied")
    admin0 = admin_of(brokers[0].admin_endpoint)
    admin0.delete_group(group)  # the resync repairs it and writes the group's status again
    testing.wait_for(lambda: has_group(admin0, group), TIMEOUT_S, "group re-created by the resync")
    testing.wait_for(lambda: "DriftRepaired" in event_reasons(kube, namespace, "spec-g"), TIMEOUT_S, "event")

    ours = {e["manager"] for obj in wrote.values() for e in obj["metadata"]["managedFields"]}  # the creates'
    user_annotations = {f"f:{model.ANNOTATION_MANAGED}", f"f:{model.ANNOTATION_PAUSED}"}
    wrote[topic_path]["spec"]["liteTopicExpirationMinutes"] = 60
    for path, written in wrote.items():
        obj = kube.get(path)
        theirs = [e for e in obj["metadata"]["managedFields"] if e["manager"] not in ours]
        owned: set[str] = set()
        for entry in theirs:
            fields = entry["fieldsV1"]
            assert set(fields) <= {"f:metadata", "f:status"}, (path, entry)
            meta = fields.get("f:metadata", {})
            assert set(meta) <= {"f:finalizers", "f:annotations"}, (path, entry)
            assert set(meta.get("f:finalizers", {})) <= {".", f'v:"{model.FINALIZER}"'}, (path, entry)
            annotations = set(meta.get("f:annotations", {})) - {"."}
            assert all(a.startswith("f:lmq.io/") for a in annotations), (path, entry)
            assert not annotations & user_annotations, (path, entry)
            owned |= {f"{k}.{sub}" for k, v in fields.items() for sub in v}
        # the entries inspected are the operator's: they hold what it is known to write
        assert {"f:status.f:conditions", "f:metadata.f:finalizers"} <= owned, (path, theirs)
        assert obj["spec"] == written["spec"], path


def test_events_belong_to_the_resource_they_are_about(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
) -> None:
    """A ParentTopic and a LiteGroup with the same metadata.name, reconciled side by side with different
    outcomes: each one's Events point at it (kind, name, uid), and carry only its own reasons. They come from
    the operator by its own name and pod, not from "kopf"."""
    run_operator(namespace, [b.admin_endpoint for b in brokers], LMQ_OPERATOR_POD_NAME="lmq-operator-7d9f-x2")
    topic, group, absent = unique("twin"), unique("twin-g"), unique("absent")
    pt = create("ParentTopic", namespace, "twin", {"topicName": topic})
    lg = create("LiteGroup", namespace, "twin", {"groupName": group, "parentTopic": absent})  # refused: no parent
    pt_path, lg_path = (
        testing.cr_path("parenttopics", namespace, "twin"),
        testing.cr_path("litegroups", namespace, "twin"),
    )
    wait_condition(kube, pt_path, "True", "Applied")
    wait_condition(kube, lg_path, "False", "ParentTopicNotFound")
    kube.merge_patch(pt_path, {"spec": {"maxLiteTopics": 10}})
    wait_condition(kube, pt_path, "True", "Applied")

    def events_of(kind: str) -> list[dict[str, Any]]:
        items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        return [e for e in items if e["involvedObject"]["kind"] == kind and e["involvedObject"]["name"] == "twin"]

    def reasons_of(kind: str, wanted: set[str]) -> set[str] | None:
        found = {e["reason"] for e in events_of(kind)}
        return found if wanted <= found else None

    pt_reasons = testing.wait_for(
        lambda: reasons_of("ParentTopic", {"Created", "Applied", "Updated"}), TIMEOUT_S, "the topic's Events"
    )
    lg_reasons = testing.wait_for(
        lambda: reasons_of("LiteGroup", {"ParentTopicNotFound"}), TIMEOUT_S, "the group's Events"
    )
    assert "ParentTopicNotFound" not in pt_reasons
    assert not {"Created", "Applied", "Updated"} & lg_reasons
    for kind, obj in (("ParentTopic", pt), ("LiteGroup", lg)):
        for event in events_of(kind):
            ref = event["involvedObject"]
            assert (ref["apiVersion"], ref["namespace"], ref["uid"]) == (
                "lmq.io/v1alpha1",
                namespace,
                obj["metadata"]["uid"],
            ), event
            reporter = (event["reportingComponent"], event["reportingInstance"], event["source"]["component"])
            assert reporter == ("lmq-operator", "lmq-operator-7d9f-x2", "lmq-operator"), event
            assert event["metadata"]["name"].startswith("lmq-operator-"), event
    [created] = [e for e in events_of("ParentTopic") if e["reason"] == "Created"]
    assert (created["type"], created["message"].startswith(f"ParentTopic {topic!r} created on ")) == ("Normal", True)
    [rejected] = [e for e in events_of("LiteGroup") if e["reason"] == "ParentTopicNotFound"]
    assert rejected["type"] == "Warning" and absent in rejected["message"], rejected
