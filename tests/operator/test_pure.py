"""The pure half of the operator: specs to configs, plans, conditions, settings, EndpointSlice parsing."""

from __future__ import annotations

import asyncio
import types
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import pytest

from lmq_operator import admins, apply, desired, diff, discovery, handlers, model, settings, slices, status

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
B0 = model.Broker("b0", "10.0.0.1:8081", 0)
B1 = model.Broker("b1", "10.0.0.2:8081", 1)


# ---- desired -------------------------------------------------------------------------------------------


def test_parent_topic_defaults_to_metadata_name() -> None:
    cfg = desired.config(model.Kind.PARENT_TOPIC, "orders", {})
    assert cfg == model.TopicConfig(name="orders", expiration_minutes=-1, max_lite_topics=-1, message_type=5)


def test_parent_topic_spec_name_wins_and_fields_map() -> None:
    spec = {"topicName": "Orders_v2", "liteTopicExpirationMinutes": 60, "maxLiteTopics": 10}
    cfg = desired.config(model.Kind.PARENT_TOPIC, "orders.v2", spec)
    assert cfg == model.TopicConfig(name="Orders_v2", expiration_minutes=60, max_lite_topics=10)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"liteTopicExpirationMinutes": 0}, "liteTopicExpirationMinutes"),
        ({"liteTopicExpirationMinutes": 43201}, "liteTopicExpirationMinutes"),
        ({"maxLiteTopics": 0}, "maxLiteTopics"),
        ({"messageType": "NORMAL"}, "messageType"),
        ({"topicName": "a$b"}, "topicName"),
        ({"deletionPolicy": "orphan"}, "deletionPolicy"),
    ],
)
def test_invalid_parent_topic_specs_become_values(spec: dict[str, object], needle: str) -> None:
    cfg = desired.config(model.Kind.PARENT_TOPIC, "t", spec)
    assert isinstance(cfg, desired.InvalidSpec)
    assert needle in cfg.message


def test_metadata_name_with_dots_needs_a_topic_name() -> None:
    cfg = desired.config(model.Kind.PARENT_TOPIC, "orders.eu", {})
    assert isinstance(cfg, desired.InvalidSpec)
    assert "set spec.topicName" in cfg.message


def test_lite_group_config_parses_backoff_durations() -> None:
    spec = {
        "parentTopic": "orders",
        "subscriptionModel": "Exclusive",
        "retryPolicy": {"maxAttempts": 3, "backoff": ["500ms", "2s", "1m", "1h"]},
        "fifo": False,
    }
    cfg = desired.config(model.Kind.LITE_GROUP, "workers", spec)
    assert isinstance(cfg, model.GroupConfig)
    assert (cfg.name, cfg.bind_topic, cfg.model, cfg.fifo) == ("workers", "orders", "Exclusive", False)
    assert cfg.max_attempts == 3
    assert cfg.backoff_ms == (500, 2_000, 60_000, 3_600_000)
    assert cfg.client_quota == 2000 and cfg.ready_capacity == 100 and cfg.consume_enabled


def test_a_wildcard_lite_groups_patterns_reach_its_config() -> None:
    spec = {"parentTopic": "t", "wildcard": True, "litePatterns": ["session-*", "dev/+/cmd"]}
    cfg = desired.config(model.Kind.LITE_GROUP, "g", spec)
    assert isinstance(cfg, model.GroupConfig) and cfg.lite_patterns == ("session-*", "dev/+/cmd")
    plain = desired.config(model.Kind.LITE_GROUP, "g", {"parentTopic": "t"})
    assert isinstance(plain, model.GroupConfig) and plain.lite_patterns == ()


def test_lite_group_default_backoff_is_rocketmqs() -> None:
    cfg = desired.config(model.Kind.LITE_GROUP, "g", {"parentTopic": "t"})
    assert isinstance(cfg, model.GroupConfig)
    assert cfg.max_attempts == 17
    assert cfg.backoff_ms[:4] == (1_000, 5_000, 10_000, 30_000) and cfg.backoff_ms[-1] == 7_200_000
    assert len(cfg.backoff_ms) == 18


def test_lite_group_rejects_bad_backoff_and_missing_parent() -> None:
    bad = desired.config(model.Kind.LITE_GROUP, "g", {"parentTopic": "t", "retryPolicy": {"backoff": ["5 sec"]}})
    assert isinstance(bad, desired.InvalidSpec) and "5 sec" in bad.message
    missing = desired.config(model.Kind.LITE_GROUP, "g", {})
    assert isinstance(missing, desired.InvalidSpec) and "parentTopic" in missing.message


