"""LmqUser on a real apiserver with real brokers running access control (--acl): the user and its policies reach
every broker with the secret of the Secret it names; a call signed with that secret works where a policy allows it
and is refused (FORBIDDEN) where none does; a user deleted on a broker by hand comes back; a changed Secret value is
applied; a missing Secret is reported (Ready=False SecretNotFound) until it appears; deletionPolicy decides whether
deleting the resource deletes the user. Admission refuses malformed resources and CIDRs."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest

from lmq_broker import errors
from lmq_broker import model as broker_model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as v2
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2, service_pb2_grpc
from lmq_operator import model, testing

AdminOf = Callable[[str], AdminClient]
TIMEOUT_S = 30.0


def wait_condition(kube: testing.KubeAPI, path: str, status: str, reason: str) -> Any:
    """The resource once its Ready condition is ``status``/``reason`` for its current generation."""

    def check() -> Any:
        obj = kube.get(path)
        found = obj.get("status") or {}
        cond = next((c for c in found.get("conditions") or () if c["type"] == "Ready"), None)
        current = found.get("observedGeneration") == obj["metadata"]["generation"]
        return obj if cond is not None and (cond["status"], cond["reason"]) == (status, reason) and current else None

    try:
        return testing.wait_for(check, TIMEOUT_S, f"{path} Ready={status}/{reason}")
    except TimeoutError:
        raise AssertionError(f"{path} never reached Ready={status}/{reason}: {kube.get(path).get('status')}") from None


def create_user(kube: testing.KubeAPI, namespace: str, name: str, spec: dict[str, Any]) -> Any:
    body = {"apiVersion": "lmq.io/v1alpha1", "kind": "LmqUser", "metadata": {"name": name}, "spec": spec}
    return kube.post(testing.cr_path("lmqusers", namespace), body)


def put_secret(kube: testing.KubeAPI, namespace: str, name: str, value: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/secrets"
    data = {"secretKey": base64.b64encode(value.encode()).decode()}
    if kube.exists(f"{path}/{name}"):
        kube.merge_patch(f"{path}/{name}", {"data": data})
    else:
        kube.post(path, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": data})


def send(broker: Any, keys: tuple[str, str], parent: str, lite: str) -> int:
    """One LITE message over the v2 wire, signed with ``keys``: the status code the broker answers."""
    props = v2.SystemProperties(
        message_id=uuid.uuid4().hex.upper(), message_type=v2.LITE, lite_topic=lite, body_encoding=v2.IDENTITY
    )
    props.born_timestamp.GetCurrentTime()
    message = v2.Message(topic=v2.Resource(name=parent), body=b"hello", system_properties=props)
    headers = (("x-mq-client-id", "tenant-tests"), *auth.sign_metadata(*keys, datetime.now(UTC)))
    with grpc.insecure_channel(broker.endpoint) as channel:
        reply = service_pb2_grpc.MessagingServiceStub(channel).SendMessage(
            service_pb2.SendMessageRequest(messages=[message]), metadata=headers, timeout=5
        )
    return int(reply.status.code)


def user_on(admin: AdminClient, name: str) -> Any:
    try:
        return admin.get_user(name)
    except errors.NotFound:
        return None


@pytest.fixture
def acl_brokers(start_broker: Callable[..., Any]) -> list[Any]:
    """Two brokers of this test with access control on, as the chart's acl.enabled runs them."""
    return [start_broker(f"acl{i}", extra=("--acl",)) for i in range(2)]


