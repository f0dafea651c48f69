"""GitOps health: the conditions Flux and ``kubectl wait`` read (Ready, Reconciling, Stalled) on a real
apiserver, and the Argo CD health check (charts/lmq/argocd/health.lua) run in a real Lua 5.1 (Argo CD's
interpreter speaks 5.1) against statuses written by ``lmq_operator.status`` and against live objects.
Flux's verdict comes from ``kstatus`` below: kstatus's rules for a kind it has no rules of its own for.

lupa is a dev dependency: without it this module fails to import, it is never skipped.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from lupa import lua51

from lmq_operator import model, status, testing

HEALTH_LUA = testing.REPO / "charts" / "lmq" / "argocd" / "health.lua"
GITOPS_DOC = testing.REPO / "docs" / "gitops.md"
NOW = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)
B0 = model.Broker("lmq-broker-0", "10.0.0.1:8081", 0)
Create = Callable[..., Any]
TIMEOUT_S = 30.0


def argocd_health(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) as Argo CD computes them: the script runs as a chunk with the object in ``obj``."""
    lua = lua51.LuaRuntime()
    assert lua.eval("_VERSION") == "Lua 5.1"
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(HEALTH_LUA.read_text())
    return str(hs["status"]), str(hs["message"])


def kstatus(obj: dict[str, Any]) -> str:
    """What kstatus (sigs.k8s.io/cli-utils pkg/kstatus/status, Compute; Flux's health checks) computes for a
    custom resource, in its order: deletion, then an observedGeneration behind metadata.generation, then a
    True Reconciling (InProgress) or Stalled (Failed) condition, then the Ready condition (True: Current;
    False or Unknown: InProgress), else Current. Checked against fluxcd/cli-utils at 967855f (Go, 2026-05)."""
    meta, st = obj["metadata"], obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating"
    if "generation" in meta and "observedGeneration" in st and st["observedGeneration"] != meta["generation"]:
        return "InProgress"
    conditions = st.get("conditions") or []
    for cond in conditions:
        if (cond["type"], cond["status"]) == ("Reconciling", "True"):
            return "InProgress"
        if (cond["type"], cond["status"]) == ("Stalled", "True"):
            return "Failed"
    for cond in conditions:
        if cond["type"] == "Ready" and cond["status"] in ("True", "False", "Unknown"):
            return "Current" if cond["status"] == "True" else "InProgress"
    return "Current"


def _resource(generation: int, st: dict[str, Any] | None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "lmq.io/v1alpha1",
        "kind": "LiteGroup",
        "metadata": {"name": "workers", "namespace": "apps", "generation": generation},
        "spec": {"parentTopic": "events"},
    }
    if st is not None:
        obj["status"] = st
    return obj