def test_quota_scope_is_exactly_one_of_namespace_and_parent() -> None:
    ns = desired.config(model.Kind.LITE_QUOTA, "q", {"rocketmqNamespace": "prod", "maxLiteTopics": 5})
    assert ns == model.QuotaConfig("namespace:prod", 5, -1, -1)
    parent = desired.config(model.Kind.LITE_QUOTA, "q", {"parentTopic": "orders", "maxSendRate": 100})
    assert parent == model.QuotaConfig("parent:orders", -1, -1, 100)
    both = desired.config(model.Kind.LITE_QUOTA, "q", {"rocketmqNamespace": "a", "parentTopic": "b"})
    neither = desired.config(model.Kind.LITE_QUOTA, "q", {})
    assert isinstance(both, desired.InvalidSpec) and "exactly one" in both.message
    assert isinstance(neither, desired.InvalidSpec) and "exactly one" in neither.message


@pytest.mark.parametrize(
    ("annotations", "mode"),
    [
        ({}, model.Mode.MANAGED),
        ({"lmq.io/managed": "false"}, model.Mode.UNMANAGED),
        ({"lmq.io/managed": "true"}, model.Mode.MANAGED),
        ({"lmq.io/pause-reconciliation": "true"}, model.Mode.PAUSED),
        ({"lmq.io/pause-reconciliation": "false"}, model.Mode.MANAGED),
        ({"lmq.io/pause-reconciliation": "true", "lmq.io/managed": "false"}, model.Mode.UNMANAGED),
    ],
)
def test_mode_from_annotations(annotations: dict[str, str], mode: model.Mode) -> None:
    assert desired.mode(annotations) is mode


def test_oldest_claimant_owns_the_name() -> None:
    old = model.Claimant("a", "x", "uid-old", "2026-01-01T00:00:00Z")
    young = model.Claimant("a", "y", "uid-young", "2026-01-01T00:00:01Z")
    assert desired.owner([young, old]) == old
    assert desired.conflicting_owner("uid-young", [young, old]) == old
    assert desired.conflicting_owner("uid-old", [young, old]) is None
    assert desired.conflicting_owner("uid-new", []) is None


def test_claimants_created_in_the_same_second_break_ties_deterministically() -> None:
    a = model.Claimant("ns", "a", "u2", "2026-01-01T00:00:00Z")
    b = model.Claimant("ns", "b", "u1", "2026-01-01T00:00:00Z")
    assert desired.owner([b, a]) == a == desired.owner([a, b])


# ---- diff ----------------------------------------------------------------------------------------------

TOPIC = model.TopicConfig("orders", 60, -1)


def test_plan_creates_missing_overwrites_different_and_keeps_equal() -> None:
    other = model.TopicConfig("orders", 30, -1)
    b2 = model.Broker("b2", "10.0.0.3:8081", 2)
    planned = diff.plan(
        TOPIC,
        {B0: None, B1: model.Observed(other), b2: model.Observed(TOPIC, (("liteTopicCount", 3),))},
    )
    assert [(s.broker, s.change) for s in planned.steps] == [
        (B0, diff.Change.MISSING),
        (B1, diff.Change.DIFFERS),
        (b2, diff.Change.NONE),
    ]
    assert [s.broker for s in planned.writes] == [B0, B1]
    assert planned.unreachable == ()


def test_unreachable_broker_is_reported_not_planned() -> None:
    planned = diff.plan(TOPIC, {B0: diff.Unreachable("UNAVAILABLE: down"), B1: None})
    assert [s.broker for s in planned.steps] == [B1]
    assert planned.unreachable == ((B0, "UNAVAILABLE: down"),)


def test_delete_asks_every_broker() -> None:
    assert diff.plan_delete([B1, B0], "orders") == ((B0, "orders"), (B1, "orders"))


# ---- status --------------------------------------------------------------------------------------------


def _ready(st: dict[str, object]) -> dict[str, object]:
    conds = st["conditions"]
    assert isinstance(conds, list)
    found: dict[str, object] = next(c for c in conds if c["type"] == "Ready")
    return found


def test_applied_everywhere_is_ready_with_figures_summed() -> None:
    syncs = [
        model.BrokerSync(B0, True, "missing", figures=(("liteTopicCount", 2),)),
        model.BrokerSync(B1, True, "none", figures=(("liteTopicCount", 5),)),
    ]
    st = status.applied(model.Kind.PARENT_TOPIC, "orders", generation=3, syncs=syncs, previous={}, now=NOW)
    assert st["observedGeneration"] == 3 and st["topicName"] == "orders"
    assert st["brokersReady"] == "2/2" and st["liteTopicCount"] == 7
    assert _ready(st) | {} == {
        "type": "Ready",
        "status": "True",
        "reason": "Applied",
        "message": "applied to 2/2 brokers",
        "lastTransitionTime": "2026-01-02T03:04:05Z",
        "observedGeneration": 3,
    }
    assert st["brokers"] == [
        {"name": "b0", "endpoint": "10.0.0.1:8081", "synced": True, "liteTopicCount": 2},
        {"name": "b1", "endpoint": "10.0.0.2:8081", "synced": True, "liteTopicCount": 5},
    ]


