"""Fast handler flows: kopf in-process against KMock (an in-memory Kubernetes API) with in-memory brokers.

KMock has no schema, CEL, generation or finalizer semantics, so these tests check the operator's own flow
(reconcile → status patch → broker calls) quickly; tests/operator/test_operator.py proves the same on a real
apiserver with real brokers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import prometheus_client
import pytest
import pytest_asyncio

from lmq_operator import admins, handlers, model

NS = "flows"
PT = "lmq.io/v1alpha1/parenttopics"
TIMEOUT_S = 15.0

assert handlers.configure is not None  # importing registers the handlers in kopf's default registry
_SERVER: list[str] = []  # the running KMock's URL, for the login handler below


@kopf.on.login()
def _login_to_kmock(**_: Any) -> kopf.ConnectionInfo:
    """Only in this test process: kopf's built-in logins read a kubeconfig chosen at import time."""
    return kopf.ConnectionInfo(server=_SERVER[-1], token="kmock")


async def eventually(check: Callable[[], Any], what: str) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while True:
        with contextlib.suppress(KeyError, TypeError, StopIteration):
            result = check()
            if result:
                return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)  # yield to the operator running in this loop


VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def _declare(server: Any) -> None:
    # The two workarounds kopf needs on KMock: namespaces and CRDs exist as resources.
    server.resources["v1/namespaces"] = {"kind": "Namespace", "namespaced": False, "verbs": VERBS}
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
        "verbs": VERBS,
    }
    server.resources["v1/events"] = {"kind": "Event", "namespaced": True, "verbs": VERBS}
    for kind in model.Kind:
        server.resources[f"lmq.io/v1alpha1/{kind.plural}"] = {
            "kind": kind.value,
            "namespaced": True,
            "subresources": {"status"},
            "verbs": VERBS,
        }


def _object(name: str, spec: dict[str, Any], uid: str, created: str, **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "lmq.io/v1alpha1",
        "kind": "ParentTopic",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": uid,
            "resourceVersion": "1",  # kopf's JSON patches need one
            "generation": 1,
            "creationTimestamp": created,
            "annotations": annotations,
        },
        "spec": spec,
    }


@pytest.fixture
def brokers() -> dict[str, admins.MemoryAdmin]:
    return {ep: admins.MemoryAdmin(ep) for ep in ("b0:8081", "b1:8081")}


@pytest_asyncio.fixture
async def operator(
    kmock: Any, brokers: dict[str, admins.MemoryAdmin], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Any]:
    async with _running(kmock, brokers, monkeypatch) as server:
        yield server


