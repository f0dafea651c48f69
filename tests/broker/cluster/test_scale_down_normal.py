"""A scale-down loses and strands none of the leaving broker's NORMAL messages and dead letters (docs/scale-out.md,
*Scale-down*; ``cluster.relocating``): three broker processes with ``--peers``, slot 2 marked leaving over the
admin service; it copies what its groups have not consumed of its NORMAL queues and its dead letters to the
remaining brokers (same ids and properties), counts them undrained until then (so it cannot be removed
before), and a kill -9 in the middle of the copy loses nothing (at least once). Each store read at the end is
the broker's own RocksDB and commit log, opened once its process has stopped."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from raw_v2 import metric
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.cluster import trust
from lmq_broker.cluster.links import ADMIN
from lmq_broker.config import StoreConfig
from lmq_broker.protocol.auth import sign_metadata
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc
from lmq_broker.storage.store import open_store
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

TOPIC = "orders"
GROUP = "billing"
DLQ = f"%DLQ%{GROUP}"
WAIT_S = 60.0


def headers(client_id: str = "c1") -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", client_id), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))


def start(tmp_path: Path, started: list[BrokerProcess], *, with_admin: Path | None = None) -> list[str]:
    ports = free_ports("127.0.0.1", 3)
    members = [f"127.0.0.1:{p}" for p in ports]
    for i, port in enumerate(ports):
        args = ["--peers", ",".join(members), "--ordinal", str(i)]
        started.append(start_broker(tmp_path / f"b{i}", port=port, extra_args=args, env=SHARED_ADMIN_ENV))
    with AdminClient(started[0].endpoint, timeout_s=10, **SHARED_ADMIN_KEYS) as admin:
        admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.NORMAL))  # sent on to every member
    return members


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[BrokerProcess], list[str]]]:
    started: list[BrokerProcess] = []
    try:
        members = start(tmp_path, started)
        yield started, members
    finally:
        for broker in started:
            broker.stop()


def stub(broker: BrokerProcess) -> service_pb2_grpc.MessagingServiceStub:
    return service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(broker.endpoint))


def message(i: int, body_bytes: int = 16) -> pb.Message:
    props = pb.SystemProperties(message_id=f"m{i}", message_type=pb.NORMAL, tag="t", keys=[f"k{i}"])
    props.born_timestamp.FromMilliseconds(1_700_000_000_000 + i)
    return pb.Message(
        topic=pb.Resource(name=TOPIC), body=f"{i}".encode().ljust(body_bytes, b"."), system_properties=props,
        user_properties={"n": str(i)},
    )  # fmt: skip


def send(broker: BrokerProcess, first: int, count: int, per_request: int = 1000) -> None:
    """Messages ``m<first>`` … sent to ``broker`` itself (a producer on a route naming it)."""
    calls = stub(broker)
    for at in range(first, first + count, per_request):
        batch = [message(i) for i in range(at, min(at + per_request, first + count))]
        reply = calls.SendMessage(spb.SendMessageRequest(messages=batch), metadata=headers("p"), timeout=30)
        assert reply.status.code == pb.OK, reply.status


def receive(broker: BrokerProcess, batch: int, group: str = GROUP) -> list[pb.Message]:
    request = spb.ReceiveMessageRequest(
        group=pb.Resource(name=group), message_queue=pb.MessageQueue(topic=pb.Resource(name=TOPIC)),
        batch_size=batch, auto_renew=True,
    )  # fmt: skip
    request.long_polling_timeout.FromMilliseconds(2000)
    frames = stub(broker).ReceiveMessage(request, metadata=headers(), timeout=10)
    return [frame.message for frame in frames if frame.HasField("message")]


def settle(broker: BrokerProcess, got: pb.Message, *, dead: bool, group: str = GROUP) -> None:
    sp, calls = got.system_properties, stub(broker)
    if dead:
        forward = spb.ForwardMessageToDeadLetterQueueRequest(
            group=pb.Resource(name=GROUP), topic=pb.Resource(name=TOPIC), receipt_handle=sp.receipt_handle,
            message_id=sp.message_id, delivery_attempt=1, max_delivery_attempts=16,
        )  # fmt: skip
        assert calls.ForwardMessageToDeadLetterQueue(forward, metadata=headers(), timeout=10).status.code == pb.OK
        return
    entry = spb.AckMessageEntry(message_id=sp.message_id, receipt_handle=sp.receipt_handle)
    request = spb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=TOPIC), entries=[entry])
    assert calls.AckMessage(request, metadata=headers(), timeout=10).status.code == pb.OK


def set_everywhere(cluster: list[BrokerProcess], order: list[int], members: list[str], sizes: tuple[int, ...]) -> None:
    for slot in order:
        with AdminClient(cluster[slot].endpoint, timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
            admin.set_cluster(members, sizes)


def undrained(broker: BrokerProcess) -> tuple[int, bool]:
    with AdminClient(broker.endpoint, timeout_s=30, **SHARED_ADMIN_KEYS) as admin:
        info = admin.cluster(with_undrained=True)
    return info.undrained_messages, info.drained


def stored(broker: BrokerProcess, topic: str) -> list[model.StoredMessage]:
    """Every message of ``topic``'s queue 0 in ``broker``'s store (read with the broker stopped)."""
    assert not broker.alive()
    store = open_store(StoreConfig(data_dir=broker.data_dir))
    try:
        lo, hi = store.queue_offsets(model.QueueId(topic, 0))
        out: list[model.StoredMessage] = []
        while lo < hi:
            found, lo = store.read_span(model.QueueId(topic, 0), lo, 1000)
            out += found
        return out
    finally:
        store.close()


def test_a_leaving_broker_copies_what_groups_have_not_consumed_and_its_dead_letters_before_it_is_removed(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """Ten messages at slot 2; its group acknowledges two and dead-letters two of the first four it receives.
    Marked leaving, slot 2 counts the six unconsumed and the two dead letters undrained (its removal is refused
    meanwhile), copies them to the remaining brokers with their ids, properties, tag, keys and born times, and
    is then drained and removable; the remaining brokers hold every message the group has not consumed."""
    brokers, members = cluster
    send(brokers[2], 0, 10)
    got = receive(brokers[2], 4)
    assert [g.system_properties.message_id for g in got] == ["m0", "m1", "m2", "m3"]
    for i, received in enumerate(got):
        settle(brokers[2], received, dead=i >= 2)
    assert undrained(brokers[2]) == (0, False)  # not leaving: nothing to drain
    set_everywhere(brokers, [2, 0, 1], members, (3, 2))
    late = stub(brokers[2]).SendMessage(spb.SendMessageRequest(messages=[message(10)]), metadata=headers("p"))
    assert late.status.code == pb.INTERNAL_ERROR and "leaving" in late.status.message  # READ: retried elsewhere
    eventually(lambda: undrained(brokers[2]) == (0, True), "slot 2 drained", WAIT_S)
    set_everywhere(brokers, [0, 1, 2], members[:2], (3, 2))  # removed: only once drained
    assert metric(brokers[2], "lmq_relocated_messages_total") == 8
    for broker in brokers:
        broker.stop()
    normal = [m for b in brokers[:2] for m in stored(b, TOPIC)]
    dead = [m for b in brokers[:2] for m in stored(b, DLQ)]
    assert sorted(m.message_id for m in normal) == [f"m{i}" for i in range(4, 10)]
    assert sorted(m.message_id for m in dead) == ["m2", "m3"]
    for m in normal:
        i = int(m.message_id[1:])
        assert (m.body, m.tag, m.keys, m.user_properties, m.born_timestamp_ms) == (
            f"{i}".encode().ljust(16, b"."), "t", (f"k{i}",), {"n": str(i)}, 1_700_000_000_000 + i,
        )  # fmt: skip
    assert {m.user_properties["__ORIGIN_TOPIC"] for m in dead} == {TOPIC}


def test_a_leaving_broker_with_undrained_normal_messages_is_not_removed(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """A topic no remaining broker takes (it is missing there, so both refuse its messages) stays undrained at
    slot 2 and its removal is refused naming the count, rather than stranding it; the copy of another topic,
    after it in the walk, is not held up by it."""
    brokers, members = cluster
    with AdminClient(brokers[2].endpoint, timeout_s=10, here_only=True, **SHARED_ADMIN_KEYS) as admin:
        admin.put_parent_topic(model.ParentTopic("early", model.MessageType.NORMAL))  # on slot 2 only
    props = pb.SystemProperties(message_id="s0", message_type=pb.NORMAL)
    early = pb.Message(topic=pb.Resource(name="early"), body=b"x", system_properties=props)
    reply = stub(brokers[2]).SendMessage(spb.SendMessageRequest(messages=[early]), metadata=headers("p"))
    assert reply.status.code == pb.OK
    send(brokers[2], 0, 3)
    set_everywhere(brokers, [2, 0, 1], members, (3, 2))
    eventually(lambda: undrained(brokers[2]) == (1, False), "orders copied, early not", WAIT_S)
    with pytest.raises(errors.Conflict, match="1 undrained"):
        set_everywhere(brokers, [0], members[:2], (3, 2))
    assert metric(brokers[2], "lmq_relocated_messages_total") == 3
    assert "queues not copied" in brokers[2].log()


def partly(left: int, total: int) -> int | None:
    return left if 0 < left < total else None


def test_a_kill_9_of_the_leaving_broker_while_it_copies_loses_no_message(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """20,000 messages at slot 2, none consumed; killed with -9 while it copies them (some copied, not all),
    started again on its disk: it goes on from where its records say and ends drained. The remaining brokers
    hold every message once: a batch stored there whose answer the kill cut off comes again after the restart,
    and the receiver, which recorded how far it stored slot 2's queue, does not store it again."""
    brokers, members = cluster
    total = 20_000
    send(brokers[2], 0, total)
    set_everywhere(brokers, [2, 0, 1], members, (3, 2))
    at_kill = eventually(lambda: partly(undrained(brokers[2])[0], total), "part copied", WAIT_S, interval_s=0.02)
    brokers[2].kill()
    print(f"killed with {at_kill} of {total} left to copy")
    brokers[2] = brokers[2].restart()
    eventually(lambda: undrained(brokers[2]) == (0, True), "slot 2 drained after its restart", WAIT_S)
    for broker in brokers:
        broker.stop()
    ids = Counter(m.message_id for b in brokers[:2] for m in stored(b, TOPIC))
    assert set(ids) == {f"m{i}" for i in range(total)}
    twice = sum(n - 1 for n in ids.values())
    print(f"{twice} stored twice")
    assert twice == 0  # before the receiver recorded it: the batch the kill cut off (up to 500) twice


