"""The membership decisions of the operator (``scaling.decide``), pass by pass, on plain values: scale-up,
scale-down held until drained, a hand-made change of spec.replicas, several processes per pod."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from lmq_broker.admin.results import ClusterInfo
from lmq_broker.cluster import membership as mb
from lmq_operator import model, scaler, scaling, settings, slices
from lmq_operator.scaling import Phase

PODS = [f"b-{i}.h:8081" for i in range(5)]


def pod(ordinal: int) -> str:
    return PODS[ordinal]


def ring(pods: int, *history: int, size: int | None = None, processes: int = 1) -> mb.Membership:
    members = scaling.members_of(PODS[:pods], processes)
    return mb.Membership(members, (*history, size if size is not None else len(members)))


def views(target: mb.Membership, slots: int | None = None, epoch: int = 0) -> dict[int, scaling.View | None]:
    count = len(target.members) if slots is None else slots
    return {s: scaling.View(target, s if s < len(target.members) else -1, epoch) for s in range(count)}


def observed(
    target: mb.Membership | None,
    *,
    wanted: int | None,
    replicas: int,
    seen: Mapping[int, scaling.View | None],
    undrained: Mapping[int, int | None] | None = None,
    processes: int = 1,
    epoch: int | None = None,
) -> scaling.Observed:
    return scaling.Observed(wanted, replicas, processes, target, seen, undrained or {}, pod, epoch)


def test_first_pass_records_what_the_brokers_agree_on_and_the_flags_pods_start_with() -> None:
    two = ring(2)
    d = scaling.decide(observed(None, wanted=2, replicas=2, seen=views(two)))
    assert (d.phase, d.target, d.tell, d.replicas) == (Phase.STEADY, two, (), None)
    assert d.env == {"LMQ_PEERS": "b-0.h:8081,b-1.h:8081", "LMQ_RING_HISTORY": ""}


def test_first_pass_with_brokers_that_disagree_is_stalled() -> None:
    two, three = ring(2), ring(3, 2)
    seen = {0: scaling.View(two, 0), 1: scaling.View(three, 1)}
    d = scaling.decide(observed(None, wanted=2, replicas=2, seen=seen))
    assert d.phase is Phase.STALLED
    assert "disagree" in d.message and d.target is None and d.replicas is None


def test_first_pass_with_members_that_are_not_the_pods_is_stalled() -> None:
    other = mb.Membership(("10.0.0.1:8081", "10.0.0.2:8081"), (2,))
    d = scaling.decide(observed(None, wanted=2, replicas=2, seen=views(other)))
    assert d.phase is Phase.STALLED and "--advertised-address" in d.message


def test_scale_up_records_the_grown_ring_then_waits_then_tells_joining_brokers_first() -> None:
    two = ring(2)
    d = scaling.decide(observed(two, wanted=3, replicas=2, seen=views(two)))
    three = ring(3, 2)
    assert (d.phase, d.target, d.replicas, d.tell) == (Phase.SCALING_UP, three, 3, ())
    assert d.env == {"LMQ_PEERS": "b-0.h:8081,b-1.h:8081,b-2.h:8081", "LMQ_RING_HISTORY": "2"}
    # pod 2 is starting: nobody is told yet
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen={**views(two), 2: None}))
    assert (d.phase, d.tell, d.target, d.replicas) == (Phase.WAITING, (), None, None)
    # pod 2 answers (its flags gave it the grown ring); the two old brokers are told, once pod 2 holds everything
    seen = {**views(two), 2: scaling.View(three, 2)}
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=seen))
    assert (d.phase, d.tell, d.prepare) == (Phase.CONVERGING, (0, 1), (2,))
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=views(three)))
    assert (d.phase, d.tell, d.replicas, d.target) == (Phase.STEADY, (), None, None)
    assert d.env == {"LMQ_PEERS": "b-0.h:8081,b-1.h:8081,b-2.h:8081", "LMQ_RING_HISTORY": "2"}


def test_a_joining_broker_started_without_the_grown_ring_is_told_first() -> None:
    two, three = ring(2), ring(3, 2)
    seen = {**views(two), 2: scaling.View(mb.Membership((PODS[2],), (1,)), 0)}
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=seen))
    assert d.tell == (2, 0, 1) and d.prepare == (2,)


def test_scale_down_marks_leaving_first_holds_until_drained_then_removes_and_lowers_replicas() -> None:
    three = ring(3, 2)
    d = scaling.decide(observed(three, wanted=2, replicas=3, seen=views(three)))
    leaving = ring(3, 2, 3, size=2)
    assert (d.phase, d.target, d.tell, d.replicas) == (Phase.DRAINING, leaving, (2, 0, 1), None)
    assert d.event and "3 → 2" in d.event
    assert d.prepare == ()  # nobody learns a new member
    # flags cannot say "leaving": starting pods keep the flags they had
    assert d.env is None
    d = scaling.decide(observed(leaving, wanted=2, replicas=3, seen=views(leaving), undrained={2: 7}))
    assert (d.phase, d.tell, d.replicas, d.target) == (Phase.DRAINING, (), None, None)
    assert "b-2.h:8081: 7 undrained messages" in d.message
    d = scaling.decide(observed(leaving, wanted=2, replicas=3, seen=views(leaving), undrained={2: None}))
    assert (d.phase, d.replicas) == (Phase.DRAINING, None) and "cannot be asked" in d.message
    d = scaling.decide(observed(leaving, wanted=2, replicas=3, seen=views(leaving), undrained={2: 0}))
    two = mb.Membership(tuple(PODS[:2]), (2,))  # (2, 3, 2) capped at 2 members: (2,)
    assert (d.phase, d.target, d.tell, d.replicas) == (Phase.SCALED_DOWN, two, (0, 1, 2), 2)
    assert d.env == {"LMQ_PEERS": "b-0.h:8081,b-1.h:8081", "LMQ_RING_HISTORY": ""}
    assert d.warning is None
    # the removed pod is gone: steady
    d = scaling.decide(observed(two, wanted=2, replicas=2, seen=views(two)))
    assert (d.phase, d.tell, d.replicas) == (Phase.STEADY, (), None)


def test_scale_down_of_a_ring_with_history_keeps_the_older_sizes() -> None:
    four = ring(4, 2, 3)
    leaving = ring(4, 2, 3, 4, size=3)
    d = scaling.decide(observed(leaving, wanted=3, replicas=4, seen=views(leaving), undrained={3: 0}))
    assert d.target == ring(3, 2) and d.replicas == 3
    assert d.env == {"LMQ_PEERS": ",".join(PODS[:3]), "LMQ_RING_HISTORY": "2"}
    assert four.members[:3] == d.target.members


def test_a_new_wish_while_draining_starts_a_new_epoch() -> None:
    leaving = ring(3, 2, 3, size=2)
    d = scaling.decide(observed(leaving, wanted=3, replicas=3, seen=views(leaving), undrained={2: 5}))
    assert (d.phase, d.target) == (Phase.CONVERGING, ring(3, 2, 3, 2, size=3))
    d = scaling.decide(observed(leaving, wanted=1, replicas=3, seen=views(leaving), undrained={2: 5}))
    assert d.target == ring(3, 2, 3, 2, size=1) and d.replicas is None


def test_replicas_lowered_by_hand_are_raised_back_with_a_warning() -> None:
    three = ring(3, 2)
    seen = {**views(three), 2: None}  # kubectl scale --replicas=2: the pod is gone at once
    d = scaling.decide(observed(three, wanted=3, replicas=2, seen=seen))
    assert (d.phase, d.replicas, d.tell) == (Phase.WAITING, 3, ())
    assert d.warning and "spec.replicas was 2" in d.warning and scaling.ANNOTATION_REPLICAS in d.warning


def test_replicas_raised_by_hand_are_lowered_once_every_broker_agrees() -> None:
    two = ring(2)
    d = scaling.decide(observed(two, wanted=2, replicas=4, seen=views(two)))
    assert (d.phase, d.replicas) == (Phase.CONVERGING, 2) and d.warning
    # never while a broker still has to be told (it would ask a stopped peer whether it is drained)
    stale = {**views(two), 2: scaling.View(ring(3, 2, 3, size=2), 2)}
    d = scaling.decide(observed(two, wanted=2, replicas=3, seen=stale))
    assert (d.phase, d.tell, d.replicas) == (Phase.CONVERGING, (2,), None)


def test_a_wanted_count_below_one_is_stalled() -> None:
    two = ring(2)
    d = scaling.decide(observed(two, wanted=0, replicas=2, seen=views(two)))
    assert d.phase is Phase.STALLED and d.replicas is None and d.tell == ()
    leaving = ring(3, 2, 3, size=2)  # also while draining
    d = scaling.decide(observed(leaving, wanted=-1, replicas=3, seen=views(leaving), undrained={2: 0}))
    assert (d.phase, d.target, d.tell, d.replicas) == (Phase.STALLED, None, (), None)


def test_without_a_wanted_count_the_size_stays() -> None:
    two = ring(2)
    d = scaling.decide(observed(two, wanted=None, replicas=2, seen=views(two)))
    assert (d.phase, d.tell, d.replicas) == (Phase.STEADY, (), None)


def test_processes_make_pod_major_slots_on_their_own_ports() -> None:
    assert scaling.members_of(PODS[:2], 2) == ("b-0.h:8082", "b-0.h:8083", "b-1.h:8082", "b-1.h:8083")
    two = ring(2, processes=2)
    d = scaling.decide(observed(two, wanted=3, replicas=2, seen=views(two), processes=2))
    assert d.target is not None and d.target.sizes == (4, 6)
    assert d.target.members[4:] == ("b-2.h:8082", "b-2.h:8083")
    assert d.env == {"LMQ_PEERS": ",".join(PODS[:3]), "LMQ_RING_HISTORY": "4"}
    three = d.target
    d = scaling.decide(observed(three, wanted=2, replicas=3, seen=views(three), processes=2))
    assert d.target == ring(3, 4, 6, size=4, processes=2) and d.tell == (4, 5, 0, 1, 2, 3)
    leaving = d.target
    d = scaling.decide(
        observed(leaving, wanted=2, replicas=3, seen=views(leaving), undrained={4: 0, 5: 3}, processes=2)
    )
    assert d.phase is Phase.DRAINING and "b-2.h:8083: 3 undrained messages" in d.message
    d = scaling.decide(
        observed(leaving, wanted=2, replicas=3, seen=views(leaving), undrained={4: 0, 5: 0}, processes=2)
    )
    assert (d.target, d.replicas) == (ring(2, processes=2), 2)


def test_admin_endpoints_and_pods_from_slices() -> None:
    listed = [
        {
            "ports": [{"name": "grpc", "port": 8081}, {"name": "admin", "port": 8082}],
            "endpoints": [{"addresses": ["10.0.0.7"], "targetRef": {"name": "lmq-broker-1"}}],
        }
    ]
    (pod,) = slices.pods(listed, 8081)
    assert (pod, pod.ordinal) == (slices.Pod("lmq-broker-1", "10.0.0.7", 8081, 8082, True), 1)
    assert pod.admin_endpoints(1) == ("10.0.0.7:8082",)
    assert pod.admin_endpoints(3) == ("10.0.0.7:8082", "10.0.0.7:8083", "10.0.0.7:8084")


def test_settings_of_the_membership() -> None:
    env = {
        "LMQ_OPERATOR_BROKER_SERVICE": "h",
        "LMQ_OPERATOR_BROKER_NAMESPACE": "ns",
        "LMQ_OPERATOR_BROKER_STATEFULSET": "b",
        "LMQ_OPERATOR_BROKER_MEMBERSHIP": "b-membership",
        "LMQ_OPERATOR_BROKER_ADDRESS": "{pod}.h.ns.svc.cluster.local:8081",
        "LMQ_OPERATOR_BROKER_PROCESSES": "2",
    }
    conf = settings.from_env(env)
    assert conf.manages_membership and conf.processes == 2
    assert conf.broker_addresses == ("{pod}.h.ns.svc.cluster.local:8081",)
    with pytest.raises(settings.SettingsError, match="LMQ_OPERATOR_BROKER_ADDRESS"):
        settings.from_env({**env, "LMQ_OPERATOR_BROKER_ADDRESS": ""})
    with pytest.raises(settings.SettingsError, match=r"1\.\.256"):
        settings.from_env({**env, "LMQ_OPERATOR_BROKER_PROCESSES": "0"})
    assert not settings.from_env({**env, "LMQ_OPERATOR_BROKER_MEMBERSHIP": ""}).manages_membership


class _Recorded(scaler.Scaler):
    """The pass's order of writes, with the observation given and the brokers refusing SetCluster or not."""

    def __init__(self, seen: scaling.Observed, refuse: bool) -> None:
        super().__init__(settings.Settings(broker_namespace="ns", broker_statefulset="b"), lambda: None)
        self.seen, self.refuse = seen, refuse
        self.writes: list[str] = []

    async def observe(self) -> tuple[dict[str, object], dict[str, object] | None, scaling.Observed]:
        self._asks = {s: f"10.0.0.{s}:8082" for s in self.seen.views}
        sts = {"metadata": {"name": "b", "uid": "u", "annotations": {}}, "spec": {"replicas": self.seen.replicas}}
        return sts, {"data": {}}, self.seen

    async def _write_configmap(self, *args: object) -> None:
        self.writes.append("configmap")

    async def _patch_sts(self, body: Mapping[str, object]) -> None:
        self.writes.append(f"sts {body}")

    async def _event(self, sts: object, kind: str, reason: str, message: str) -> None:
        self.writes.append(f"{kind} {reason}")

    async def _tell(self, target: mb.Membership, slots: Sequence[int], epoch: int | None = None) -> bool:
        self.writes.append(f"tell {list(slots)}")
        self._failed = "refused"
        return not self.refuse


