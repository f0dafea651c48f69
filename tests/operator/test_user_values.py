"""LmqUser without I/O: the spec to the user every broker should hold, its Secret as a value, the plan that
re-applies a rotated secret, and one reconcile over the in-memory broker twin (a rotation, a user deleted by
hand, a broker that missed a rotation, deletion with and without retain)."""

from __future__ import annotations

import asyncio
import base64
import types
from datetime import UTC, datetime
from typing import Any

import pytest

from lmq_operator import admins, apply, desired, diff, discovery, handlers, kube, model, status

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
META = {"name": "tenant-a", "uid": "u-1", "generation": 1}
SECRET = model.Credential("tenant-a-secret", "creds/secretKey@7")


def spec(**extra: Any) -> dict[str, Any]:
    return {"secretRef": {"name": "creds"}, **extra}


def test_policies_become_entries_sorted_and_normalised_as_brokers_store_them() -> None:
    policies = [
        {"resources": ["Lite:chat/a-*", "Group:a-*"], "actions": ["Sub", "Pub", "Sub"]},
        {"resources": ["Lite:chat/a-x"], "actions": ["Pub"], "decision": "Deny", "sourceCidrs": ["::1", "::1"]},
    ]
    user = desired.config(model.Kind.LMQ_USER, "tenant-a", spec(policies=policies))
    assert isinstance(user, model.UserConfig)
    assert (user.name, user.super_user, user.enabled, user.secret) == ("tenant-a", False, True, "")
    assert user.entries == (
        model.AclEntryConfig("Group:a-*", ("Pub", "Sub"), "Allow"),
        model.AclEntryConfig("Lite:chat/a-*", ("Pub", "Sub"), "Allow"),
        model.AclEntryConfig("Lite:chat/a-x", ("Pub",), "Deny", ("::1",)),
    )


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"policies": [{"resources": ["Queue:q"], "actions": ["Pub"]}]}, "is not a resource"),
        ({"policies": [{"resources": ["Topic:t"], "actions": ["Pub"], "sourceCidrs": ["10.0.0.300/8"]}]}, "CIDR"),
        ({"policies": [{"resources": ["Topic:t"], "actions": []}]}, "at least 1 item"),
        ({"policies": [{"resources": ["Topic:t"], "actions": ["Pub"]}, {"resources": ["Topic:t"], "actions": ["Sub"]}]},
         "Topic:t is in two policies with decision Allow"),
        ({"userName": "a b"}, "may only contain"),
    ],
)  # fmt: skip
def test_what_brokers_would_refuse_is_invalid_before_any_broker_is_called(extra: dict[str, Any], needle: str) -> None:
    found = desired.gate(model.Kind.LMQ_USER, META, spec(**extra), {}, SECRET)
    assert isinstance(found, desired.Blocked) and found.reason is status.Reason.INVALID
    assert needle in found.message


def test_the_secret_is_added_or_the_reason_it_cannot_be() -> None:
    missing = desired.gate(
        model.Kind.LMQ_USER, META, spec(), {}, model.SecretProblem("Secret apps/creds does not exist")
    )
    assert isinstance(missing, desired.Blocked)
    assert (missing.reason, missing.key) == (status.Reason.SECRET_NOT_FOUND, "tenant-a")
    assert missing.reason in status.RETRYING  # a Secret applied after its user comes soon
    short = desired.gate(model.Kind.LMQ_USER, META, spec(), {}, model.Credential("short", "creds/secretKey@1"))
    assert isinstance(short, desired.Blocked) and short.reason is status.Reason.SECRET_INVALID
    assert short.reason in status.TERMINAL and "creds/secretKey must be 8-256 characters" in short.message
    user = desired.gate(model.Kind.LMQ_USER, META, spec(), {}, SECRET)
    assert isinstance(user, model.UserConfig)
    assert (user.secret, user.secret_version) == ("tenant-a-secret", "creds/secretKey@7")
    assert "tenant-a-secret" not in repr(user)


def test_a_secret_is_read_from_the_api_s_base64_data() -> None:
    def secret(data: dict[str, str]) -> dict[str, Any]:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return {"metadata": {"resourceVersion": "42"}, "data": encoded}

    assert kube.credential(secret({"secretKey": "value-12345\n"}), "creds", "secretKey") == model.Credential(
        "value-12345", "creds/secretKey@42"
    )  # the newline `echo > file; --from-file` leaves is not part of it
    gone = kube.credential(secret({"other": "x"}), "creds", "secretKey")
    assert gone == model.SecretProblem("Secret creds has no key 'secretKey'")
    binary = {"metadata": {}, "data": {"secretKey": base64.b64encode(b"\xff\xfe").decode()}}
    assert kube.credential(binary, "creds", "secretKey") == model.SecretProblem(
        "Secret creds key 'secretKey' is not UTF-8 text", missing=False
    )