def test_a_broker_kept_after_a_cancelled_scale_down_does_not_deliver_what_it_copied_again(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """Slot 2 leaves, its group having consumed the first two of its ten messages; the eight others are copied to
    the remaining brokers, and then the scale-down is cancelled (its ring grows back: the operator's new annotation
    while draining) and slot 2 restarts on its volume (as a pod that comes back on its retained claim). Its group
    goes on at slot 2 after what was copied, not from its commit point: the copies are at slots 0 and 1, where it
    gets them. Before, slot 2 delivered the eight again: every message copied came twice, long after the first was
    acknowledged (found in a red-team review). A message sent to it after the cancel is delivered as usual."""
    brokers, members = cluster
    send(brokers[2], 0, 10)
    for got in receive(brokers[2], 2):
        settle(brokers[2], got, dead=False)
    set_everywhere(brokers, [2, 0, 1], members, (3, 2))
    eventually(lambda: undrained(brokers[2]) == (0, True), "slot 2 copied", WAIT_S)
    set_everywhere(brokers, [0, 1, 2], members, (3, 2, 3))  # cancelled: slot 2 stays
    brokers[2] = brokers[2].restart()
    send(brokers[2], 10, 1)
    assert [g.system_properties.message_id for g in receive(brokers[2], 20)] == ["m10"]
    for broker in brokers:
        broker.stop()
    copied = sorted(m.message_id for b in brokers[:2] for m in stored(b, TOPIC))
    assert copied == [f"m{i}" for i in range(2, 10)]


def test_store_relocated_is_refused_to_any_caller_without_a_valid_peer_header(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """A remaining broker stores what StoreRelocated brings with no quota nor access check, so only a peer may call
    it: signed with the admin pair (every operator tool holds it) but without the peer header, or with a forged
    one, the call is refused PERMISSION_DENIED on the client port (where these brokers serve admin, the native
    edge) and nothing is stored."""
    brokers, _ = cluster
    forged = ("x-lmq-peer", f"1;{int(datetime.now(UTC).timestamp() * 1000)};{'0' * 64}")
    request = admin_pb2.StoreRelocatedRequest(
        messages=[admin_pb2.RelocatedMessage(topic=TOPIC, message_id="injected", body=b"x", message_type=pb.NORMAL)]
    )
    asked = admin_pb2.CommittedGroupsRequest(topics=[TOPIC])
    with grpc.insecure_channel(brokers[0].endpoint) as channel:
        admin = admin_pb2_grpc.LmqAdminStub(channel)
        for extra in ((), (forged,)):
            keys = SHARED_ADMIN_KEYS["access_key"], SHARED_ADMIN_KEYS["secret_key"]
            signed = (*sign_metadata(*keys, datetime.now(UTC)), *extra)
            with pytest.raises(grpc.RpcError) as refused:
                admin.StoreRelocated(request, metadata=signed, timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
            with pytest.raises(grpc.RpcError) as refused:  # nor which groups consume what there
                admin.CommittedGroups(asked, metadata=signed, timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    brokers[0].stop()
    assert stored(brokers[0], TOPIC) == []


def test_a_group_whose_consumer_is_connected_but_consumed_nothing_there_gets_the_copy(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """Slot 2's group consumes all four of its messages; a second group's consumer is connected to slot 2 (its
    Telemetry settings name the topic) but has consumed nothing there yet, so it has no commit point there. Slot 2
    copies all four for it before it counts as drained. Before, the copy went from the first group's end: nothing
    was copied, and the second group lost the four with the removed broker (found in a red-team review)."""
    brokers, members = cluster
    send(brokers[2], 0, 4)
    got = receive(brokers[2], 4)
    assert len(got) == 4
    for received in got:
        settle(brokers[2], received, dead=False)
    stop = threading.Event()

    def commands() -> Iterator[spb.TelemetryCommand]:
        entry = pb.SubscriptionEntry(topic=pb.Resource(name=TOPIC), expression=pb.FilterExpression(expression="*"))
        subscription = pb.Subscription(group=pb.Resource(name="audit"), subscriptions=[entry])
        yield spb.TelemetryCommand(settings=pb.Settings(client_type=pb.SIMPLE_CONSUMER, subscription=subscription))
        stop.wait(WAIT_S)

    with grpc.insecure_channel(brokers[2].endpoint) as channel:
        telemetry = service_pb2_grpc.MessagingServiceStub(channel).Telemetry(commands(), metadata=headers("audit-1"))
        try:
            assert next(iter(telemetry)).HasField("settings")
            set_everywhere(brokers, [2, 0, 1], members, (3, 2))
            eventually(lambda: undrained(brokers[2]) == (0, True), "slot 2 copied for the second group", WAIT_S)
            assert metric(brokers[2], "lmq_relocated_messages_total") == 4
        finally:
            stop.set()


def test_a_group_that_consumed_the_topic_only_at_remaining_brokers_gets_the_copy(
    cluster: tuple[list[BrokerProcess], list[str]],
) -> None:
    """Slot 2's group consumes all four of its messages. A second group consumed the topic at slot 0 only (a
    commit point there) and its consumers are down (none connected to slot 2, which never saw the group): when it
    comes back it starts at slot 2's copies from the first message of each queue, so slot 2 asks the remaining
    brokers (``CommittedGroups``) and copies all four for it before it counts as drained. Before, the copy went
    from the first group's end: nothing was copied and the second group lost the four (residual of a red-team
    review)."""
    brokers, members = cluster
    send(brokers[2], 0, 4)
    for received in receive(brokers[2], 4):
        settle(brokers[2], received, dead=False)
    send(brokers[0], 100, 1)
    (own,) = receive(brokers[0], 1, group="audit")
    settle(brokers[0], own, dead=False, group="audit")
    set_everywhere(brokers, [2, 0, 1], members, (3, 2))
    eventually(lambda: undrained(brokers[2]) == (0, True), "slot 2 copied for the second group", WAIT_S)
    assert metric(brokers[2], "lmq_relocated_messages_total") == 4
    for broker in brokers:
        broker.stop()
    copied = sorted(m.message_id for b in brokers[:2] for m in stored(b, TOPIC))
    assert copied == ["m0", "m1", "m100", "m2", "m3"]


def test_a_retried_store_relocated_batch_is_stored_once(cluster: tuple[list[BrokerProcess], list[str]]) -> None:
    """A leaving broker whose StoreRelocated timed out asks the same broker again; the receiver, which may have
    stored the batch already, stores only what it does not hold of that broker's queue: the same batch twice is
    stored once, one overlapping its end adds its tail, another source's is its own. Before, every retry was
    stored again (residual of a red-team review)."""
    brokers, _ = cluster
    secret = trust.secret_of("", SHARED_ADMIN_ENV["LMQ_ADMIN_SECRET_KEY"])

    def store(source: str, first: int, count: int) -> int:
        wire = [
            admin_pb2.RelocatedMessage(
                topic=TOPIC, message_id=f"{source}-{i}", body=b"x", message_type=pb.NORMAL, source_offset=i
            )
            for i in range(first, first + count)
        ]
        method = ADMIN + "StoreRelocated"
        peer = trust.header(secret, method, 0, int(datetime.now(UTC).timestamp() * 1000))
        keys = SHARED_ADMIN_KEYS["access_key"], SHARED_ADMIN_KEYS["secret_key"]
        with grpc.insecure_channel(brokers[0].endpoint) as channel:
            request = admin_pb2.StoreRelocatedRequest(messages=wire, source=source)
            signed = (*sign_metadata(*keys, datetime.now(UTC)), peer)
            reply = admin_pb2_grpc.LmqAdminStub(channel).StoreRelocated(request, metadata=signed, timeout=10)
        return int(reply.stored)

    assert [store("a:1", 0, 5), store("a:1", 0, 5), store("a:1", 3, 5), store("b:1", 0, 2)] == [5, 0, 3, 2]
    brokers[0].stop()
    ids = Counter(m.message_id for m in stored(brokers[0], TOPIC))
    assert ids == Counter([*(f"a:1-{i}" for i in range(8)), "b:1-0", "b:1-1"])