def test_the_epoch_of_a_new_target_is_one_above_every_broker_and_stays_while_it_is_retried() -> None:
    two, three = ring(2), ring(3, 2)
    # brokers at 4 and 5 (one was told more often): the grown ring gets 6, on every broker
    seen = {0: scaling.View(two, 0, 4), 1: scaling.View(two, 1, 5), 2: scaling.View(three, 2, 1)}
    assert scaling.epoch_for(three, None, seen) == 6
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=seen))
    assert (d.tell, d.epoch) == ((2, 0, 1), 6)  # pod 2 has the members from its flags, not the epoch
    # broker 0 took it, broker 1 refused: the next pass tells broker 1 (and pod 2, still at 1) the same 6
    seen = {0: scaling.View(three, 0, 6), 1: scaling.View(two, 1, 5), 2: scaling.View(three, 2, 1)}
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=seen, epoch=6))
    assert (d.tell, d.epoch) == ((2, 1), 6)
    # the same without the record (an operator restarted after its write was lost): still 6
    assert scaling.epoch_for(three, None, seen) == 6
    # recorded but nobody told yet: the recorded number
    assert scaling.epoch_for(three, 9, views(two, epoch=5)) == 9
    # someone gave a broker other members at the recorded number, or above it: one above theirs
    other = {0: scaling.View(two, 0, 6), 1: scaling.View(three, 1, 6)}
    assert scaling.epoch_for(three, 6, other) == 7
    assert scaling.epoch_for(three, 6, {0: scaling.View(two, 0, 8)}) == 9
    # every broker already at the target's epoch: nothing to tell
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=views(three, epoch=6), epoch=6))
    assert (d.phase, d.tell) == (Phase.STEADY, ())