def test_one_unavailable_broker_makes_it_not_ready_with_the_reason() -> None:
    syncs = [
        model.BrokerSync(B0, True, "none"),
        model.BrokerSync(B1, False, "", model.Failure.UNAVAILABLE, "UNAVAILABLE: connection refused"),
    ]
    st = status.applied(model.Kind.LITE_GROUP, "g", generation=1, syncs=syncs, previous={}, now=NOW)
    ready = _ready(st)
    assert (ready["status"], ready["reason"]) == ("False", "BrokerUnavailable")
    assert "1/2 brokers in sync" in str(ready["message"]) and "b1: UNAVAILABLE" in str(ready["message"])
    assert st["brokersReady"] == "1/2"
    assert st["subscriptionCount"] == 0 and st["lag"] == 0


def test_rejection_wins_over_unavailability_in_the_reason() -> None:
    syncs = [
        model.BrokerSync(B0, False, "", model.Failure.REJECTED, "FAILED_PRECONDITION: no such topic"),
        model.BrokerSync(B1, False, "", model.Failure.UNAVAILABLE, "UNAVAILABLE"),
    ]
    st = status.applied(model.Kind.LITE_GROUP, "g", generation=1, syncs=syncs, previous={}, now=NOW)
    assert _ready(st)["reason"] == "BrokerRejected"


def test_no_brokers_is_not_ready() -> None:
    st = status.applied(model.Kind.LITE_QUOTA, "parent:x", generation=1, syncs=[], previous={}, now=NOW)
    assert (_ready(st)["status"], _ready(st)["reason"]) == ("False", "NoBrokers")


def test_transition_time_only_moves_when_the_status_flips() -> None:
    ok = [model.BrokerSync(B0, True, "none")]
    first = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=ok, previous={}, now=NOW)
    later = NOW + timedelta(minutes=5)
    again = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=ok, previous=first, now=later)
    assert status.changes(first, again) == {}
    bad = [model.BrokerSync(B0, False, "", model.Failure.UNAVAILABLE, "down")]
    flipped = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=bad, previous=again, now=later)
    assert _ready(flipped)["lastTransitionTime"] == "2026-01-02T03:09:05Z"
    assert set(status.changes(again, flipped)) == {"brokersReady", "brokers", "conditions"}


# ---- status.lastReclaim ----------------------------------------------------------------------------------

B2 = model.Broker("b2", "10.0.0.3:8081", 2)
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z in epoch ms


def _run(run_id: str, start_ms: int, **counts: Any) -> model.ReclaimRun:
    return model.ReclaimRun(run_id, start_ms, start_ms + 90_500, **counts)


def _reclaim(syncs: list[model.BrokerSync], previous: dict[str, Any] | None = None) -> dict[str, Any]:
    prior = {} if previous is None else {"lastReclaim": previous}
    return status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=syncs, previous=prior, now=NOW)


def test_last_reclaim_is_the_newest_run_summed_over_the_brokers_that_recorded_it() -> None:
    new_b0 = _run("job-2", T0 + 60_000, scanned=10, expired=6, reclaimed=3, kept_changed=1, kept_subscribed=1)
    new_b1 = model.ReclaimRun("job-2", T0 + 60_000, T0 + 200_000, 4, 4, 2, 0, 0, not_found=1, errors=1)
    old_b2 = _run("job-1", T0, scanned=99, reclaimed=99)  # a broker the newer run could not plan
    syncs = [
        model.BrokerSync(B0, True, "none", reclaim=new_b0),
        model.BrokerSync(B1, False, "differs", model.Failure.UNAVAILABLE, "put failed", reclaim=new_b1),
        model.BrokerSync(B2, True, "none", reclaim=old_b2),
    ]
    assert _reclaim(syncs)["lastReclaim"] == {
        "runId": "job-2",
        "startTime": "2026-01-01T00:01:00.000Z",
        "finishTime": "2026-01-01T00:03:20.000Z",  # the later of the two brokers' finish times
        "dryRun": False,
        "brokers": 2,
        "scanned": 14,
        "expired": 10,
        "reclaimed": 5,
        "keptByRace": 2,
        "notFound": 1,
        "errors": 1,
    }


def test_a_retried_job_keeps_its_run_id_but_only_the_latest_attempt_counts() -> None:
    retry_b0 = _run("job-3", T0 + 90_000, scanned=5, reclaimed=5)
    first_b1 = _run("job-3", T0, scanned=50, reclaimed=40)  # the first attempt: the retry never reached b1
    syncs = [
        model.BrokerSync(B0, True, "none", reclaim=retry_b0),
        model.BrokerSync(B1, True, "none", reclaim=first_b1),
    ]
    shown = _reclaim(syncs)["lastReclaim"]
    assert (shown["runId"], shown["startTime"], shown["brokers"]) == ("job-3", "2026-01-01T00:01:30.000Z", 1)
    assert (shown["scanned"], shown["reclaimed"]) == (5, 5)