def test_a_copy_differs_exactly_when_the_secret_changed_since_it_was_applied_everywhere() -> None:
    wanted = desired.gate(model.Kind.LMQ_USER, META, spec(), {}, SECRET)
    assert isinstance(wanted, model.UserConfig)
    b0 = model.Broker("b0", "10.0.0.1:8082", 0)
    held = model.Observed(model.UserConfig("tenant-a", False, True))  # what a broker shows: no secret
    same = diff.plan(wanted, diff.with_secret_version({b0: held}, SECRET.version))
    rotated = diff.plan(wanted, diff.with_secret_version({b0: held}, "creds/secretKey@6"))
    assert [s.change for s in same.steps] == [diff.Change.NONE]
    assert [s.change for s in rotated.steps] == [diff.Change.DIFFERS]


class _Static(discovery.Fleet):
    def __init__(self, brokers: list[model.Broker]) -> None:
        self.brokers = brokers

    async def view(self) -> discovery.FleetView:
        return discovery.FleetView(tuple(self.brokers))


def test_reconcile_repairs_users_applies_rotations_and_deletes_by_policy() -> None:
    twins = {f"b{i}": admins.MemoryAdmin(f"b{i}") for i in range(2)}
    pool = admins.AdminPool(lambda endpoint: twins[endpoint])
    fleet = _Static([model.Broker(name, name, i) for i, name in enumerate(twins)])
    policies = [{"resources": ["Lite:chat/a-*"], "actions": ["Pub"]}]
    body: dict[str, Any] = {"metadata": META, "spec": spec(policies=policies)}

    def reconcile(secret: model.Credential) -> apply.Outcome:
        outcome = asyncio.run(
            apply.reconcile(
                pool, fleet, model.Kind.LMQ_USER, trigger="timer", body=body, claims={}, now=NOW, secret=secret
            )
        )
        body["status"] = outcome.status
        return outcome

    def held(twin: admins.MemoryAdmin) -> model.UserConfig:
        found = twin.objects[model.Kind.LMQ_USER]["tenant-a"]
        assert isinstance(found, model.UserConfig)
        return found

    first = reconcile(SECRET)
    assert status.ready_of(first.status) == ("True", "Applied") and first.status["secretVersion"] == SECRET.version
    assert all(held(t).secret == SECRET.secret for t in twins.values())
    assert reconcile(SECRET).repaired == 0  # a resync of an unchanged user writes nothing
    assert [c for c in twins["b0"].calls if c[0] == "put"] == [("put", "tenant-a")]

    del twins["b0"].objects[model.Kind.LMQ_USER]["tenant-a"]  # deleted by hand
    assert reconcile(SECRET).repaired == 1 and held(twins["b0"]).secret == SECRET.secret

    rotated = model.Credential("rotated-secret", "creds/secretKey@8")
    twins["b1"].down = True  # one broker misses the rotation: it is not "applied" until both have it
    missed = reconcile(rotated)
    assert missed.retry and missed.status["secretVersion"] == SECRET.version
    assert held(twins["b0"]).secret == "rotated-secret"
    twins["b1"].down = False
    done = reconcile(rotated)
    assert done.status["secretVersion"] == rotated.version and held(twins["b1"]).secret == "rotated-secret"

    retained = {**body, "spec": spec(deletionPolicy="retain")}
    kept = asyncio.run(apply.remove(pool, fleet, model.Kind.LMQ_USER, retained, {}, now=NOW))
    assert [e.reason for e in kept.events] == ["Retained"] and all(held(t) for t in twins.values())
    twins["b1"].down = True  # the delete cannot finish: the status says so while the resource is Terminating
    stuck = asyncio.run(apply.remove(pool, fleet, model.Kind.LMQ_USER, {**body, "status": done.status}, {}, now=NOW))
    assert stuck.retry and status.ready_of(stuck.status) == ("False", "DeleteFailed")
    assert stuck.status["userName"] == "tenant-a" and "brokers" not in stuck.status
    twins["b1"].down = False
    gone = asyncio.run(apply.remove(pool, fleet, model.Kind.LMQ_USER, body, {}, now=NOW))
    assert [e.reason for e in gone.events] == ["Deleted"]
    assert all("tenant-a" not in t.objects[model.Kind.LMQ_USER] for t in twins.values())


def test_no_secret_is_read_for_an_invalid_spec() -> None:
    """A stored LmqUser the CRD of today would refuse (a secretRef that names no Secret, admitted by an older
    CRD) is Invalid, and the name is never sent to the apiserver (which refused it with 400, every reconcile an
    exception); a valid one is read with its defaulted key."""
    asked: list[tuple[str, str, str]] = []

    class Reader:
        async def read(self, namespace: str, name: str, key: str) -> model.Credential:
            asked.append((namespace, name, key))
            return model.Credential("secret-of-8", f"{name}/{key}@1")

    ctx = types.SimpleNamespace(secrets=Reader(), conf=types.SimpleNamespace(namespace=None))
    meta = {"name": "u", "namespace": "apps", "uid": "u-1"}
    bad_spec: dict[str, Any] = {"secretRef": {"name": "%2e%2e"}}
    bad = {"metadata": meta, "spec": bad_spec}
    assert asyncio.run(handlers._secret(ctx, model.Kind.LMQ_USER, bad)) is None  # type: ignore[arg-type]
    good = {"metadata": meta, "spec": {"secretRef": {"name": "creds"}}}
    assert asyncio.run(handlers._secret(ctx, model.Kind.LMQ_USER, good)) is not None  # type: ignore[arg-type]
    assert asked == [("apps", "creds", "secretKey")]
    assert isinstance(desired.gate(model.Kind.LMQ_USER, meta, bad_spec, {}), desired.Blocked)