@contextlib.asynccontextmanager
async def _running(kmock: Any, brokers: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    _declare(kmock)
    _SERVER.append(str(kmock.url).rstrip("/"))
    monkeypatch.setenv("LMQ_OPERATOR_BROKERS", ",".join(brokers))
    monkeypatch.setenv("LMQ_OPERATOR_RETRY_SECONDS", "0.1")
    memo = kopf.Memo(admin_factory=brokers.__getitem__)
    options = kopf.OperatorSettings()
    options.posting.enabled = False  # KMock has no generateName: every Event after the first would be a 409
    task = asyncio.create_task(kopf.operator(standalone=True, clusterwide=True, memo=memo, settings=options))
    try:
        yield kmock
    finally:
        # Cancelling (rather than raising the stop flag) makes kopf cancel its leftover tasks at once instead
        # of granting them 5 s: it counts every task born after its start as its own, KMock's included.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert task.done()


def _ready(server: Any, name: str) -> dict[str, Any]:
    conds = server.objects[PT, NS, name]["status"]["conditions"]
    found: dict[str, Any] = next(c for c in conds if c["type"] == "Ready")
    return found


@pytest.mark.asyncio
async def test_create_applies_to_every_broker_and_writes_status(
    operator: Any, brokers: dict[str, admins.MemoryAdmin]
) -> None:
    operator.objects[PT, NS, "orders"] = _object(
        "orders", {"liteTopicExpirationMinutes": 30}, "u1", "2026-01-01T00:00:00Z"
    )
    await eventually(lambda: _ready(operator, "orders")["status"] == "True", "Ready=True")
    status = operator.objects[PT, NS, "orders"]["status"]
    assert (status["topicName"], status["brokersReady"], status["observedGeneration"]) == ("orders", "2/2", 1)
    for admin in brokers.values():
        assert admin.objects[model.Kind.PARENT_TOPIC]["orders"] == model.TopicConfig("orders", 30, -1)


@pytest.mark.asyncio
async def test_a_down_broker_is_reported_and_caught_up(operator: Any, brokers: dict[str, admins.MemoryAdmin]) -> None:
    brokers["b1:8081"].down = True
    operator.objects[PT, NS, "late"] = _object("late", {}, "u2", "2026-01-01T00:00:00Z")
    cond = await eventually(
        lambda: (c := _ready(operator, "late"))["reason"] == "BrokerUnavailable" and c, "BrokerUnavailable"
    )
    assert cond["status"] == "False" and "b1:8081: UNAVAILABLE" in cond["message"]
    brokers["b1:8081"].down = False  # the change handler retries (LMQ_OPERATOR_RETRY_SECONDS) until in sync
    await eventually(lambda: _ready(operator, "late")["status"] == "True", "Ready=True after the broker is back")
    assert "late" in brokers["b1:8081"].objects[model.Kind.PARENT_TOPIC]


@pytest.mark.asyncio
async def test_paused_resource_touches_no_broker(operator: Any, brokers: dict[str, admins.MemoryAdmin]) -> None:
    paused = _object("quiet", {}, "u3", "2026-01-01T00:00:00Z", **{"lmq.io/pause-reconciliation": "true"})
    operator.objects[PT, NS, "quiet"] = paused
    cond = await eventually(lambda: _ready(operator, "quiet"), "a Ready condition")
    assert (cond["status"], cond["reason"]) == ("Unknown", "ReconciliationPaused")
    assert all(not admin.calls for admin in brokers.values())


@pytest.mark.asyncio
async def test_an_invalid_spec_is_stalled_and_touches_no_broker(
    operator: Any, brokers: dict[str, admins.MemoryAdmin]
) -> None:
    """The apiserver's CRD schema refuses such a spec; a hand-edited or older CRD may not, and then the
    operator says Stalled (a retry cannot help), not Reconciling."""
    operator.objects[PT, NS, "bad"] = _object("bad", {"maxLiteTopics": 0}, "u5", "2026-01-01T00:00:00Z")
    cond = await eventually(lambda: (c := _ready(operator, "bad"))["reason"] == "Invalid" and c, "Ready=False Invalid")
    conds = {c["type"]: c for c in operator.objects[PT, NS, "bad"]["status"]["conditions"]}
    assert cond["status"] == "False" and "maxLiteTopics" in cond["message"]
    assert (conds["Stalled"]["status"], conds["Stalled"]["reason"]) == ("True", "Invalid")
    assert "Reconciling" not in conds
    assert all(not admin.calls for admin in brokers.values())


class _Broken(admins.MemoryAdmin):
    """A broker seam that fails the way a bug does: not with an ``AdminError`` the reconcile turns into status."""

    async def get(self, kind: model.Kind, key: str) -> model.Observed | None:
        raise RuntimeError("not an AdminError")


def _sample(name: str, **labels: str) -> float:
    return prometheus_client.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.asyncio
async def test_a_reconcile_that_raises_is_counted_as_failed_and_timed(
    operator: Any, brokers: dict[str, admins.MemoryAdmin]
) -> None:
    brokers["b1:8081"] = _Broken("b1:8081")  # the admin factory looks it up on first use, which is below
    failed = ("lmq_operator_reconciliations_failed_total", {"kind": "ParentTopic", "trigger": "create"})
    timed = ("lmq_operator_reconcile_duration_seconds_count", {"kind": "ParentTopic"})
    before = _sample(failed[0], **failed[1]), _sample(timed[0], **timed[1])
    operator.objects[PT, NS, "buggy"] = _object("buggy", {}, "u4", "2026-01-01T00:00:00Z")
    await eventually(lambda: _sample(failed[0], **failed[1]) > before[0], "the failed reconciliation counted")
    assert _sample(timed[0], **timed[1]) > before[1]


class _SlowAdmin(admins.MemoryAdmin):
    """A broker that takes a while to answer, counting the resources it is asked about at once."""

    def __init__(self, endpoint: str, asked: set[str], most: list[int]) -> None:
        super().__init__(endpoint)
        self.asked, self.most = asked, most

    async def get(self, kind: model.Kind, key: str) -> model.Observed | None:
        self.asked.add(key)
        self.most[0] = max(self.most[0], len(self.asked))
        try:
            await asyncio.sleep(0.2)  # the broker's latency, not a wait for the test
            return await super().get(kind, key)
        finally:
            self.asked.discard(key)


@pytest.mark.asyncio
@pytest.mark.parametrize(("workers", "bounded"), [("1", True), ("0", False)])
async def test_at_most_workers_resources_are_handled_at_once(
    kmock: Any, monkeypatch: pytest.MonkeyPatch, workers: str, bounded: bool
) -> None:
    """LMQ_OPERATOR_WORKERS bounds the reconciles at once (a burst waits its turn); 0: no bound."""
    asked: set[str] = set()
    most = [0]
    slow = {ep: _SlowAdmin(ep, asked, most) for ep in ("b0:8081", "b1:8081")}
    monkeypatch.setenv("LMQ_OPERATOR_WORKERS", workers)
    async with _running(kmock, slow, monkeypatch) as server:
        names = [f"burst-{i}" for i in range(3)]
        for i, name in enumerate(names):
            server.objects[PT, NS, name] = _object(name, {}, f"ub{i}", "2026-01-01T00:00:00Z")
        await eventually(lambda: all(_ready(server, n)["status"] == "True" for n in names), "all Ready")
    assert (most[0] == 1) if bounded else (most[0] > 1)


class _LostAnswer(admins.MemoryAdmin):
    """A loaded broker: its first put is applied, but its answer never comes (the call times out)."""

    lost = False

    async def put(self, config: model.Config) -> bool:
        created = await super().put(config)
        if not self.lost:
            self.lost = True
            raise admins.AdminError(model.Failure.UNAVAILABLE, "DEADLINE_EXCEEDED: Deadline Exceeded")
        return created


@pytest.mark.asyncio
async def test_a_create_whose_write_timed_out_but_was_applied_adopts_nothing(
    kmock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry finds the timed-out write's copy, identical: the operator's own, so its Events say the object was
    created on both brokers and adopted on none (under heavy load the real-apiserver test saw "Adopted")."""
    posted: list[str] = []
    monkeypatch.setattr(
        handlers, "_post", lambda body, events: posted.extend(f"{e.reason}: {e.message}" for e in events)
    )
    slow = _LostAnswer("b0:8081")
    loaded = {"b0:8081": slow, "b1:8081": admins.MemoryAdmin("b1:8081")}
    async with _running(kmock, loaded, monkeypatch) as server:
        server.objects[PT, NS, "slow"] = _object("slow", {}, "u9", "2026-01-01T00:00:00Z")
        await eventually(lambda: _ready(server, "slow")["status"] == "True", "Ready=True after the retry")
    assert slow.lost
    assert not [p for p in posted if p.startswith("Adopted")], posted
    assert [p for p in posted if p.startswith("Created")], posted