def test_a_new_ring_while_draining_gets_a_new_epoch() -> None:
    three = ring(3, 2)
    d = scaling.decide(observed(three, wanted=2, replicas=3, seen=views(three, epoch=3), epoch=3))
    assert (d.phase, d.epoch) == (Phase.DRAINING, 4)
    leaving = ring(3, 2, 3, size=2)
    d = scaling.decide(observed(leaving, wanted=2, replicas=3, seen=views(leaving, epoch=4), undrained={2: 0}, epoch=4))
    assert (d.phase, d.epoch) == (Phase.SCALED_DOWN, 5)


def test_brokers_that_do_not_number_memberships_are_not_told_again_for_the_epoch() -> None:
    three = ring(3, 2)
    # brokers older than epochs answer 0: the same members and slot are enough
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=views(three, epoch=0), epoch=1))
    assert (d.phase, d.tell) == (Phase.STEADY, ())
    # brokers that number them: one still at an older epoch is told the target's
    seen = {**views(three, epoch=7), 1: scaling.View(three, 1, 6)}
    d = scaling.decide(observed(three, wanted=3, replicas=3, seen=seen, epoch=7))
    assert (d.phase, d.tell, d.epoch, d.prepare) == (Phase.CONVERGING, (1,), 7, ())


class _Preparing(scaler.Scaler):
    """A pass with joining brokers: the order of preparing, recording and telling, and what a failure does."""

    def __init__(self, seen: scaling.Observed, unprepared: scaling.Unprepared | None) -> None:
        super().__init__(settings.Settings(broker_namespace="ns", broker_statefulset="b"), lambda: None)
        self.seen, self.unprepared = seen, unprepared
        self.writes: list[str] = []

        async def prepare(brokers: Sequence[model.Broker]) -> scaling.Unprepared | None:
            self.writes.append(f"prepare {[(b.name, b.endpoint, b.ordinal) for b in brokers]}")
            return self.unprepared

        self.prepare = prepare

    async def observe(self) -> tuple[dict[str, object], dict[str, object] | None, scaling.Observed]:
        self._asks = {s: f"10.0.0.{s}:8082" for s in self.seen.views}
        sts = {"metadata": {"name": "b", "uid": "u", "annotations": {}}, "spec": {"replicas": self.seen.replicas}}
        return sts, {"data": {}}, self.seen

    async def _write_configmap(self, *args: object) -> None:
        self.writes.append(f"configmap epoch {args[4]}")

    async def _patch_sts(self, body: Mapping[str, object]) -> None:
        self.writes.append(f"sts {body}")

    async def _event(self, sts: object, kind: str, reason: str, message: str) -> None:
        self.writes.append(f"{kind} {reason}: {message}")

    async def _tell(self, target: mb.Membership, slots: Sequence[int], epoch: int | None = None) -> bool:
        self.writes.append(f"tell {list(slots)} epoch {epoch}")
        return True