def test_no_recorded_run_means_no_last_reclaim() -> None:
    st = _reclaim([model.BrokerSync(B0, True, "none")])
    assert "lastReclaim" not in st
    group = status.applied(model.Kind.LITE_GROUP, "g", generation=1, syncs=[], previous={}, now=NOW)
    assert "lastReclaim" not in group


def test_last_reclaim_never_goes_back_and_a_resync_that_sees_the_same_run_writes_nothing() -> None:
    both = [
        model.BrokerSync(B0, True, "none", reclaim=_run("job-2", T0, reclaimed=3)),
        model.BrokerSync(B1, True, "none", reclaim=_run("job-2", T0, reclaimed=4, dry_run=True)),
    ]
    first = _reclaim(both)
    shown = first["lastReclaim"]
    assert (shown["brokers"], shown["reclaimed"], shown["dryRun"]) == (2, 7, True)
    again = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=both, previous=first, now=NOW)
    assert status.changes(first, again) == {}

    # b1 unreachable: only one broker's share of the same run is visible; b0 then shows an older run.
    unreachable = model.BrokerSync(B1, False, "", model.Failure.UNAVAILABLE, "down")
    fewer = [model.BrokerSync(B0, True, "none", reclaim=_run("job-2", T0, reclaimed=3)), unreachable]
    assert _reclaim(fewer, shown)["lastReclaim"] == shown
    older = [model.BrokerSync(B0, True, "none", reclaim=_run("job-1", T0 - 3_600_000)), unreachable]
    assert _reclaim(older, shown)["lastReclaim"] == shown
    assert _reclaim([unreachable], shown)["lastReclaim"] == shown  # nothing observed: what was shown stays

    # A newer run replaces it even before every broker has recorded it.
    newer = [model.BrokerSync(B0, True, "none", reclaim=_run("job-3", T0 + 3_600_000, expired=1)), unreachable]
    moved = _reclaim(newer, shown)["lastReclaim"]
    assert (moved["runId"], moved["brokers"], moved["expired"]) == ("job-3", 1, 1)
    # And more brokers of the run shown replace their smaller sum.
    grown = [*both, model.BrokerSync(B2, True, "none", reclaim=_run("job-2", T0, reclaimed=1))]
    assert _reclaim(grown, shown)["lastReclaim"]["reclaimed"] == 8


def test_reclaim_timestamps_keep_milliseconds_and_sort_as_instants() -> None:
    assert status.timestamp_ms(T0 + 1_234) == "2026-01-01T00:00:01.234Z"
    assert status.timestamp_ms(0) == "1970-01-01T00:00:00.000Z"
    stamps = [T0 + 999, T0 + 1_000, T0 - 1, T0 + 86_400_000]
    assert sorted(stamps) == sorted(stamps, key=status.timestamp_ms)


def test_paused_keeps_the_old_observed_generation() -> None:
    ok = [model.BrokerSync(B0, True, "none")]
    applied = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=ok, previous={}, now=NOW)
    paused = status.blocked(status.Reason.RECONCILIATION_PAUSED, "paused", generation=2, previous=applied, now=NOW)
    assert paused["observedGeneration"] == 1
    assert "observedGeneration" not in status.changes(applied, paused)
    assert (_ready(paused)["status"], _ready(paused)["reason"]) == ("Unknown", "ReconciliationPaused")
    assert "observedGeneration" not in _ready(paused)


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        (status.Reason.UNMANAGED, "True"),
        (status.Reason.INVALID, "False"),
        (status.Reason.RESOURCE_CONFLICT, "False"),
    ],
)
def test_blocked_reasons_observe_the_generation(reason: status.Reason, state: str) -> None:
    st = status.blocked(reason, "why", generation=4, previous={}, now=NOW)
    assert st["observedGeneration"] == 4
    assert (_ready(st)["status"], _ready(st)["reason"], _ready(st)["message"]) == (state, reason.value, "why")


@pytest.mark.parametrize(
    ("reason", "kept"),
    [
        (status.Reason.RECONCILIATION_PAUSED, {"observedGeneration", "topicName", "lastReclaim"}),
        (status.Reason.UNMANAGED, {"observedGeneration", "topicName", "lastReclaim"}),
        (status.Reason.RESOURCE_CONFLICT, {"observedGeneration", "topicName", "lastReclaim"}),
        (status.Reason.INVALID, {"observedGeneration", "lastReclaim"}),
    ],
)
def test_fields_a_blocked_status_drops_are_removed_by_the_patch(reason: status.Reason, kept: set[str]) -> None:
    syncs = [model.BrokerSync(B0, True, "none", figures=(("liteTopicCount", 3),), reclaim=_run("job-1", T0))]
    applied = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=syncs, previous={}, now=NOW)
    status.with_condition(applied, status.drained([], applied, NOW))
    key = None if reason is status.Reason.INVALID else (model.Kind.PARENT_TOPIC, "t")
    new = status.blocked(reason, "why", generation=1, previous=applied, now=NOW, key=key)
    patch = status.changes(applied, new)
    # brokersReady ("1/1" beside Ready=Unknown in `kubectl get`), brokers[] and the figures go; nothing else
    removed = {k for k, v in patch.items() if v is None}
    assert removed == set(applied) - kept - {"conditions"}
    assert {"brokersReady", "brokers", "liteTopicCount"} <= removed
    stalled = {"Stalled"} if reason in status.TERMINAL else set()  # a person has to act on those
    assert {c["type"] for c in patch["conditions"]} == {"Ready", "BrokersDrained"} | stalled
    assert new["lastReclaim"] == applied["lastReclaim"]
    # and a status that drops nothing patches nothing it does not change
    assert status.changes(new, new) == {}


