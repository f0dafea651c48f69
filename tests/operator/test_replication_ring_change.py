"""A replicated ring grown through the operator (docs/replication.md, *Changing the ring with R > 1*, steps 6-7):
broker processes with --replicas 2 on the real kube-apiserver + etcd, the operator as a process driving their
membership, and the test playing the StatefulSet controller (it starts the pod the operator asks for with the
flags of the operator's ConfigMap and publishes its endpoint, as in ``test_membership.py``).

Scale-up 2 -> 3 pods under two sending clients: one on a topic of slot 0 (its replicas stay (0, 1)) and one on
a topic placed on slot 1 by the ring of 2 that the ring of 3 hashes to slot 2 (it stays on slot 1, whose
replicas move from (1, 0) to (1, 2)). A consumer committed part of the moved topic before. The operator
records the grown ring, raises spec.replicas, tells the brokers and reports ScalingUp until every slot's lease
names only its new-ring replicas; then Steady.

Then scale-down 3 -> 2 (step 6) under the same clients: the operator marks slot 2 leaving; three topics of slot
2, consumed, are sent to again and taken over by their owners in the ring of 2 where they ended; slot 1's new
replica (broker 0) is probed into its set; a slot broker 2 holds is released to a broker that stays; the
operator removes slot 2 once drained and handed over, then lowers spec.replicas. Every acknowledged message is
on both remaining pods (each slot's final replicas), once, in order, with the consumer's commit point; the
sends refused meanwhile are counted per slot. Run twice: with slot 1 held by its owner (no lease moves in the
scale-up), and after a failover gave slot 1 to broker 0, which the ring of 3 does not give slot 1: broker 0
releases it once both new replicas are in its set (step 5), and a new replica takes it; before the scale-down
slot 1 is then given to broker 2 (a forced takeover), which releases it to a broker that stays (step 5).

Then 2 -> 3 again: the operator deletes slot 2's Lease once its pod is gone, pods 0 and 1 restart one at a time,
and pod 2 comes back as slot 2 (its old disk, or a new one after a failover): the removed slot's topics, two of
them taken over idle, stay where they were taken over (sent to, consumed with their commit points kept). And R = 3
by the same code: 3 -> 4 -> 3 pods.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import raw_v2
from steady_sender import Attempt, Sender, ids
from waiting import eventually

from lmq_broker import model
from lmq_broker import testing as broker_testing
from lmq_broker.cluster import membership as mb
from lmq_broker.config import StoreConfig
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports
from lmq_operator import scaling, testing

STS = "lmq-broker"
CONFIGMAP = "lmq-broker-membership"
PREFIX = "ringchg"  # the slot Leases' prefix (the chart's <fullname>)
PARENT, GROUP = "AGENT_TASK_NS", "executor-group"  # the brokers' bootstrap parent and group
LEASE_MS = 1500
CONSUMER = "ring-consumer"
COMMITTED = 5  # messages of the moved topic consumed and acknowledged before the scale-up


class Ring:
    """The broker pods of one test: started as the StatefulSet would, with --replicas ``replicas``."""

    def __init__(self, kube: testing.KubeAPI, namespace: str, tmp_path: Path, pods: int = 3, replicas: int = 2) -> None:
        self.kube, self.namespace, self.tmp_path, self.replicas = kube, namespace, tmp_path, replicas
        self.ip = testing.host_ip()  # EndpointSlices refuse loopback addresses
        self.ports = free_ports("0.0.0.0", pods)
        self.pods = [f"{self.ip}:{port}" for port in self.ports]
        self.token = tmp_path / "token"
        self.token.write_text(kube.token)
        self.brokers: dict[int, broker_testing.BrokerProcess] = {}  # ordinal -> its broker (the latest start)
        self.started: list[broker_testing.BrokerProcess] = []
        self.leases = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, namespace)

    def start(self, ordinal: int, peers: str, history: str = "") -> broker_testing.BrokerProcess:
        flags = ["--host", "0.0.0.0", "--peers", peers, "--advertised-address", self.pods[ordinal]]
        flags += ["--ring-history", history] if history else []
        flags += ["--flush-mode", "sync", "--replicas", str(self.replicas), "--lease-namespace", self.namespace]
        flags += ["--lease-prefix", PREFIX, "--lease-duration-ms", str(LEASE_MS), "--kube-api-server", self.kube.server]
        flags += ["--kube-token-file", str(self.token), "--kube-ca-file", str(self.kube.ca_file)]
        broker = broker_testing.start_broker(
            self.tmp_path / f"pod{ordinal}", self.ports[ordinal], flags, env=broker_testing.SHARED_ADMIN_ENV
        )
        self.brokers[ordinal] = broker
        self.started.append(broker)
        return broker

    def in_sync(self, slot: int) -> tuple[int, ...] | None:
        got = self.leases.get(f"{PREFIX}-slot-{slot}")
        return None if got is None else got.in_sync

    def holder(self, slot: int) -> str:
        got = self.leases.get(f"{PREFIX}-slot-{slot}")
        return "" if got is None else got.holder

    def status(self) -> str:
        sts = self.kube.get(f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{STS}")
        return str((sts["metadata"].get("annotations") or {}).get(scaling.ANNOTATION_STATUS, ""))

    def spec_replicas(self) -> int:
        return int(self.kube.get(f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{STS}")["spec"]["replicas"])

    def want(self, pods: int) -> None:
        path = f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{STS}"
        self.kube.merge_patch(path, {"metadata": {"annotations": {scaling.ANNOTATION_REPLICAS: str(pods)}}})

    def stored(self, ordinal: int, lite: str) -> tuple[list[tuple[int, str, int]], int | None]:
        """(offset, message id, recorded slot) of every record of ``lite`` in pod ``ordinal``'s store, and the
        group's commit point there (the pod stopped)."""
        store = lmq_store.LmqStore(StoreConfig(data_dir=self.tmp_path / f"pod{ordinal}"))
        try:
            queue = model.QueueId.lmq(PARENT, lite)
            records = [(m.offset, m.message_id, m.slot) for m in store.read(queue, 0, 100_000)]
            return records, store.get_offset(queue, GROUP)
        finally:
            store.close()

    def stop(self) -> None:
        for broker in self.started:
            if broker.alive():
                broker.stop()
            if broker.process.stdout is not None:
                broker.process.stdout.close()