def _joining() -> scaling.Observed:
    two, three = ring(2), ring(3, 2)
    seen = {0: scaling.View(two, 0, 2), 1: scaling.View(two, 1, 2), 2: scaling.View(three, 2, 1)}
    return observed(three, wanted=3, replicas=3, seen=seen, epoch=None)


def test_joining_brokers_get_every_resource_before_any_broker_is_told() -> None:
    recorded = _Preparing(_joining(), None)
    decision = asyncio.run(recorded.run_once())
    assert decision.phase is Phase.CONVERGING
    assert recorded.writes[:3] == [
        "configmap epoch 3",  # the epoch is recorded before anyone gets it
        "prepare [('b-2', '10.0.0.2:8082', 2)]",
        "tell [2, 0, 1] epoch 3",
    ]


@pytest.mark.parametrize("stalled", [False, True])
def test_a_joining_broker_without_every_resource_holds_the_ring(stalled: bool) -> None:
    why = scaling.Unprepared("ParentTopic 'orders' on b-2: UNAVAILABLE: connection refused", stalled)
    recorded = _Preparing(_joining(), why)
    decision = asyncio.run(recorded.run_once())
    phase = "Stalled" if stalled else "Waiting"
    assert decision.phase.value == phase
    assert not any(w.startswith("tell") for w in recorded.writes)
    status = next(w for w in recorded.writes if w.startswith("sts {'metadata'"))
    assert f"{phase}: the joining brokers (b-2.h:8081) do not hold every resource yet" in status
    assert "ParentTopic 'orders' on b-2" in status
    assert any(w.startswith(f"Warning {phase}: ") for w in recorded.writes)