def test_drained_condition_names_the_leaving_broker() -> None:
    leaving = [model.Leaving(B1, replicas=1, undrained_messages=12)]
    cond = status.drained(leaving, {}, NOW)
    assert (cond["type"], cond["status"], cond["reason"]) == ("BrokersDrained", "False", "UndrainedBrokerLeaving")
    assert cond["message"] == "b1 (ordinal 1 >= replicas 1) still holds 12 undrained messages"
    assert status.drained([], {}, NOW)["status"] == "True"


def test_a_leaving_broker_that_cannot_be_asked_is_not_drained_while_its_claim_exists() -> None:
    gone = model.Broker("lmq-broker-2", "", 2)
    leaving = [model.Leaving(gone, replicas=2, undrained_messages=None, claim="data-lmq-broker-2")]
    cond = status.drained(leaving, {}, NOW)
    assert (cond["status"], cond["reason"]) == ("False", "LeavingBrokerUnreachable")
    assert cond["message"] == (
        "lmq-broker-2 (ordinal 2 >= replicas 2) cannot be asked whether it is drained, "
        "and its claim data-lmq-broker-2 still exists"
    )
    # a known undrained broker is the stronger statement; both are listed
    both = status.drained([*leaving, model.Leaving(B1, 1, 3)], {}, NOW)
    assert both["reason"] == "UndrainedBrokerLeaving" and "data-lmq-broker-2" in both["message"]


class _StubFleet(discovery.Fleet):
    """``Fleet`` with its Kubernetes reads replaced: a StatefulSet of ``replicas``, these slices and claims."""

    def __init__(self, open_: dict[str, Any], replicas: int, pods: dict[int, str], claims: dict[int, str]) -> None:
        conf = settings.Settings(broker_service="b", broker_namespace="ns", broker_statefulset="lmq-broker")
        super().__init__(conf, admins.AdminPool(open_.__getitem__))
        self.replicas, self.pods, self.claims_ = replicas, pods, claims

    async def _replicas(self) -> int | None:
        return self.replicas

    async def _claims(self, replicas: int) -> dict[int, str]:
        return {n: c for n, c in self.claims_.items() if n >= replicas}

    async def _slices(self) -> list[Any]:
        return [
            {
                "ports": [{"name": "grpc", "port": 8081}],
                "endpoints": [{"addresses": [ip], "targetRef": {"name": f"lmq-broker-{n}"}}],
            }
            for n, ip in self.pods.items()
        ]


@pytest.mark.asyncio
async def test_fleet_reports_leaving_ordinals_from_claims_as_well_as_endpoints() -> None:
    b0, b1 = admins.MemoryAdmin("10.0.0.1:8081"), admins.MemoryAdmin("10.0.0.2:8081")
    fleet = _StubFleet({b0.endpoint: b0, b1.endpoint: b1}, 1, {0: "10.0.0.1", 1: "10.0.0.2"}, {})
    fleet.claims_ = {0: "data-lmq-broker-0", 1: "data-lmq-broker-1"}
    view = await fleet._discover(None)
    assert [b.name for b in view.targets] == ["lmq-broker-0"]
    assert view.leaving == ()  # reachable and drained: its claim alone is no reason to worry

    b1.undrained = 4
    (x,) = (await fleet._discover(None)).leaving
    assert (x.broker.name, x.undrained_messages, x.claim) == ("lmq-broker-1", 4, "data-lmq-broker-1")

    b1.down = True  # listed but not answering, claim still there
    (x,) = (await fleet._discover(None)).leaving
    assert (x.undrained_messages, x.claim) == (None, "data-lmq-broker-1")

    del fleet.pods[1]  # the pod (and its endpoint) is gone, the claim stays
    (x,) = (await fleet._discover(None)).leaving
    assert (x.broker.name, x.broker.ordinal, x.undrained_messages, x.claim) == (
        "lmq-broker-1", 1, None, "data-lmq-broker-1"
    )  # fmt: skip

    del fleet.claims_[1]  # the claim is deleted: nothing is left behind
    assert (await fleet._discover(None)).leaving == ()
    await fleet.close()