async def _subscribe(endpoint: str, lite: str, client: str = CONSUMER) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        request = spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[lite]
        )
        subscribed = await stub.SyncLiteSubscription(request, metadata=raw_v2.headers(client))
        assert subscribed.status.code == pb.OK, subscribed.status


async def _consume(endpoint: str, lite: str, count: int, client: str = CONSUMER) -> list[str]:
    """Receive and acknowledge ``count`` messages of ``lite`` for ``GROUP`` (subscribed), in order."""
    headers = raw_v2.headers(client)
    got: list[str] = []
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = service_grpc.MessagingServiceStub(channel)
        deadline = time.monotonic() + 60
        while len(got) < count and time.monotonic() < deadline:
            receive = spb.ReceiveMessageRequest(
                group=pb.Resource(name=GROUP),
                message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)),
                batch_size=count - len(got),
            )
            receive.invisible_duration.seconds = 60
            receive.long_polling_timeout.seconds = 5
            frames = [f async for f in stub.ReceiveMessage(receive, metadata=headers, timeout=30)]
            for frame in frames:
                if not frame.HasField("message"):
                    continue
                props = frame.message.system_properties
                entry = spb.AckMessageEntry(
                    message_id=props.message_id, receipt_handle=props.receipt_handle, lite_topic=lite
                )
                ack = spb.AckMessageRequest(
                    group=pb.Resource(name=GROUP), topic=pb.Resource(name=PARENT), entries=[entry]
                )
                acked = await stub.AckMessage(ack, metadata=headers)
                assert acked.status.code == pb.OK, acked.status
                got.append(props.message_id)
    return got