def _applied(*syncs: model.BrokerSync, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    return status.applied(model.Kind.LITE_GROUP, "workers", generation=2, syncs=syncs, previous=previous or {}, now=NOW)


def _blocked(reason: status.Reason, message: str) -> dict[str, Any]:
    return status.blocked(reason, message, generation=2, previous={}, now=NOW, key=(model.Kind.LITE_GROUP, "w"))


def _types(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in st.get("conditions") or []}


IN_SYNC = model.BrokerSync(B0, True, "none")
DOWN = model.BrokerSync(B0, False, "", model.Failure.UNAVAILABLE, "UNAVAILABLE: connection refused")
ORPHAN = model.BrokerSync(B0, False, "none", model.Failure.MISSING_PARENT, "parent topic 'events' not found")
REFUSED = model.BrokerSync(B0, False, "missing", model.Failure.REJECTED, "ALREADY_EXISTS: bound to 'other'")


@pytest.mark.parametrize(
    ("st", "conditions", "health", "says"),
    [
        (_applied(IN_SYNC), {"Ready": ("True", "Applied")}, "Healthy", "applied to 1/1 brokers"),
        (
            _applied(DOWN),
            {"Ready": ("False", "BrokerUnavailable"), "Reconciling": ("True", "BrokerUnavailable")},
            "Progressing",
            "BrokerUnavailable: 0/1 brokers in sync; lmq-broker-0: UNAVAILABLE",
        ),
        (
            _applied(ORPHAN),
            {"Ready": ("False", "ParentTopicNotFound"), "Reconciling": ("True", "ParentTopicNotFound")},
            "Progressing",
            "ParentTopicNotFound: 0/1 brokers in sync; lmq-broker-0: parent topic 'events' not found",
        ),
        (
            _applied(),
            {"Ready": ("False", "NoBrokers"), "Reconciling": ("True", "NoBrokers")},
            "Progressing",
            "NoBrokers: no broker pod is discovered",
        ),
        (
            _applied(REFUSED),
            {"Ready": ("False", "BrokerRejected"), "Stalled": ("True", "BrokerRejected")},
            "Degraded",
            "BrokerRejected: 0/1 brokers in sync; lmq-broker-0: ALREADY_EXISTS",
        ),
        (
            _blocked(status.Reason.INVALID, "spec.fifo: bad"),
            {"Ready": ("False", "Invalid"), "Stalled": ("True", "Invalid")},
            "Degraded",
            "Invalid: spec.fifo: bad",
        ),
        (
            _blocked(status.Reason.RESOURCE_CONFLICT, "LiteGroup team/w already manages groupName 'w'"),
            {"Ready": ("False", "ResourceConflict"), "Stalled": ("True", "ResourceConflict")},
            "Degraded",
            "ResourceConflict: LiteGroup team/w already manages",
        ),
        (_blocked(status.Reason.UNMANAGED, "left alone"), {"Ready": ("True", "Unmanaged")}, "Healthy", "left alone"),
    ],
)
def test_the_health_check_reads_the_conditions_the_operator_writes(
    st: dict[str, Any], conditions: dict[str, tuple[str, str]], health: str, says: str
) -> None:
    assert _types(st) == conditions
    found, message = argocd_health(_resource(2, st))
    assert found == health and says in message, (found, message)


def test_recovering_removes_reconciling_and_stalled_again() -> None:
    stalled = _blocked(status.Reason.INVALID, "spec.fifo: bad")
    retrying = _applied(DOWN, previous=stalled)
    assert _types(retrying) == {"Ready": ("False", "BrokerUnavailable"), "Reconciling": ("True", "BrokerUnavailable")}
    healthy = _applied(IN_SYNC, previous=retrying)
    assert _types(healthy) == {"Ready": ("True", "Applied")}
    assert status.changes(retrying, healthy)["conditions"] == healthy["conditions"]


def test_an_old_generation_a_pause_and_no_status_are_not_healthy() -> None:
    assert argocd_health(_resource(3, _applied(IN_SYNC))) == (
        "Progressing",
        "Waiting for the lmq operator to apply generation 3",
    )
    assert argocd_health(_resource(1, None)) == ("Progressing", "Waiting for the lmq operator")
    assert argocd_health(_resource(1, {"observedGeneration": 1})) == ("Progressing", "Waiting for the lmq operator")
    paused = status.blocked(status.Reason.RECONCILIATION_PAUSED, "paused", generation=3, previous={}, now=NOW)
    assert _types(paused) == {"Ready": ("Unknown", "ReconciliationPaused")}
    assert argocd_health(_resource(3, paused)) == ("Suspended", "ReconciliationPaused: paused")


def test_a_not_ready_resource_from_an_operator_without_the_kstatus_conditions_is_degraded() -> None:
    older = {
        "observedGeneration": 2,
        "conditions": [{"type": "Ready", "status": "False", "reason": "X", "message": "m"}],
    }
    assert argocd_health(_resource(2, older)) == ("Degraded", "X: m")


def _paused(previous: dict[str, Any]) -> dict[str, Any]:
    return status.blocked(status.Reason.RECONCILIATION_PAUSED, "paused", generation=2, previous=previous, now=NOW)


def test_the_docs_table_says_what_flux_and_argocd_compute() -> None:
    """Each row of the table in docs/gitops.md: the conditions, kstatus's verdict and Argo CD's, for the status
    the operator writes with that reason (a paused one three ways: paused from creation, paused after it was
    applied, paused and then changed)."""
    written = {
        "Applied": [_applied(IN_SYNC)],
        "Unmanaged": [_blocked(status.Reason.UNMANAGED, "left alone")],
        "BrokerUnavailable": [_applied(DOWN)],
        "NoBrokers": [_applied()],
        "ParentTopicNotFound": [_applied(ORPHAN)],
        "BrokerRejected": [_applied(REFUSED)],
        "Invalid": [_blocked(status.Reason.INVALID, "spec.fifo: bad")],
        "SecretNotFound": [_blocked(status.Reason.SECRET_NOT_FOUND, "Secret apps/a does not exist")],
        "SecretInvalid": [_blocked(status.Reason.SECRET_INVALID, "the secret in a/secretKey must be 8-256 characters")],
        "ResourceConflict": [_blocked(status.Reason.RESOURCE_CONFLICT, "LiteGroup team/w already manages it")],
        "ReconciliationPaused": [_paused({}), _paused(_applied(IN_SYNC))],
        "DeleteFailed": [_blocked(status.Reason.DELETE_FAILED, "ParentTopic 't' not deleted on lmq-broker-0")],
    }
    assert "observedGeneration" not in written["ReconciliationPaused"][0]
    changed = _resource(3, written["ReconciliationPaused"][1])  # paused, then the spec changed: generation 3
    rows = re.findall(r"^\| (True|False|Unknown) \| `(\w+)` \| (.*?) \| (.*?) \| .*? \| (\w+) \| (\w+) \|$",
                      GITOPS_DOC.read_text(), flags=re.M)  # fmt: skip
    assert sorted(r[1] for r in rows) == sorted(written)  # one row per reason a Ready condition can give
    for ready, reason, reconciling, stalled, flux, argocd in rows:
        extra = {"Reconciling": reconciling, "Stalled": stalled}
        for st in written[reason]:
            want = {"Ready": (ready, reason)} | {k: ("True", reason) for k, v in extra.items() if v == "True"}
            assert _types(st) == want, reason
            obj = _resource(2, st)
            if reason == "DeleteFailed":  # written on a resource being deleted only
                obj["metadata"]["deletionTimestamp"] = "2026-05-06T07:08:09Z"
            assert (kstatus(obj), argocd_health(obj)[0]) == (flux, argocd), reason
    assert (kstatus(changed), argocd_health(changed)[0]) == ("InProgress", "Suspended")


def test_the_docs_install_exactly_this_script_for_every_kind() -> None:
    """docs/gitops.md shows the argocd-cm entries to copy; they must be the shipped script, byte for byte."""
    blocks = re.findall(r"```yaml\n(.*?)```", GITOPS_DOC.read_text(), flags=re.DOTALL)
    config_maps = [doc for block in blocks if (doc := yaml.safe_load(block)) and doc.get("kind") == "ConfigMap"]
    assert len(config_maps) == 1, config_maps
    data = config_maps[0]["data"]
    script = HEALTH_LUA.read_text()
    for kind in model.Kind:
        assert data[f"resource.customizations.health.lmq.io_{kind.value}"] == script, kind


# ---- on a real apiserver, with real brokers --------------------------------------------------------------


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in obj["status"]["conditions"] if c["type"] == type_)
    return found