class _NoClaimsFleet(_StubFleet):
    """A role without the claims rule: listing the volume claims is refused."""

    async def _claims(self, replicas: int) -> dict[int, str]:
        raise PermissionError("persistentvolumeclaims is forbidden")


@pytest.mark.asyncio
async def test_fleet_finds_its_brokers_when_the_claims_cannot_be_listed() -> None:
    b0, b1 = admins.MemoryAdmin("10.0.0.1:8081"), admins.MemoryAdmin("10.0.0.2:8081")
    b1.undrained = 2
    fleet = _NoClaimsFleet({b0.endpoint: b0, b1.endpoint: b1}, 1, {0: "10.0.0.1", 1: "10.0.0.2"}, {})
    view = await fleet._discover(None)
    assert view.error is None and [b.name for b in view.targets] == ["lmq-broker-0"]
    (x,) = view.leaving  # a listed leaving broker is still asked; only the claim evidence is missing
    assert (x.broker.name, x.undrained_messages, x.claim) == ("lmq-broker-1", 2, None)
    await fleet.close()


def test_other_conditions_survive_a_ready_update() -> None:
    drained = status.drained([], {}, NOW)
    prev = {"conditions": [drained]}
    st = status.applied(model.Kind.PARENT_TOPIC, "t", generation=1, syncs=[], previous=prev, now=NOW)
    assert {c["type"] for c in st["conditions"]} == {"Ready", "BrokersDrained", "Reconciling"}  # no broker yet


# ---- settings ------------------------------------------------------------------------------------------


def test_settings_static_brokers() -> None:
    conf = settings.from_env({"LMQ_OPERATOR_BROKERS": "a:1, b:2", "LMQ_OPERATOR_RESYNC_SECONDS": "2.5"})
    assert conf.brokers == ("a:1", "b:2") and conf.resync_s == 2.5 and conf.namespace is None
    assert conf.metrics_port == 9101 and conf.liveness_endpoint == "http://0.0.0.0:8080/healthz"


def test_settings_of_the_memory_bounds() -> None:
    conf = settings.from_env({"LMQ_OPERATOR_BROKERS": "a:1"})
    assert conf.workers == settings.DEFAULT_WORKERS
    assert settings.from_env({"LMQ_OPERATOR_BROKERS": "a:1", "LMQ_OPERATOR_WORKERS": "0"}).workers == 0
    with pytest.raises(settings.SettingsError, match="LMQ_OPERATOR_WORKERS"):
        settings.from_env({"LMQ_OPERATOR_BROKERS": "a:1", "LMQ_OPERATOR_WORKERS": "-1"})


def test_settings_service_discovery_needs_a_namespace() -> None:
    with pytest.raises(settings.SettingsError, match="LMQ_OPERATOR_BROKER_NAMESPACE"):
        settings.from_env({"LMQ_OPERATOR_BROKER_SERVICE": "lmq-broker"})
    conf = settings.from_env(
        {
            "LMQ_OPERATOR_BROKER_SERVICE": "lmq-broker",
            "LMQ_OPERATOR_BROKER_NAMESPACE": "lmq",
            "LMQ_OPERATOR_BROKER_STATEFULSET": "lmq-broker",
            "LMQ_OPERATOR_NAMESPACE": "apps",
        }
    )
    assert (conf.broker_service, conf.broker_statefulset, conf.namespace) == ("lmq-broker", "lmq-broker", "apps")


def test_settings_admin_keys_come_in_pairs() -> None:
    conf = settings.from_env(
        {"LMQ_OPERATOR_BROKERS": "a:1", "LMQ_OPERATOR_ACCESS_KEY": "ak", "LMQ_OPERATOR_SECRET_KEY": "sk"}
    )
    assert conf.admin_keys == ("ak", "sk")
    assert settings.from_env({"LMQ_OPERATOR_BROKERS": "a:1"}).admin_keys is None


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"LMQ_OPERATOR_BROKERS": "nohost"},
        {"LMQ_OPERATOR_BROKERS": "a:1", "LMQ_OPERATOR_RESYNC_SECONDS": "-1"},
        {"LMQ_OPERATOR_BROKERS": "a:1", "LMQ_OPERATOR_ACCESS_KEY": "ak"},
    ],
)
def test_settings_errors_are_readable(env: dict[str, str]) -> None:
    with pytest.raises(settings.SettingsError, match="LMQ_OPERATOR_"):
        settings.from_env(env)


# ---- EndpointSlices ------------------------------------------------------------------------------------