def _send(endpoint: str, lite: str, message_id: str) -> int:
    async def run() -> int:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite)
            message = pb.Message(topic=pb.Resource(name=PARENT), body=b"0", system_properties=props)
            stub = service_grpc.MessagingServiceStub(channel)
            reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=raw_v2.headers("s"))
            return int(reply.status.code)

    return asyncio.run(run())


def _lite(condition: Callable[[str], bool], stem: str) -> str:
    return next(
        name for name in (f"{stem}-{i}" for i in range(100_000)) if condition(model.QueueId.lmq(PARENT, name).topic)
    )


def _refused(attempts: list[Attempt], start: float, end: float) -> list[Attempt]:
    return [a for a in attempts if not a.ok and start <= a.start <= end]


def _forced(ring: Ring, slot: int, holder: str) -> bool:
    """A forced takeover of ``slot``'s lease by ``holder`` (as a person makes one); False when its holder wrote it
    meanwhile (the write is made on the version read)."""
    lease = ring.leases.get(f"{PREFIX}-slot-{slot}")
    assert lease is not None
    try:
        ring.leases.write(lease, holder, lease.transitions + 1, 60)
    except kube_api.Conflict:
        return False
    return True


def _leaves_to(before: mb.Membership, after: mb.Membership, owner: int, topic: str) -> bool:
    """Whether ``topic`` is on slot 2 in ``before`` and on ``owner`` in ``after`` (a topic of the leaving slot)."""
    return mb.owner(before, topic) == 2 and mb.owner(after, topic) == owner


def _sent_until_acknowledged(endpoint: str, lite: str, stem: str) -> str:
    """Send a message of ``lite`` until one is acknowledged, a new id each attempt (a refused one may be stored):
    the acknowledged id, ``<stem>-<attempts refused before it>``."""
    deadline = time.monotonic() + 60
    for attempt in itertools.count():
        message_id = f"{stem}-{attempt}"
        if _send(endpoint, lite, message_id) == pb.OK:
            return message_id
        assert time.monotonic() < deadline, f"{lite}: no send acknowledged in 60 s"
        time.sleep(0.05)
    raise AssertionError("unreachable")


def _scaled_up(ring: Ring, pods: int, history: str, *, again: bool = False) -> float:
    """``lmq.io/replicas`` ``pods``: once the operator raised spec.replicas, the new pod started with the flags of
    its ConfigMap and its endpoint published, as the StatefulSet would (``again``: a pod that was there before);
    when it started."""
    ring.want(pods)
    eventually(lambda: ring.spec_replicas() == pods, f"spec.replicas {pods}")
    flags = ring.kube.get(f"/api/v1/namespaces/{ring.namespace}/configmaps/{CONFIGMAP}")["data"]
    assert flags == {"LMQ_PEERS": ",".join(ring.pods[:pods]), "LMQ_RING_HISTORY": history}
    began, ordinal = time.monotonic(), pods - 1
    ring.start(ordinal, flags["LMQ_PEERS"], flags["LMQ_RING_HISTORY"])
    if again:
        testing.set_broker_endpoint(ring.kube, ring.namespace, STS, ordinal, ring.ip)
    else:
        testing.add_broker_pod(ring.kube, ring.namespace, STS, ordinal, (ring.ip, ring.ports[ordinal]))
    return began


def _holding(ring: Ring, slot: int) -> int:
    """The ring slot (pod) of the broker holding ``slot``'s lease."""
    return int(eventually(lambda: ring.holder(slot), f"slot {slot} held").removeprefix("slot-").split("/")[0])


def _in_sync_everywhere(broker: broker_testing.BrokerProcess) -> bool:
    return all(raw_v2.metric(broker, "lmq_replication_in_sync", slot=str(s)) == 1 for s in (0, 1))