def _status_of(kube: testing.KubeAPI, path: str, ready: tuple[str, str]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj: dict[str, Any] = kube.get(path)
        st = obj.get("status") or {}
        if st.get("observedGeneration") != obj["metadata"]["generation"]:
            return None
        return obj if _types(st).get("Ready") == ready else None

    try:
        return testing.wait_for(check, TIMEOUT_S, f"{path} Ready={ready}")
    except TimeoutError:
        raise AssertionError(f"{path} never reached Ready={ready}: {kube.get(path).get('status')}") from None


def test_flux_and_argocd_follow_a_lite_group_through_its_parents_life(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
) -> None:
    """A LiteGroup applied before its ParentTopic is Reconciling (Progressing in Argo CD), Ready once the parent
    exists, and not Ready again (ParentTopicNotFound) once the ParentTopic is deleted; a name conflict is Stalled
    (Degraded)."""
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    topic, group = unique("gitops"), unique("gitops-g")
    lg_path = testing.cr_path("litegroups", namespace, "workers")
    pt_path = testing.cr_path("parenttopics", namespace, "events")
    create("LiteGroup", namespace, "workers", {"groupName": group, "parentTopic": topic})
    waiting = _status_of(kube, lg_path, ("False", "ParentTopicNotFound"))
    assert _types(waiting["status"])["Reconciling"] == ("True", "ParentTopicNotFound")
    assert "Stalled" not in _types(waiting["status"])
    assert argocd_health(waiting)[0] == "Progressing"

    create("ParentTopic", namespace, "events", {"topicName": topic})
    ready = _status_of(kube, lg_path, ("True", "Applied"))
    assert set(_types(ready["status"])) == {"Ready"}  # Reconciling is gone again
    assert argocd_health(ready)[0] == "Healthy"
    assert argocd_health(_status_of(kube, pt_path, ("True", "Applied")))[0] == "Healthy"

    kube.delete(pt_path)  # deletionPolicy delete (the default): the topic goes from every broker
    testing.wait_for(lambda: not kube.exists(pt_path), TIMEOUT_S, "the ParentTopic gone")
    orphan = _status_of(kube, lg_path, ("False", "ParentTopicNotFound"))  # noticed by the next resync
    assert topic in _condition(orphan, "Ready")["message"]
    assert _types(orphan["status"])["Reconciling"] == ("True", "ParentTopicNotFound")
    assert argocd_health(orphan)[0] == "Progressing"

    # (an Invalid spec cannot pass this apiserver's CRD schema; test_flows_kmock.py shows it Stalled)
    # The name "workers" owns: the older claim wins, and within one second of creationTimestamp the smaller
    # namespace/name, so the twin's name sorts after "workers" (the whole story can take under a second).
    create("LiteGroup", namespace, "workers-twin", {"groupName": group, "parentTopic": topic})
    twin_path = testing.cr_path("litegroups", namespace, "workers-twin")
    conflict = _status_of(kube, twin_path, ("False", "ResourceConflict"))
    assert _types(conflict["status"])["Stalled"] == ("True", "ResourceConflict")
    assert "Reconciling" not in _types(conflict["status"])
    stalled = _condition(conflict, "Stalled")
    assert argocd_health(conflict) == ("Degraded", f"ResourceConflict: {stalled['message']}")


def _ready_of(kube: testing.KubeAPI, path: str, ready: tuple[str, str]) -> dict[str, Any]:
    """The object once its Ready condition is ``ready``, whatever its observedGeneration."""

    def check() -> dict[str, Any] | None:
        obj: dict[str, Any] = kube.get(path)
        return obj if _types(obj.get("status") or {}).get("Ready") == ready else None

    return testing.wait_for(check, TIMEOUT_S, f"{path} Ready={ready}")


def test_a_paused_resource_is_in_progress_for_flux_and_suspended_for_argocd(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
) -> None:
    """Paused from creation (no observedGeneration at all) and paused once applied (observedGeneration
    current): Ready=Unknown either way, which kstatus reads as InProgress, not Current: a Flux sync that
    waits for it waits until its timeout, as docs/gitops.md says."""
    run_operator(namespace, [b.admin_endpoint for b in brokers])
    paused = {model.ANNOTATION_PAUSED: "true"}
    create("ParentTopic", namespace, "held", {"topicName": unique("held")}, annotations=paused)
    held = _ready_of(kube, testing.cr_path("parenttopics", namespace, "held"), ("Unknown", "ReconciliationPaused"))
    assert "observedGeneration" not in held["status"]
    assert (kstatus(held), argocd_health(held)[0]) == ("InProgress", "Suspended")

    later_path = testing.cr_path("parenttopics", namespace, "later")
    create("ParentTopic", namespace, "later", {"topicName": unique("later")})
    assert kstatus(_status_of(kube, later_path, ("True", "Applied"))) == "Current"  # guards the check
    kube.merge_patch(later_path, {"metadata": {"annotations": paused}})  # no spec change: same generation
    later = _ready_of(kube, later_path, ("Unknown", "ReconciliationPaused"))
    assert later["status"]["observedGeneration"] == later["metadata"]["generation"]
    assert (kstatus(later), argocd_health(later)[0]) == ("InProgress", "Suspended")


PAIR_READY_S = 2.0  # bound on the loaded test host; bench_operator.py measures the p99 (goal 1 s)


def test_a_lite_group_applied_with_its_parent_topic_is_ready_at_once(
    *,
    kube: testing.KubeAPI,
    namespace: str,
    create: Create,
    unique: Callable[[str], str],
    brokers: list[Any],
    run_operator: Callable[..., testing.OperatorProcess],
) -> None:
    """The operator here retries after 30 s and resyncs every 300 s: only its ParentTopic turning Ready can
    make a refused LiteGroup Ready within seconds. Once refused and shown waiting, then a pair POSTed back to
    back (a GitOps sync): each Ready within PAIR_READY_S of the POSTs, its copies Created (not repaired)."""
    run_operator(
        namespace,
        [b.admin_endpoint for b in brokers],
        LMQ_OPERATOR_RETRY_SECONDS="30",
        LMQ_OPERATOR_RESYNC_SECONDS="300",
    )
    waited: list[float] = []
    for name, shown_waiting in (("first", True), ("pair", False)):
        topic, lg_path = unique(f"{name}-t"), testing.cr_path("litegroups", namespace, name)
        create("LiteGroup", namespace, name, {"groupName": unique(f"{name}-g"), "parentTopic": topic})
        if shown_waiting:
            refused = _ready_of(kube, lg_path, ("False", "ParentTopicNotFound"))
            assert _types(refused["status"])["Reconciling"] == ("True", "ParentTopicNotFound")
        started = time.monotonic()
        create("ParentTopic", namespace, f"{name}-topic", {"topicName": topic})
        ready = _status_of(kube, lg_path, ("True", "Applied"))
        waited.append(time.monotonic() - started)
        assert ready["status"]["brokersReady"] == f"{len(brokers)}/{len(brokers)}"

        def reasons(name: str = name) -> set[str] | None:
            items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
            found = {e["reason"] for e in items if e["involvedObject"]["name"] == name}
            return found if "Created" in found else None

        assert "DriftRepaired" not in testing.wait_for(reasons, TIMEOUT_S, f"{name}'s Created Event")
    assert max(waited) < PAIR_READY_S, waited