def test_brokers_from_endpoint_slices() -> None:
    listed: list[dict[str, Any]] = [
        {
            "ports": [{"name": "grpc", "port": 8081}, {"name": "metrics", "port": 9100}],
            "endpoints": [
                {"addresses": ["10.1.0.5"], "conditions": {"ready": True}, "targetRef": {"name": "lmq-broker-0"}},
                {"addresses": ["10.1.0.6"], "conditions": {"ready": False}, "targetRef": {"name": "lmq-broker-1"}},
                {"addresses": [], "targetRef": {"name": "lmq-broker-9"}},
            ],
        },
        {"ports": [], "endpoints": [{"addresses": ["10.1.0.7"], "targetRef": {"name": "lmq-broker-2"}}]},
    ]
    found = slices.brokers(listed, default_port=8081)
    assert found == [
        (model.Broker("lmq-broker-0", "10.1.0.5:8081", 0), True),
        (model.Broker("lmq-broker-1", "10.1.0.6:8081", 1), False),
        (model.Broker("lmq-broker-2", "10.1.0.7:8081", 2), True),
    ]


def test_a_port_named_admin_wins_over_grpc_whatever_the_order() -> None:
    """Brokers serving admin on its own port (the chart's --admin-port) name it "admin" on the headless Service."""
    endpoint = {"addresses": ["10.1.0.5"], "targetRef": {"name": "lmq-broker-0"}}
    for ports in (
        [{"name": "grpc", "port": 8081}, {"name": "admin", "port": 8082}, {"name": "metrics", "port": 9100}],
        [{"name": "metrics", "port": 9100}, {"name": "admin", "port": 8082}, {"name": "grpc", "port": 8081}],
    ):
        found = slices.brokers([{"ports": ports, "endpoints": [endpoint]}], default_port=8081)
        assert found == [(model.Broker("lmq-broker-0", "10.1.0.5:8082", 0), True)]


def test_a_resync_after_a_create_writes_nothing() -> None:
    """The create's status already says what the first resync observes on a fresh copy (zero figures), so
    10,000 new resources do not cost 10,000 status writes a resync interval later."""
    created = [
        model.BrokerSync(B0, True, "missing"),
        model.BrokerSync(B1, False, "", model.Failure.UNAVAILABLE, "down"),
    ]
    first = status.applied(model.Kind.LITE_GROUP, "g", generation=1, syncs=created, previous={}, now=NOW)
    assert first["brokers"][0] == {
        "name": "b0",
        "endpoint": "10.0.0.1:8081",
        "synced": True,
        "subscriptionCount": 0,
        "clientCount": 0,
        "lag": 0,
    }
    assert set(first["brokers"][1]) == {"name", "endpoint", "synced", "message"}  # no figures for a broker not asked
    observed = (("subscriptionCount", 0), ("clientCount", 0), ("lag", 0))
    resynced = [model.BrokerSync(B0, True, "none", figures=observed), created[1]]
    later = status.applied(model.Kind.LITE_GROUP, "g", generation=1, syncs=resynced, previous=first, now=NOW)
    assert status.changes(first, later) == {}