def _steady(ring: Ring, what: str, timeout_s: float = 60) -> None:
    try:
        eventually(lambda: ring.status().startswith("Steady"), what, timeout_s=timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the operator's status: {ring.status()}") from None


def _held_once_in_order(records: list[tuple[int, str, int]], acked: list[str], slot: int) -> None:
    stored = [message_id for _, message_id, _ in records]
    assert all(stored.count(i) == 1 for i in acked), "an acknowledged message stored twice or not at all"
    assert [i for i in stored if i in set(acked)] == acked, "acknowledged messages out of order"
    assert {recorded for _, _, recorded in records} == {slot}


@pytest.mark.parametrize("failover_first", [False, True], ids=["held-by-its-owner", "after-a-failover"])
def test_a_replicated_ring_grows_and_shrinks_through_the_operator_under_sends(  # noqa: PLR0912, PLR0915 (one scenario)
    *,
    failover_first: bool,
    kube: testing.KubeAPI,
    namespace: str,
    run_operator: Callable[..., testing.OperatorProcess],
    tmp_path: Path,
) -> None:
    ring = Ring(kube, namespace, tmp_path)
    pods = ring.pods
    two = mb.Membership(tuple(pods[:2]), (2,))
    three = two.grown(pods[2])
    moved = _lite(lambda t: mb.owner(two, t) == 1 and mb.candidates(three, t) == (2, 1), "moved")
    stays = _lite(lambda t: mb.owner(two, t) == 0 and mb.owner(three, t) == 0, "stays")
    fresh = _lite(lambda t: mb.owner(three, t) == 2, "fresh")
    senders: list[Sender] = []
    try:
        for ordinal in (0, 1):
            ring.start(ordinal, ",".join(pods[:2]))
        testing.publish_brokers(kube, namespace, STS, [(ring.ip, p) for p in ring.ports[:2]], replicas=2)
        ring.want(2)
        env = testing.scaling_env(namespace, STS, CONFIGMAP, pods)
        run_operator(namespace, None, **env, LMQ_OPERATOR_BROKER_REPLICATION="2", LMQ_OPERATOR_SLOT_LEASE_PREFIX=PREFIX)
        eventually(lambda: ring.status().startswith("Steady"), "Steady at 2 pods (every slot's lease named its set)")
        assert (ring.in_sync(0), ring.in_sync(1)) == ((0, 1), (0, 1))

        # ---- a consumer commits part of the moved topic; then two clients send, one message at a time
        asyncio.run(_subscribe(pods[1], moved))
        for n in range(COMMITTED + 3):
            assert _send(pods[1], moved, f"c-{n}") == pb.OK
        consumed = asyncio.run(_consume(pods[1], moved, COMMITTED))
        assert consumed == [f"c-{n}" for n in range(COMMITTED)]
        senders = [
            Sender(tmp_path / f"{lite}.jsonl", lite, stem, pods[:2], timeout_s=10.0)
            for lite, stem in ((moved, "m"), (stays, "s"))
        ]
        eventually(lambda: all(len(s.acked()) >= 5 for s in senders), "both clients acknowledged")
        if failover_first:  # slot 1 held by broker 0, which the ring of 3 does not give slot 1: it hands it over
            ring.brokers[1].kill()
            eventually(lambda: ring.holder(1).startswith("slot-0/"), "broker 0 took slot 1 over", timeout_s=30)
            ring.start(1, ",".join(pods[:2]))  # back on its disk: a follower of its own slot
            eventually(lambda: ring.in_sync(1) == (0, 1), "broker 1 back in slot 1's set", timeout_s=60)

        # ---- scale-up 2 -> 3: the operator raises spec.replicas; the test starts the pod with the ConfigMap's flags
        began = _scaled_up(ring, 3, "2")
        eventually(lambda: ring.in_sync(1) == (1, 2), "slot 1's set moved to its new replicas", timeout_s=120)
        moved_s = time.monotonic() - began
        eventually(lambda: ring.status().startswith("Steady"), "Steady at 3 pods", timeout_s=60)
        steady = time.monotonic()
        assert "ring sizes [2, 3]" in ring.status()
        assert (ring.in_sync(0), ring.in_sync(2)) == ((0, 1), (0, 2))
        holder = int(ring.holder(1).removeprefix("slot-").split("/")[0])
        assert holder == 1 or (failover_first and holder == 2)  # no lease moved, or broker 0 released it
        count = len(senders[0].acked())
        eventually(lambda: len(senders[0].acked()) >= count + 5, "the moved topic's sends acknowledged after it")
        eventually(lambda: _send(pods[0], fresh, "f-0") == pb.OK, "a new topic of the new slot acknowledged")

        scaled_up = [len(_refused(s.attempts(), began, steady)) for s in senders]
        up_reasons = sorted({r.why[:90] for s in senders for r in _refused(s.attempts(), began, steady)})
        print(
            f"\nscale-up 2 -> 3 at R = 2 ({'after a failover' if failover_first else 'slot 1 held by broker 1'}): "
            f"slot 1's set (1, 2) {moved_s:.2f} s after the new pod started, Steady {steady - began:.2f} s; "
            f"refused during the change {scaled_up}: {up_reasons}; slot 1 held by broker {holder}"
        )

        # ---- scale-down 3 -> 2 (step 6): slot 2 marked leaving, its topics drained to their owners in the ring of
        # 2, which take them over where they end; slot 1's new replica (broker 0) probed in; a slot broker 2 holds
        # released to a broker that stays; slot 2 removed once drained and handed over; then spec.replicas 2
        leaving = [fresh, *(_lite(functools.partial(_leaves_to, three, two, o), "l") for o in (0, 1))]
        idle = [_lite(functools.partial(_leaves_to, three, two, o), "i") for o in (0, 1)]  # no send until regrown
        before = {lite: ["f-0" if lite == fresh else f"{lite}-0", f"{lite}-1", f"{lite}-2"] for lite in leaving + idle}
        for lite in leaving + idle:  # consumed at slot 2's holder: drained
            asyncio.run(_subscribe(pods[2], lite, f"drain-{lite}"))
            for message_id in before[lite][1 if lite == fresh else 0 :]:
                assert _send(pods[0], lite, message_id) == pb.OK
            assert asyncio.run(_consume(pods[2], lite, 3, f"drain-{lite}")) == before[lite]
        if failover_first:  # slot 1 given to broker 2 (a forced takeover): the scale-down must hand it over
            eventually(lambda: _forced(ring, 1, ring.holder(2)), "slot 1's lease written to broker 2")
            eventually(lambda: ring.in_sync(1) == (1, 2) and ring.holder(1) == ring.holder(2), "broker 2 holds slot 1")
        ring.want(2)
        eventually(lambda: ring.status().startswith("Draining"), "slot 2 marked leaving")
        marked = time.monotonic()
        after: dict[str, list[str]] = {}
        for lite in leaving:
            after[lite] = []
            for n in range(3):
                after[lite].append(_sent_until_acknowledged(pods[n % 2], lite, f"{lite}-after-{n}"))
        eventually(lambda: ring.spec_replicas() == 2, "slot 2 removed, then spec.replicas 2", timeout_s=120)
        shed = time.monotonic()
        taken = ring.holder(1)  # broker 2 released slot 1 (if it held it) to a broker that stays
        assert ring.in_sync(0) == (0, 1) and set(ring.in_sync(1) or ()) >= {0, 1}
        assert ring.holder(0).startswith("slot-0/") and ring.holder(1).split("/")[0] in ("slot-0", "slot-1")
        ring.brokers[2].stop()  # the StatefulSet controller's part: the pod and its endpoint go
        testing.set_broker_endpoint(kube, namespace, STS, 2, None)
        eventually(lambda: ring.status().startswith("Steady"), "Steady at 2 pods", timeout_s=60)
        assert "ring sizes [2]" in ring.status() and ring.in_sync(1) == (0, 1)
        count = len(senders[0].acked())
        eventually(lambda: len(senders[0].acked()) >= count + 5, "the moved topic's sends acknowledged after it")
        # the operator deletes the removed slot's Lease once its pod is gone (never a live slot's)
        eventually(lambda: ring.leases.get(f"{PREFIX}-slot-2") is None, "slot 2's Lease deleted", timeout_s=30)
        assert all(ring.leases.get(f"{PREFIX}-slot-{s}") is not None for s in (0, 1))
        down = {slot: len(_refused(s.attempts(), marked, shed)) for slot, s in zip((1, 0), senders, strict=True)}
        down[2] = sum(int(i.rsplit("-", 1)[1]) for ids_ in after.values() for i in ids_)
        down_reasons = sorted({r.why[:90] for s in senders for r in _refused(s.attempts(), marked, shed)})
        print(
            f"scale-down 3 -> 2 at R = 2: slot 2 removed and spec.replicas 2 {shed - marked:.2f} s after it was "
            f"marked leaving; sends refused per slot meanwhile {down} (slot 2: its three topics' handed-over "
            f"sends): {down_reasons}; slot 1 then held by {taken.split('/')[0]}"
        )

        # ---- a rolling restart of both pods (an upgrade, say): what a broker remembers of the take-overs goes
        for ordinal in (0, 1):
            ring.brokers[ordinal].stop()
            restarted = ring.start(ordinal, ",".join(pods[:2]))
            eventually(
                functools.partial(_in_sync_everywhere, restarted),
                f"pod {ordinal} in sync again after its restart",
                timeout_s=60,
                ignoring=(OSError, ValueError),
            )
        counts = [len(s.acked()) for s in senders]
        eventually(lambda: all(len(s.acked()) >= n + 5 for s, n in zip(senders, counts, strict=True)), "sends go on")

        # ---- scale-up 2 -> 3 again: pod 2 comes back as slot 2 (on its old disk, as a retained PVC gives it, or
        # on a new one); the topics of the removed slot 2 stay where they were taken over, idle ones included
        if failover_first:  # a new disk this time
            (tmp_path / "pod2").rename(tmp_path / "pod2-removed")
        regrown = _scaled_up(ring, 3, "2", again=True)
        _steady(ring, "Steady at 3 pods again", timeout_s=120)
        steady = time.monotonic()
        assert "ring sizes [2, 3]" in ring.status()
        assert (ring.in_sync(0), ring.in_sync(1)) == ((0, 1), (1, 2))
        eventually(lambda: ring.in_sync(2) == (0, 2), "slot 2's set (2, 0)", timeout_s=60)
        again: dict[str, list[str]] = {}
        for lite in leaving + idle:  # sent to through pods 0, 1 and 2; the idle ones consumed where they went
            again[lite] = [_sent_until_acknowledged(pods[n], lite, f"{lite}-again-{n}") for n in range(3)]
        for lite in idle:
            went = mb.owner(two, model.QueueId.lmq(PARENT, lite).topic)
            at = pods[_holding(ring, went)]  # received where the slot it went to is held
            asyncio.run(_subscribe(at, lite, f"drain-{lite}"))
            assert asyncio.run(_consume(at, lite, 3, f"drain-{lite}")) == again[lite]  # its commit point kept
        fresh2 = _lite(lambda t: mb.owner(three, t) == 2, "fresh2")
        assert _sent_until_acknowledged(pods[1], fresh2, "g") == "g-0"
        count = len(senders[0].acked())
        eventually(lambda: len(senders[0].acked()) >= count + 5, "the moved topic's sends acknowledged after it")
        attempts = [s.stop() for s in senders]
        acked = [ids(a) for a in attempts]
        up = {slot: len(_refused(a, regrown, steady)) for slot, a in zip((1, 0), attempts, strict=True)}
        up[2] = sum(int(i.rsplit("-", 1)[1]) for ids_ in again.values() for i in ids_)
        up_reasons = sorted({r.why[:90] for run in attempts for r in _refused(run, regrown, time.monotonic())})
        print(
            f"scale-up 2 -> 3 again ({'a new disk' if failover_first else 'its old disk'}): Steady "
            f"{steady - regrown:.2f} s after pod 2 started; refused {up} (slot 2: the removed slot's topics' sends "
            f"after Steady): {up_reasons}; acknowledged {len(acked[0])} (slot 1) and {len(acked[1])} (slot 0) in all"
        )
    finally:
        for sender in senders:
            sender.stop()
        ring.stop()
    first = [f"c-{n}" for n in range(COMMITTED + 3)]
    replicas_of = {0: (0, 1), 1: (1, 2), 2: (2, 0)}  # each slot's final replicas, in the ring of 3
    for ordinal in replicas_of[1]:
        moved_here, committed = ring.stored(ordinal, moved)
        _held_once_in_order(moved_here, first + acked[0], 1)
        assert committed == COMMITTED  # the consumer's commit point, also on slot 1's new replicas
    for ordinal in replicas_of[0]:
        _held_once_in_order(ring.stored(ordinal, stays)[0], acked[1], 0)
    for ordinal in replicas_of[2]:
        assert [i for _, i, _ in ring.stored(ordinal, fresh2)[0]] == ["g-0"]
    for lite in leaving + idle:  # taken over where it ended at slot 2 by its owner in the ring of 2, kept there
        owner = mb.owner(two, model.QueueId.lmq(PARENT, lite).topic)
        for ordinal in replicas_of[owner]:
            records, committed = ring.stored(ordinal, lite)
            stored, want = [i for _, i, _ in records], before[lite] + after.get(lite, []) + again[lite]
            assert [i for i in stored if i in set(want)] == want and all(stored.count(i) == 1 for i in want), lite
            assert [s for _, i, s in records if i in set(before[lite])] == [2, 2, 2]
            assert {s for _, i, s in records if i in set(want) - set(before[lite])} == {owner}, (ordinal, records)
            assert committed is not None and committed >= (6 if lite in idle else 3), (ordinal, lite, committed)


def test_a_ring_at_three_replicas_grows_and_shrinks_through_the_operator_under_sends(
    kube: testing.KubeAPI,
    namespace: str,
    run_operator: Callable[..., testing.OperatorProcess],
    tmp_path: Path,
) -> None:
    """R = 3, the same code as R = 2: 3 -> 4 -> 3 pods under a sending client on a topic placed on slot 0 by the
    ring of 3 that the ring of 4 hashes to slot 3, and one on a topic of slot 1 in both. Every slot's set moves
    to its three replicas in the ring of 4 and back; a consumed topic of slot 3 is taken over idle; slot 3's
    Lease is deleted once its pod is gone; every acknowledged message is on all three remaining pods."""
    ring = Ring(kube, namespace, tmp_path, pods=4, replicas=3)
    pods = ring.pods
    three = mb.Membership(tuple(pods[:3]), (3,))
    four = three.grown(pods[3])
    moved = _lite(lambda t: mb.owner(three, t) == 0 and mb.owner(four, t) == 3, "moved")
    stays = _lite(lambda t: mb.owner(three, t) == 1 and mb.owner(four, t) == 1, "stays")
    idle = _lite(lambda t: mb.owner(four, t) == 3 and mb.owner(three, t) == 2, "idle")
    senders: list[Sender] = []
    try:
        for ordinal in (0, 1, 2):
            ring.start(ordinal, ",".join(pods[:3]))
        testing.publish_brokers(kube, namespace, STS, [(ring.ip, p) for p in ring.ports[:3]], replicas=3)
        ring.want(3)
        env = testing.scaling_env(namespace, STS, CONFIGMAP, pods)
        run_operator(namespace, None, **env, LMQ_OPERATOR_BROKER_REPLICATION="3", LMQ_OPERATOR_SLOT_LEASE_PREFIX=PREFIX)
        _steady(ring, "Steady at 3 pods")
        eventually(lambda: all(ring.in_sync(s) == (0, 1, 2) for s in range(3)), "every slot on its three replicas")
        senders = [
            Sender(tmp_path / f"{lite}.jsonl", lite, stem, pods[:3], timeout_s=10.0)
            for lite, stem in ((moved, "m"), (stays, "s"))
        ]
        eventually(lambda: all(len(s.acked()) >= 5 for s in senders), "both clients acknowledged")

        began = _scaled_up(ring, 4, "3")  # ---- 3 -> 4
        _steady(ring, "Steady at 4 pods", timeout_s=120)
        grown = time.monotonic()
        assert "ring sizes [3, 4]" in ring.status()
        sets = {s: tuple(sorted((s + k) % 4 for k in range(3))) for s in range(4)}
        eventually(
            lambda: all(ring.in_sync(s) == sets[s] for s in range(4)), "every slot on its replicas in the ring of 4"
        )
        asyncio.run(_subscribe(pods[3], idle, "drain-idle"))
        for n in range(3):
            assert _send(pods[0], idle, f"i-{n}") == pb.OK
        assert asyncio.run(_consume(pods[3], idle, 3, "drain-idle")) == [f"i-{n}" for n in range(3)]

        ring.want(3)  # ---- 4 -> 3: slot 3 marked leaving, its topic taken over idle, then removed
        eventually(lambda: ring.spec_replicas() == 3, "slot 3 removed, then spec.replicas 3", timeout_s=120)
        shed = time.monotonic()
        ring.brokers[3].stop()
        testing.set_broker_endpoint(kube, namespace, STS, 3, None)
        _steady(ring, "Steady at 3 pods again")
        assert "ring sizes [3]" in ring.status()
        eventually(
            lambda: all(ring.in_sync(s) == (0, 1, 2) for s in range(3)), "every slot on its three replicas again"
        )
        eventually(lambda: ring.leases.get(f"{PREFIX}-slot-3") is None, "slot 3's Lease deleted", timeout_s=30)
        after = [_sent_until_acknowledged(pods[n], idle, f"i-after-{n}") for n in range(3)]
        at = pods[_holding(ring, 2)]
        asyncio.run(_subscribe(at, idle, "drain-idle"))
        assert asyncio.run(_consume(at, idle, 3, "drain-idle")) == after
        count = len(senders[0].acked())
        eventually(lambda: len(senders[0].acked()) >= count + 5, "the moved topic's sends acknowledged after it")
        attempts = [s.stop() for s in senders]
        acked = [ids(a) for a in attempts]
        refused = [len(_refused(a, began, shed)) for a in attempts]
        reasons = sorted({r.why[:90] for run in attempts for r in _refused(run, began, shed)})
        print(
            f"\nR = 3, 3 -> 4 -> 3 pods: Steady at 4 {grown - began:.2f} s after the new pod started, slot 3 removed "
            f"{shed - grown:.2f} s after that; refused during the changes {refused} (slot 0, slot 1): {reasons}; "
            f"acknowledged {len(acked[0])} and {len(acked[1])}"
        )
    finally:
        for sender in senders:
            sender.stop()
        ring.stop()
    for ordinal in (0, 1, 2):  # each slot's replicas in the ring of 3: every pod
        _held_once_in_order(ring.stored(ordinal, moved)[0], acked[0], 0)
        _held_once_in_order(ring.stored(ordinal, stays)[0], acked[1], 1)
        records, committed = ring.stored(ordinal, idle)
        assert [i for _, i, _ in records] == [f"i-{n}" for n in range(3)] + after
        assert [s for _, _, s in records] == [3, 3, 3, 2, 2, 2] and committed == 6, (ordinal, records, committed)