def test_a_user_invalid_since_it_was_applied_is_still_deleted_from_the_brokers() -> None:
    """Applied, then edited into a spec only the operator refuses (a resource in two Allow policies): Invalid,
    and its deletion used to release the finalizer without a broker call ("it never reached a broker"), leaving
    the deleted tenant's user, secret and rights on every broker. Its name still says which user to delete,
    unless another resource owns that name."""
    twins = {f"b{i}": admins.MemoryAdmin(f"b{i}") for i in range(2)}
    pool = admins.AdminPool(lambda endpoint: twins[endpoint])
    fleet = _Static([model.Broker(name, name, i) for i, name in enumerate(twins)])
    body: dict[str, Any] = {"metadata": META, "spec": spec()}
    kind = model.Kind.LMQ_USER
    asyncio.run(apply.reconcile(pool, fleet, kind, trigger="create", body=body, claims={}, now=NOW, secret=SECRET))
    assert all("tenant-a" in t.objects[model.Kind.LMQ_USER] for t in twins.values())
    twice = [{"resources": ["Topic:a"], "actions": ["Pub"]}, {"resources": ["Topic:a"], "actions": ["Sub"]}]
    invalid = {**body, "spec": spec(policies=twice)}
    assert isinstance(desired.gate(model.Kind.LMQ_USER, META, invalid["spec"], {}), desired.Blocked)

    older = model.Claimant("other", "tenant-a", "u-0", "2020-01-01T00:00:00Z")  # owns the name: left alone
    owned = asyncio.run(apply.remove(pool, fleet, model.Kind.LMQ_USER, invalid, {"tenant-a": [older]}, now=NOW))
    assert owned.events == () and all("tenant-a" in t.objects[model.Kind.LMQ_USER] for t in twins.values())
    gone = asyncio.run(apply.remove(pool, fleet, model.Kind.LMQ_USER, invalid, {}, now=NOW))
    assert [e.reason for e in gone.events] == ["Deleted"]
    assert all("tenant-a" not in t.objects[model.Kind.LMQ_USER] for t in twins.values())


@pytest.mark.parametrize(
    ("kind", "name", "spec_", "key"),
    [
        (model.Kind.LMQ_USER, "u.1", {"userName": "tenant@a", "policies": "not a list"}, "tenant@a"),
        (model.Kind.LITE_GROUP, "g", {"parentTopic": "t", "litePatterns": ["a/#/c"]}, "g"),
        (model.Kind.PARENT_TOPIC, "orders.eu", {"topicName": "orders-eu", "maxLiteTopics": 0}, "orders-eu"),
        (model.Kind.PARENT_TOPIC, "orders.eu", {}, None),  # the name is no topic's, and no topicName says one
        (model.Kind.LITE_QUOTA, "q", {"parentTopic": "t", "maxSendRate": -7}, "parent:t"),
        (model.Kind.LITE_QUOTA, "q", {"parentTopic": "t", "rocketmqNamespace": "n"}, None),
    ],
)
def test_an_invalid_spec_still_names_its_broker_object(
    kind: model.Kind, name: str, spec_: dict[str, Any], key: str | None
) -> None:
    assert desired.named_key(kind, name, spec_) == key


def test_an_invalid_user_keeps_its_claim_on_its_name() -> None:
    """The older of two LmqUsers naming one user turns Invalid (edited into what only the operator refuses): it
    still owns the name, so the younger one stays ResourceConflict instead of taking over the user, its secret
    and its rights (and handing them back once the older is fixed)."""
    twice = [{"resources": ["Topic:a"], "actions": ["Pub"]}, {"resources": ["Topic:a"], "actions": ["Sub"]}]
    older = handlers._claim(
        model.Kind.LMQ_USER,
        name="tenant-a",
        namespace="apps",
        spec=spec(policies=twice),
        meta={"creationTimestamp": "2026-01-01T00:00:00Z"},
        uid="u-old",
    )
    assert set(older) == {"tenant-a"}
    younger = {"name": "tenant-a-again", "uid": "u-young", "generation": 1}
    blocked = desired.gate(model.Kind.LMQ_USER, younger, spec(userName="tenant-a"), {"tenant-a": older.values()})
    assert isinstance(blocked, desired.Blocked) and blocked.reason is status.Reason.RESOURCE_CONFLICT