def test_a_delete_handler_run_again_for_the_same_object_calls_no_broker_and_posts_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf can hand a stale event (one from before its finalizer-removal patch) to the delete handler again:
    the second run must neither repeat the broker deletes nor post a second "Deleted" Event."""
    removals: list[str] = []
    posted: list[str] = []

    async def remove(pool: Any, fleet: Any, kind: Any, body: Any, claims: Any, *, now: Any) -> apply.Outcome:
        removals.append(body["metadata"]["uid"])
        return apply.Outcome({}, (apply.Event("Normal", "Deleted", "deleted on 2 brokers"),))

    monkeypatch.setattr(apply, "remove", remove)
    monkeypatch.setattr(handlers, "_post", lambda body, events: posted.extend(e.reason for e in events))
    conf = settings.from_env({"LMQ_OPERATOR_BROKERS": "b0:8081"})
    ctx = handlers.Context(conf=conf, pool=Any, fleet=Any, statuses=Any)  # type: ignore[arg-type]
    ctx.indices = {f"{kind.plural}_claims": {} for kind in model.Kind}
    memo = types.SimpleNamespace(lmq=ctx)
    gone = {"metadata": {"uid": "u-1", "name": "q"}}
    other = {"metadata": {"uid": "u-2", "name": "q"}}  # same name, new object: its own deletion
    for body in (gone, gone, other):
        asyncio.run(handlers._delete(model.Kind.LITE_QUOTA, body, memo))
    assert removals == ["u-1", "u-2"]
    assert posted == ["Deleted", "Deleted"]


def test_a_create_retried_before_its_status_arrived_adopts_nothing_it_placed_itself() -> None:
    """A retry of a create may read a body without the status its last attempt wrote (that write's watch event
    comes later): the brokers the operator remembers placing it on are its own, not adopted; any other broker
    that already held the object is."""
    b0, b1, b2 = (model.Broker(f"b{i}", f"10.0.0.{i}:8081", i) for i in range(3))
    syncs = [
        model.BrokerSync(b0, True, diff.Change.NONE.value),  # put there by the last attempt
        model.BrokerSync(b1, True, diff.Change.MISSING.value),  # the broker that came up since
        model.BrokerSync(b2, True, diff.Change.NONE.value),  # held it before this create
    ]
    stale_body: dict[str, Any] = {}
    remembered = apply._write_events("create", syncs, stale_body, frozenset({"b0"}))
    assert remembered == {"Created": ["b1 (was missing)"], "Adopted": ["b2 (already identical)"]}
    forgotten = apply._write_events("create", syncs, stale_body)
    assert forgotten["Adopted"] == ["b0 (already identical)", "b2 (already identical)"]


def test_a_create_retried_after_a_write_whose_answer_was_lost_adopts_nothing_it_wrote_itself() -> None:
    """Brokers an earlier attempt wrote to without an answer (``Outcome.unanswered``): found identical, that is
    the operator's own write (no Event); found missing, created now; a broker nothing was sent to that holds it
    already is adopted (the flow on a broker that times out: test_flows_kmock.py)."""
    b0, b1, b2 = (model.Broker(f"b{i}", f"10.0.0.{i}:8081", i) for i in range(3))
    retry = [
        model.BrokerSync(b0, True, diff.Change.NONE.value),  # the timed-out put had been applied
        model.BrokerSync(b1, True, diff.Change.MISSING.value),  # that one had not
        model.BrokerSync(b2, True, diff.Change.NONE.value),  # held it before this create: adopted
    ]
    events = apply._write_events("create", retry, {}, frozenset(), frozenset({"b0", "b1"}))
    assert events == {"Created": ["b1 (was missing)"], "Adopted": ["b2 (already identical)"]}
    assert apply._write_events("create", retry, {})["Adopted"] == ["b0 (already identical)", "b2 (already identical)"]


def test_a_resync_that_writes_the_first_copies_creates_them() -> None:
    """A resource that never had a copy of its own (it lost a conflict until the owner went, its Secret came
    late): the resync that writes one creates it, it repairs no drift (nor counts one); a copy missing from a
    broker where the status showed one is a repaired drift, as is a broker the status does not list yet."""
    b0, b1 = (model.Broker(f"b{i}", f"10.0.0.{i}:8081", i) for i in range(2))
    missing = [model.BrokerSync(b, True, diff.Change.MISSING.value) for b in (b0, b1)]
    conflict = status.blocked(status.Reason.RESOURCE_CONFLICT, "t/a owns it", generation=1, previous={}, now=NOW)
    assert apply._write_events("timer", missing, conflict) == {"Created": ["b0 (was missing)", "b1 (was missing)"]}
    held = {"brokers": [{"name": "b0", "synced": True}]}
    assert apply._write_events("timer", missing, held) == {"DriftRepaired": ["b0 (was missing)", "b1 (was missing)"]}
    assert apply._write_events("update", missing, conflict) == {"Updated": ["b0 (was missing)", "b1 (was missing)"]}


@pytest.mark.parametrize(
    ("failure", "retried"),
    [(model.Failure.REJECTED, False), (model.Failure.UNAVAILABLE, True), (model.Failure.MISSING_PARENT, True)],
)
def test_a_change_handler_retries_soon_unless_a_broker_refused(
    monkeypatch: pytest.MonkeyPatch, failure: model.Failure, retried: bool
) -> None:
    """A broker's refusal (Stalled: BrokerRejected, e.g. every broker refusing the operator's admin keys) is not
    retried every retry delay, which called every broker and logged an error each time, forever; the resync
    still looks. A broker down or a parent topic not there yet is retried soon."""
    b0 = model.Broker("b0", "b0:8081", 0)
    st = status.applied(
        model.Kind.PARENT_TOPIC,
        "t",
        generation=1,
        syncs=[model.BrokerSync(b0, False, "missing", failure, f"{failure.value}")],
        previous={},
        now=NOW,
    )

    async def reconcile(*_: Any, **__: Any) -> apply.Outcome:
        return apply.Outcome(st, retry=True)

    monkeypatch.setattr(apply, "reconcile", reconcile)
    monkeypatch.setattr(handlers, "_post", lambda body, events: None)
    conf = settings.from_env({"LMQ_OPERATOR_BROKERS": "b0:8081"})
    ctx = handlers.Context(conf=conf, pool=Any, fleet=Any, statuses=Any)  # type: ignore[arg-type]
    ctx.indices = {f"{kind.plural}_claims": {} for kind in model.Kind} | {handlers.WAITING: {}}
    body = {"metadata": {"uid": "u-1", "name": "t", "namespace": "n", "generation": 1}, "spec": {}}
    patch = types.SimpleNamespace(status={})
    memo = types.SimpleNamespace(lmq=ctx)
    run = handlers._reconcile(model.Kind.PARENT_TOPIC, "update", body=body, patch=patch, memo=memo)
    if retried:
        with pytest.raises(kopf.TemporaryError):
            asyncio.run(run)
    else:
        asyncio.run(run)
    assert status.ready_of(patch.status) == status.ready_of(st)  # the status is written either way