@pytest.mark.parametrize("refuse", [False, True])
def test_replicas_are_lowered_only_after_every_broker_took_the_smaller_ring(refuse: bool) -> None:
    leaving = ring(3, 2, 3, size=2)
    seen = observed(leaving, wanted=2, replicas=3, seen=views(leaving), undrained={2: 0})
    recorded = _Recorded(seen, refuse)
    decision = asyncio.run(recorded.run_once())
    assert decision.phase is Phase.SCALED_DOWN
    lowered = "sts {'spec': {'replicas': 2}}"
    status = [w for w in recorded.writes if w.startswith("sts {'metadata'")]
    assert recorded.writes[:2] == ["configmap", "tell [0, 1, 2]"]  # the record first, then the brokers
    if refuse:
        assert lowered not in recorded.writes and "Warning SetClusterFailed" in recorded.writes
        assert "refused" in status[0]
    else:
        assert recorded.writes[2:4] == [lowered, "Normal ScaledDown"]


class Counting:
    """A leaving broker's admin as the scaler asks it: its undrained count, each real count taking ``took`` s."""

    def __init__(self, clock: list[float], took: float) -> None:
        self.clock, self.took, self.counts, self.undrained = clock, took, 0, 5

    async def cluster(self, *, with_undrained: bool = False) -> ClusterInfo:
        if with_undrained:
            self.counts += 1
            self.clock[0] += self.took
        members = (pod(0), pod(1))
        return ClusterInfo(members, (2, 1), 1, True, self.undrained if with_undrained else -1, False, "admin")


@pytest.mark.parametrize(("took", "again"), [(0.01, 1.0), (0.5, 5.0), (3.0, 15.0)])
def test_a_leaving_brokers_undrained_count_is_asked_again_after_ten_times_what_it_took(
    took: float, again: float
) -> None:
    """A count that was cheap is asked for again within a second (a drain that ends is seen soon); a dear one
    (a walk over millions of lite topics) no more than every 15 s, so counting costs the broker at most a tenth."""
    clock = [100.0]
    member = scaler.Scaler(settings.from_env({"LMQ_OPERATOR_BROKERS": pod(0)}), lambda: None, clock=lambda: clock[0])
    admin = Counting(clock, took)
    member._admins[pod(1)] = admin  # type: ignore[assignment]
    view = asyncio.run(member._view(pod(1), True))
    assert view[1] == 5 and admin.counts == 1
    clock[0] += again - 0.001
    admin.undrained = 0
    assert asyncio.run(member._view(pod(1), True))[1] == 5 and admin.counts == 1  # the count kept
    clock[0] += 0.002
    assert asyncio.run(member._view(pod(1), True))[1] == 0 and admin.counts == 2  # asked again