def test_user_reaches_every_broker_with_its_secret_and_policies_and_drift_is_repaired(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    unique: Callable[[str], str],
    acl_brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    parent, user = unique("chat"), unique("tenant-a")
    for b in acl_brokers:
        admin_of(b.admin_endpoint).put_parent_topic(broker_model.ParentTopic(parent, broker_model.MessageType.LITE))
    run_operator(namespace, [b.admin_endpoint for b in acl_brokers])
    secret = "tenant-a-secret-" + uuid.uuid4().hex
    put_secret(kube, namespace, "tenant-a-credentials", secret)
    spec = {
        "userName": user,
        "secretRef": {"name": "tenant-a-credentials"},
        "policies": [{"resources": [f"Lite:{parent}/tenant-a-*"], "actions": ["Pub", "Sub"]}],
    }
    create_user(kube, namespace, "tenant-a", spec)
    path = testing.cr_path("lmqusers", namespace, "tenant-a")
    obj = wait_condition(kube, path, "True", "Applied")
    assert (obj["status"]["userName"], obj["status"]["brokersReady"]) == (user, "2/2")
    assert obj["status"]["secretVersion"].startswith("tenant-a-credentials/secretKey@")
    assert secret not in str(obj)  # neither spec nor status carries the secret
    for b in acl_brokers:
        info = admin_of(b.admin_endpoint).get_user(user)
        assert (info.super_user, info.enabled, info.acl_entries) == (False, True, 1)
        assert admin_of(b.admin_endpoint).get_acl(user)[0].resource == f"Lite:{parent}/tenant-a-*"
        assert send(b, (user, secret), parent, "tenant-a-1") == v2.OK
        assert send(b, (user, secret), parent, "tenant-b-1") == v2.FORBIDDEN  # no policy names it
        assert send(b, (user, "not-" + secret), parent, "tenant-a-1") == v2.UNAUTHORIZED

    # A user deleted on a broker by hand is back after a resync (1.5 s here), with its secret and policies.
    first = acl_brokers[0]
    assert admin_of(first.admin_endpoint).delete_user(user).deleted

    # (the user is put, then its entries: a look between the two finds it without them, never with more)
    def restored() -> bool:
        found = user_on(admin_of(first.admin_endpoint), user)
        return found is not None and found.acl_entries == 1

    testing.wait_for(restored, TIMEOUT_S, "user re-created with its policy")
    testing.wait_for(lambda: send(first, (user, secret), parent, "tenant-a-2") == v2.OK, TIMEOUT_S, "works again")

    # A new value in the Secret reaches every broker: the old secret no longer signs, the new one does.
    rotated = "rotated-secret-" + uuid.uuid4().hex
    put_secret(kube, namespace, "tenant-a-credentials", rotated)
    for b in acl_brokers:

        def rotated_on(b: Any = b) -> bool:
            return send(b, (user, rotated), parent, "tenant-a-3") == v2.OK

        testing.wait_for(rotated_on, TIMEOUT_S, "the rotated secret signs")
        assert send(b, (user, secret), parent, "tenant-a-3") == v2.UNAUTHORIZED

    # A policy added in the spec applies; one removed from it goes from the brokers.
    kube.merge_patch(path, {"spec": {"policies": [{"resources": [f"Lite:{parent}/tenant-b-*"], "actions": ["Pub"]}]}})
    wait_condition(kube, path, "True", "Applied")
    for b in acl_brokers:
        assert [e.resource for e in admin_of(b.admin_endpoint).get_acl(user)] == [f"Lite:{parent}/tenant-b-*"]
        assert send(b, (user, rotated), parent, "tenant-b-1") == v2.OK
        assert send(b, (user, rotated), parent, "tenant-a-4") == v2.FORBIDDEN

    # deletionPolicy: delete (the default) removes the user, and its policies, from every broker.
    kube.delete(path)
    testing.wait_for(lambda: not kube.exists(path), TIMEOUT_S, "LmqUser deleted")
    for b in acl_brokers:
        assert user_on(admin_of(b.admin_endpoint), user) is None
        assert admin_of(b.admin_endpoint).get_acl(user) == []
        assert send(b, (user, rotated), parent, "tenant-b-2") == v2.UNAUTHORIZED


def test_missing_secret_is_reported_until_it_appears_and_retain_keeps_the_user(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    user = unique("tenant-late")
    spec = {"userName": user, "secretRef": {"name": "late", "key": "secretKey"}, "deletionPolicy": "retain"}
    create_user(kube, namespace, "late", spec)
    path = testing.cr_path("lmqusers", namespace, "late")
    obj = wait_condition(kube, path, "False", "SecretNotFound")
    assert f"Secret {namespace}/late does not exist" in obj["status"]["conditions"][0]["message"]
    assert any(c["type"] == "Reconciling" and c["status"] == "True" for c in obj["status"]["conditions"])
    assert all(user_on(admin_of(b.admin_endpoint), user) is None for b in brokers)

    put_secret(kube, namespace, "late", "short")  # the brokers need 8-256 characters
    obj = wait_condition(kube, path, "False", "SecretInvalid")
    assert "8-256 characters" in obj["status"]["conditions"][0]["message"]
    put_secret(kube, namespace, "late", "long-enough-" + uuid.uuid4().hex)
    wait_condition(kube, path, "True", "Applied")
    assert all(user_on(admin_of(b.admin_endpoint), user) is not None for b in brokers)

    kube.delete(path)
    testing.wait_for(lambda: not kube.exists(path), TIMEOUT_S, "LmqUser deleted")
    for b in brokers:  # deletionPolicy: retain
        assert user_on(admin_of(b.admin_endpoint), user) is not None
        admin_of(b.admin_endpoint).delete_user(user)


@pytest.mark.parametrize(
    ("policy", "complaint"),
    [
        ({"resources": ["Queue:orders"], "actions": ["Pub"]}, "is not a resource"),
        ({"resources": ["Lite:chat-*/a"], "actions": ["Pub"]}, "is not a resource"),  # the parent is literal
        ({"resources": ["Topic:orders"], "actions": ["Publish"]}, "Unsupported value"),
        ({"resources": ["Topic:orders"], "actions": ["Pub"], "sourceCidrs": ["10.0.0.300/8"]}, "not an IP"),
        ({"resources": ["Topic:orders"], "actions": ["Pub"], "sourceCidrs": ["anywhere"]}, "not an IP"),
    ],
)
def test_admission_refuses_bad_resources_actions_and_cidrs(
    *, kube: testing.KubeAPI, namespace: str, policy: dict[str, Any], complaint: str
) -> None:
    spec = {"secretRef": {"name": "s"}, "policies": [policy]}
    with pytest.raises(testing.ApiError) as refused:
        create_user(kube, namespace, "bad", spec)
    assert refused.value.status == 422 and complaint in str(refused.value.body)
    good = {"resources": ["Lite:chat/a-*", "Group:g?", "*"], "actions": ["Pub"], "sourceCidrs": ["10.0.0.0/8", "::1"]}
    create_user(kube, namespace, "good", {"secretRef": {"name": "s"}, "policies": [good]})


@pytest.mark.parametrize(
    ("ref", "complaint"),
    [
        ({"name": ".."}, "spec.secretRef.name .. is not a Secret's name"),  # read as the namespace's Secret list
        ({"name": "%2e%2e"}, "is not a Secret's name"),  # the apiserver answered 400: the handler failed forever
        ({"name": "a/b"}, "is not a Secret's name"),
        ({"name": "Creds"}, "is not a Secret's name"),
        ({"name": "creds", "key": "a key"}, "spec.secretRef.key a key is not a key of a Secret's data"),
        ({"name": "creds", "key": ".."}, "is not a key of a Secret's data"),
    ],
)
def test_admission_refuses_what_names_no_secret(
    *, kube: testing.KubeAPI, namespace: str, ref: dict[str, str], complaint: str
) -> None:
    with pytest.raises(testing.ApiError) as refused:
        create_user(kube, namespace, "bad", {"secretRef": ref})
    assert refused.value.status == 422 and complaint in str(refused.value)
    create_user(kube, namespace, "good", {"secretRef": {"name": "tenant-a.creds", "key": "secret_key.txt"}})


def largest_policies(chars: int) -> list[dict[str, Any]]:
    """As many policies, entries and actions as admission allows, their resources and sources ``chars`` long in
    all: the longest spec (JSON) for that many characters."""
    policies = [
        {
            "resources": [f"Topic:p{p:02d}r{r:02d}" for r in range(model.MAX_POLICY_ITEMS)],
            "actions": ["Pub", "Sub", "Create", "Update", "Delete", "Get", "List"],
            "sourceCidrs": [f"10.{p}.{r}.0/24" for r in range(model.MAX_POLICY_ITEMS)],
        }
        for p in range(model.MAX_POLICIES)
    ]
    short = chars - sum(len(x) for p in policies for x in (*p["resources"], *p["sourceCidrs"]))
    each, rest = divmod(short, model.MAX_POLICIES * model.MAX_POLICY_ITEMS)
    for i, p in enumerate(policies):
        n = model.MAX_POLICY_ITEMS
        p["resources"] = [r + "x" * (each + (i * n + j < rest)) for j, r in enumerate(p["resources"])]
    assert sum(len(x) for p in policies for x in (*p["resources"], *p["sourceCidrs"])) == chars
    return policies


def test_the_largest_user_admitted_is_applied_and_deleted(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
    admin_of: AdminOf,
) -> None:
    """kopf keeps the spec it handled in an annotation, and an object's annotations (kubectl apply's copy of it
    too) must fit in 256 KiB: a larger LmqUser was Applied, then every patch kopf made was refused, the one
    removing its finalizer included, and it stayed Terminating for good. Admission refuses it now; the largest
    it admits goes through create and delete, also beside kubectl's last-applied copy."""
    too_big = {"secretRef": {"name": "creds"}, "policies": largest_policies(model.MAX_POLICY_CHARS + 1)}
    with pytest.raises(testing.ApiError) as refused:
        create_user(kube, namespace, "too-big", too_big)
    assert refused.value.status == 422 and "spec.policies hold more than 65536 characters" in str(refused.value.body)

    user = unique("tenant-large")
    put_secret(kube, namespace, "creds", "long-enough-" + uuid.uuid4().hex)
    spec = {"userName": user, "secretRef": {"name": "creds"}, "policies": largest_policies(model.MAX_POLICY_CHARS)}
    body = {"apiVersion": "lmq.io/v1alpha1", "kind": "LmqUser", "metadata": {"name": "large"}, "spec": spec}
    last_applied = {"kubectl.kubernetes.io/last-applied-configuration": json.dumps(body)}
    annotated = {**body, "metadata": {"name": "large", "annotations": last_applied}}
    kube.post(testing.cr_path("lmqusers", namespace), annotated)
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    path = testing.cr_path("lmqusers", namespace, "large")
    wait_condition(kube, path, "True", "Applied")
    assert admin_of(brokers[0].admin_endpoint).get_user(user).acl_entries == model.MAX_POLICIES * model.MAX_POLICY_ITEMS
    kube.delete(path)
    testing.wait_for(lambda: not kube.exists(path), TIMEOUT_S, "the largest LmqUser deleted")
    assert all(user_on(admin_of(b.admin_endpoint), user) is None for b in brokers)
