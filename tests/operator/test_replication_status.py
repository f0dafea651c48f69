"""The operator's view of broker replication (docs/replication.md, Operator and chart): each slot's Lease and
answering replicas in the StatefulSet's lmq.io/replication, a condition whose reason says what is missing, its
metrics, and a pod count that stays while every slot is kept on several pods.

The report is pure (``replicas.report``); the scaler's part runs on the real apiserver: real Lease objects
written the way brokers write them, the annotation and Events read back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes
import pytest

from lmq_broker.cluster import membership as mb
from lmq_operator import metrics, replicas, scaler, scaling, settings, testing
from lmq_operator.scaling import Phase

NOW = datetime(2026, 11, 28, 18, 0, tzinfo=UTC)
STS = "lmq-broker"
PODS = [f"{STS}-{i}.h:8081" for i in range(4)]


def lease(
    slot: int,
    holder: str,
    *,
    renewed: datetime = NOW,
    epoch: int = 0,
    prefix: str = "demo",
    duration_s: int = 6,
    in_sync: str | None = None,
) -> dict[str, Any]:
    stamp = renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    spec = {"holderIdentity": holder, "leaseDurationSeconds": duration_s, "leaseTransitions": epoch, "renewTime": stamp}
    meta: dict[str, Any] = {"name": f"{prefix}-slot-{slot}"}
    if in_sync is not None:  # as a holder records its in-sync set (lmq_broker.replication.kube)
        meta["annotations"] = {replicas.IN_SYNC: in_sync}
    return {"metadata": meta, "spec": spec}


def test_every_slot_held_and_answering_is_replicated() -> None:
    found = replicas.report([lease(0, "slot-0/a"), lease(1, "slot-1/b")], "demo", 2, 1, 2, {0, 1}, NOW)
    assert found.reason is replicas.Reason.REPLICATED
    assert found.condition() == {"type": "Replicated", "status": "True", "reason": "Replicated"}
    assert [(s.slot, s.holder, s.epoch, s.held, s.missing) for s in found.slots] == [
        (0, "slot-0/a", 0, True, ()),
        (1, "slot-1/b", 0, True, ()),
    ]


def test_a_replica_that_does_not_answer_makes_every_slot_it_holds_under_replicated() -> None:
    # three pods, R=2: pod 1 holds slot 1 and follows slot 0
    leases = [lease(0, "slot-0/a"), lease(1, "slot-0/a", epoch=3), lease(2, "slot-2/c")]
    found = replicas.report(leases, "demo", 3, 1, 2, {0, 2}, NOW)
    assert found.under_replicated == [0, 1] and found.unheld == []
    assert found.reason is replicas.Reason.UNDER_REPLICATED
    assert found.condition()["status"] == "False"
    assert found.message == "slots under-replicated: 0, 1"
    assert found.slots[1].epoch == 3 and found.slots[1].holder == "slot-0/a"  # failed over to slot 0's broker


def test_a_missing_released_or_expired_lease_is_unheld() -> None:
    stale = NOW - timedelta(seconds=7)  # a 6 s lease
    leases = [lease(0, ""), lease(1, "slot-1/b", renewed=stale), lease(3, "slot-3/d"), lease(2, "x", prefix="other")]
    found = replicas.report(leases, "demo", 4, 1, 2, {0, 1, 2, 3}, NOW)
    assert found.unheld == [0, 1, 2]
    # released by its holder (a handover, docs/replication.md step 5): fenced there until a member takes it
    assert replicas.report([lease(0, "released/slot-2/c")], "demo", 1, 1, 1, {0}, NOW).unheld == [0]
    assert found.reason is replicas.Reason.LEASE_UNHELD  # worse than under-replicated: sends of the slot fail
    body = json.loads(found.annotation())
    assert body["unheld"] == 3 and body["underReplicated"] == 0 and body["reason"] == "LeaseUnheld"
    assert body["slots"][3] == {
        "slot": 3,
        "holder": "slot-3/d",
        "epoch": 0,
        "renewed": "2026-11-28T18:00:00.000000Z",
        "held": True,
        "missing": [],
        "inSync": None,
        "outOfSync": [],
    }


def test_a_replica_outside_the_recorded_in_sync_set_makes_its_slot_under_replicated() -> None:
    # R=2 on two pods, both answer: slot 0's holder recorded only itself in sync, slot 1's both
    leases = [lease(0, "slot-0/a", in_sync="0"), lease(1, "slot-1/b", in_sync="0,1"), lease(2, "x", in_sync="no")]
    found = replicas.report(leases, "demo", 2, 1, 2, {0, 1}, NOW)
    assert [(s.in_sync, s.out_of_sync, s.missing) for s in found.slots] == [((0,), (1,), ()), ((0, 1), (), ())]
    assert found.under_replicated == [0] and found.reason is replicas.Reason.UNDER_REPLICATED
    assert json.loads(found.annotation())["slots"][0] | {"renewed": ""} == {
        "slot": 0,
        "holder": "slot-0/a",
        "epoch": 0,
        "renewed": "",
        "held": True,
        "missing": [],
        "inSync": [0],
        "outOfSync": [1],
    }
    assert replicas.in_sync_of(lease(0, "a", in_sync="x,1")) is None  # unreadable (by hand): not judged


def test_replicas_of_a_slot_are_the_same_process_on_the_next_pods() -> None:
    assert replicas.replicas_of(0, 4, 1, 2) == [0, 1]
    assert replicas.replicas_of(3, 4, 1, 3) == [3, 0, 1]
    assert replicas.replicas_of(1, 6, 2, 2) == [1, 3]  # process 1 of pod 0, then of pod 1


def _observed(
    pods: int,
    wanted: int,
    replication: int,
    *,
    sizes: tuple[int, ...] | None = None,
    in_sync: dict[int, tuple[int, ...] | None] | None = None,
    fixed: str = "",
) -> scaling.Observed:
    target = mb.Membership(tuple(PODS[:pods]), sizes or (pods,))
    views: dict[int, scaling.View | None] = {s: scaling.View(target, s, ring_fixed=fixed) for s in range(pods)}
    if in_sync is None:  # every slot's set: exactly its replicas in this ring
        in_sync = {s: tuple(sorted(replicas.replicas_of(s, pods, 1, replication))) for s in range(pods)}
    return scaling.Observed(
        wanted, pods, 1, target, views, {}, lambda i: PODS[i], replication=replication, in_sync=in_sync
    )


def test_with_replication_the_ring_grows_and_shrinks_by_marking_its_last_slots_leaving() -> None:
    down = scaling.decide(_observed(3, 2, 2))  # as at R = 1: slot 2 marked leaving on every broker
    assert (down.phase, down.target, down.tell, down.replicas) == (
        Phase.DRAINING,
        mb.Membership(tuple(PODS[:3]), (3, 2)),
        (2, 0, 1),  # the leaving broker first
        None,
    )
    assert scaling.decide(_observed(3, 2, 1)).phase is Phase.DRAINING  # without replication, as before
    too_few = scaling.decide(_observed(2, 1, 2))  # every slot on 2 pods: never fewer pods than that
    assert too_few.phase is Phase.STALLED and too_few.target is None and "Set it to 2 or more" in too_few.message
    up = scaling.decide(_observed(3, 4, 2))  # as at R = 1: recorded, the pod started, the brokers told once it runs
    assert (up.phase, up.replicas, up.target) == (Phase.SCALING_UP, 4, mb.Membership(tuple(PODS[:4]), (3, 4)))
    assert scaling.decide(_observed(3, 3, 2)).phase is Phase.STEADY


def _leaving(
    undrained: int | None = 0,
    in_sync: dict[int, tuple[int, ...] | None] | None = None,
    holders: dict[int, int | None] | None = None,
    wanted: int = 2,
) -> scaling.Observed:
    """3 pods at R = 2 with slot 2 marked leaving (ring of 2): by default drained, each slot that stays held by
    its own broker with its new-ring replicas (0, 1) in its set, slot 2 held by its own broker."""
    target = mb.Membership(tuple(PODS[:3]), (3, 2))
    views: dict[int, scaling.View | None] = {s: scaling.View(target, s) for s in range(3)}
    sets = {0: (0, 1), 1: (0, 1), 2: (0, 2)} if in_sync is None else in_sync
    held = {0: 0, 1: 1, 2: 2} if holders is None else holders
    return scaling.Observed(
        wanted, 3, 1, target, views, {2: undrained}, lambda i: PODS[i], replication=2, in_sync=sets, holders=held
    )


def test_a_replicated_scale_down_removes_the_leaving_slots_only_once_drained_and_handed_over() -> None:
    """Docs/replication.md, *Changing the ring with R > 1*, step 6: the leaving slot is removed (and only then
    the pod count lowered) once it is drained, each slot that stays is held by a broker that stays and has its
    new-ring replicas in its in-sync set; until then the reason names what it waits for, and nothing is told."""
    done = scaling.decide(_leaving())
    assert (done.phase, done.target, done.replicas) == (
        Phase.SCALED_DOWN,
        mb.Membership(tuple(PODS[:2]), (2,)),
        2,
    )
    assert done.tell == (0, 1, 2)  # the removed broker too (it then only forwards)
    waits = {
        "undrained": _leaving(undrained=5),
        "cannot be asked": _leaving(undrained=None),
        "slot 1: in sync [1, 2], needs its replicas [1, 0]": _leaving(in_sync={0: (0, 1), 1: (1, 2), 2: (0, 2)}),
        "slot 1: in sync [], needs": _leaving(in_sync={0: (0, 1), 1: None, 2: (0, 2)}),
        f"slot 1's lease is held by {PODS[2]}, which is leaving": _leaving(holders={0: 0, 1: 2, 2: 2}),
        "slot 0's lease is held by nobody (released or expired)": _leaving(holders={0: None, 1: 1, 2: 2}),
        f"leaving slot 2's lease is held by {PODS[0]}, not {PODS[2]}": _leaving(holders={0: 0, 1: 1, 2: 0}),
    }
    for reason, observed in waits.items():
        decision = scaling.decide(observed)
        assert decision.phase is Phase.DRAINING, (reason, decision)
        assert reason in decision.message, (reason, decision.message)
        assert decision.tell == () and decision.replicas is None and decision.target is None
    unread = scaling.decide(dataclasses.replace(_leaving(), holders=None))
    assert unread.phase is Phase.WAITING and "could not be read" in unread.message
    again = scaling.decide(_leaving(wanted=3))  # a new wish while draining: the scale-down it marked goes on
    assert again.phase is Phase.SCALED_DOWN and again.replicas == 2
    after = dataclasses.replace(_observed(2, 2, 2, in_sync={0: (0, 1), 1: (0, 1, 2)}), replicas=2)
    assert scaling.decide(after).phase is Phase.SCALING_UP  # slot 1's holder narrows its set to (0, 1) next


def test_the_holder_of_a_slot_lease_is_a_ring_slot_only_while_it_holds_it() -> None:
    assert replicas.holder_of(lease(1, "slot-2/pod-2"), NOW) == 2
    for gone in (
        lease(1, "released/slot-2/pod-2"),
        lease(1, ""),
        lease(1, "slot-2/a", renewed=NOW - timedelta(seconds=7)),
    ):
        assert replicas.holder_of(gone, NOW) is None
    assert replicas.holder_of(lease(1, "someone-else"), NOW) is None  # a person's forced takeover: no ring slot
    assert replicas.holder_of({}, NOW) is None


def test_with_replication_a_ring_does_not_change_while_a_broker_holds_topics_without_their_slot() -> None:
    for wanted, way in ((4, "grow"), (2, "shrink")):
        decision = scaling.decide(_observed(3, wanted, 2, fixed="lite topic x was stored without its slot"))
        assert decision.phase is Phase.STALLED
        assert decision.target is None and decision.tell == () and decision.replicas is None
        assert f"cannot {way} a ring replicated 2 times" in decision.message and "without its slot" in decision.message


def test_after_a_grown_ring_the_operator_waits_until_every_slot_names_only_its_new_replicas() -> None:
    """2 -> 3 pods at R = 2: slot 1's replicas move from (1, 0) to (1, 2). Until its holder wrote the set without
    broker 0 (once broker 2 was in it) the change is not over: no other change, not even Steady; a lease that
    names no set yet (the new slot's first tick) is waited for; Leases that cannot be read stop everything."""
    moving = scaling.decide(_observed(3, 3, 2, sizes=(2, 3), in_sync={0: (0, 1), 1: (0, 1, 2), 2: (0, 2)}))
    assert moving.phase is Phase.SCALING_UP and "slot 1: in sync [0, 1, 2], replicas [1, 2]" in moving.message
    assert moving.tell == () and moving.replicas is None
    assert scaling.decide(_observed(3, 4, 2, sizes=(2, 3), in_sync={0: (0, 1), 1: (0, 1), 2: (2,)})).replicas is None
    unset = scaling.decide(_observed(3, 3, 2, sizes=(2, 3), in_sync={0: (0, 1), 1: (1, 2), 2: None}))
    assert unset.phase is Phase.WAITING and "slots [2]" in unset.message
    unread = scaling.decide(dataclasses.replace(_observed(3, 3, 2), in_sync=None))
    assert unread.phase is Phase.WAITING and "could not be read" in unread.message
    behind = scaling.decide(_observed(3, 3, 2, sizes=(2, 3), in_sync={0: (0, 1), 1: (1,), 2: (2, 0)}))
    assert behind.phase is Phase.STEADY  # a follower away (fewer copies): under-replicated, not a change


def test_settings_of_replication() -> None:
    env = {"LMQ_OPERATOR_BROKERS": "127.0.0.1:1"}
    assert (settings.from_env(env).replication, settings.from_env(env).slot_lease_prefix) == (1, "lmq")
    conf = settings.from_env({**env, "LMQ_OPERATOR_BROKER_REPLICATION": "3", "LMQ_OPERATOR_SLOT_LEASE_PREFIX": "x"})
    assert (conf.replication, conf.slot_lease_prefix) == (3, "x")
    with pytest.raises(settings.SettingsError, match=r"1\.\.5"):
        settings.from_env({**env, "LMQ_OPERATOR_BROKER_REPLICATION": "0"})


# ---- on the real apiserver ---------------------------------------------------------------------------------


def _put_lease(
    kube: testing.KubeAPI, namespace: str, slot: int, holder: str, renewed: datetime, *, in_sync: str | None = None
) -> None:
    """A slot Lease as a broker writes it (lmq_broker.replication.kube): created, or replaced by its holder."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    # a long lease: the passes below must not see it expire on a slow shared machine
    fields = lease(slot, holder, renewed=renewed, duration_s=600, in_sync=in_sync)
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", **fields}
    try:
        current = kube.get(f"{path}/demo-slot-{slot}")
    except Exception:
        kube.post(path, body)
        return
    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    kube.request("PUT", f"{path}/demo-slot-{slot}", body)


def _events(kube: testing.KubeAPI, namespace: str) -> list[tuple[str, str]]:
    items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return [(e["type"], e["reason"]) for e in items if e["involvedObject"]["name"] == STS]


def test_the_scaler_reports_the_slot_leases_on_the_statefulset(kube: testing.KubeAPI, namespace: str) -> None:
    testing.publish_brokers(kube, namespace, STS, [], 2)
    env = {
        "LMQ_OPERATOR_BROKER_NAMESPACE": namespace,
        "LMQ_OPERATOR_BROKER_STATEFULSET": STS,
        "LMQ_OPERATOR_BROKER_SERVICE": STS,
        "LMQ_OPERATOR_BROKER_REPLICATION": "2",
        "LMQ_OPERATOR_SLOT_LEASE_PREFIX": "demo",
    }
    client = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))  # type: ignore[no-untyped-call]
    member = scaler.Scaler(settings.from_env(env), lambda: client)
    target = mb.Membership(tuple(PODS[:2]), (2,))
    sts_path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{STS}"

    def report(answering: set[int]) -> dict[str, Any]:
        views: Mapping[int, scaling.View | None] = {
            s: scaling.View(target, s) if s in answering else None for s in (0, 1)
        }
        observed = scaling.Observed(2, 2, 1, target, views, {}, lambda i: PODS[i], replication=2)
        asyncio.run(member.report_replication(kube.get(sts_path), target, observed))
        found: dict[str, Any] = json.loads(kube.get(sts_path)["metadata"]["annotations"][replicas.ANNOTATION])
        return found

    def gauge(state: str) -> float:
        value: float = metrics.REPLICATION_SLOTS.labels(state)._value.get()
        return value

    now = datetime.now(UTC)
    _put_lease(kube, namespace, 0, "slot-0/a", now)
    first = report({0, 1})
    assert (first["reason"], first["unheld"], first["status"]) == ("LeaseUnheld", 1, "False")  # slot 1: no lease
    assert first["slots"][0]["holder"] == "slot-0/a" and first["slots"][0]["held"]
    assert (gauge("unheld"), gauge("all")) == (1, 2)
    _put_lease(kube, namespace, 1, "slot-1/b", now)
    assert report({0, 1})["reason"] == "Replicated" and gauge("unheld") == 0
    degraded = report({0})  # pod 1 stopped answering: both slots lack a replica
    assert (degraded["reason"], degraded["underReplicated"]) == ("UnderReplicated", 2)
    assert [s["missing"] for s in degraded["slots"]] == [[1], [1]] and gauge("under_replicated") == 2
    events = sorted(_events(kube, namespace))  # one per change of reason (the API lists them by name)
    assert events == [("Normal", "Replicated"), ("Warning", "LeaseUnheld"), ("Warning", "UnderReplicated")]
    report({0})  # unchanged: no new Event
    assert len(_events(kube, namespace)) == 3
    _put_lease(kube, namespace, 0, "slot-0/a", now, in_sync="0")  # pod 1 answers again, not yet back in slot 0's set
    behind = report({0, 1})
    assert (behind["reason"], behind["underReplicated"]) == ("UnderReplicated", 1)
    assert (behind["slots"][0]["inSync"], behind["slots"][0]["outOfSync"]) == ([0], [1])
    assert len(_events(kube, namespace)) == 3  # still the same reason
    _put_lease(kube, namespace, 0, "slot-0/a", now, in_sync="0,1")
    assert report({0, 1})["reason"] == "Replicated" and gauge("under_replicated") == 0
    assert sorted(_events(kube, namespace))[0] == ("Normal", "Replicated") and len(_events(kube, namespace)) == 4


def test_only_the_leases_of_removed_slots_whose_pods_are_gone_and_that_nobody_holds_are_to_delete() -> None:
    """After a scale-down to 2 slots: slot 2's Lease (expired, its pod gone) goes; slot 3's is still renewed (its
    pod still stops), slot 4's pod is still published, slots 0 and 1 are of the ring (slot 1's expired all the
    same), and a Lease of another release stays."""
    stale = NOW - timedelta(seconds=7)  # a 6 s lease
    leases = [
        lease(0, "slot-0/a"),
        lease(1, "slot-1/b", renewed=stale),
        {**lease(2, "slot-2/c", renewed=stale), "metadata": {"name": "demo-slot-2", "resourceVersion": "17"}},
        lease(3, "slot-3/d"),
        lease(4, "released/slot-4/e"),
        lease(5, "slot-5/f", renewed=stale, prefix="other"),
        lease(6, "released/slot-6/g"),
    ]
    assert replicas.removed(leases, "demo", 2, {0, 1, 4}, NOW) == [("demo-slot-2", "17"), ("demo-slot-6", "")]
