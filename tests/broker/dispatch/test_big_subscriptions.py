"""Big lite subscription changes (a COMPLETE_ADD of 100,000 names) are made in slices that let other calls in,
with the all-or-nothing semantics of a small one: quotas checked before any change, the broker-wide growth
reserved while the slices run, topics being subscribed counted as subscribed, a cancelled call finishing its
change. The registry's steps are driven by hand here (deterministic); the dispatcher and a real broker
process are driven by the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.admin.client import AdminClient
from lmq_broker.dispatch import registry
from lmq_broker.dispatch.registry import Registry
from lmq_broker.dispatch.subscriptions import lmq_name
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite, until
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess, start_broker

BIG = 20_000  # forty slices


def lmqs(prefix: str, n: int = BIG) -> list[str]:
    return [lmq_name(PARENT, f"{prefix}-{i}") for i in range(n)]


def held(reg: Registry, client: str) -> set[str]:
    state = reg.get(client)
    return set() if state is None else set(state.lite_topics)


# --- the registry's steps ----------------------------------------------------------------------------------
def test_a_big_replace_is_made_in_steps_with_the_exact_result() -> None:
    reg = Registry(max_pairs=3 * BIG)
    reg.add("c", lmqs("old"), model.UNLIMITED, 0)
    steps = reg.replace_steps("c", lmqs("new"), model.UNLIMITED, 1)
    seen = [reg.pair_count() for _ in steps]
    assert len(seen) >= 2 * BIG // registry.SLICE  # the old names leave and the new come in slices
    assert any(0 < count < BIG for count in seen)  # the change was visible under way: it yielded
    assert held(reg, "c") == set(lmqs("new"))
    assert reg.pair_count() == BIG
    assert set(reg.subscribed()) == set(lmqs("new"))


def test_a_small_change_never_yields() -> None:
    reg = Registry()
    assert list(reg.replace_steps("c", lmqs("a", registry.SLICE), model.UNLIMITED, 0)) == []
    assert list(reg.add_steps("c", lmqs("b", 10), model.UNLIMITED, 0)) == []
    assert reg.pair_count() == registry.SLICE + 10


def test_a_refused_big_change_changes_nothing_at_any_step() -> None:
    reg = Registry()
    reg.add("c", lmqs("old", 10), model.UNLIMITED, 0)
    steps = reg.replace_steps("c", lmqs("new"), BIG - 1, 1)
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        for _ in steps:
            assert held(reg, "c") == set(lmqs("old", 10))
    assert held(reg, "c") == set(lmqs("old", 10))
    assert reg.pair_count() == 10


def test_broker_wide_growth_is_reserved_while_a_change_runs() -> None:
    reg = Registry(max_pairs=BIG + BIG // 2)
    steps = reg.add_steps("a", lmqs("a"), model.UNLIMITED, 0)
    while reg.pair_count() == 0:  # into the linking slices
        next(steps)
    with pytest.raises(errors.SubscriptionQuotaExceeded):  # room only once a's change is counted in full
        reg.add("b", lmqs("b", BIG // 2 + 1), model.UNLIMITED, 0)
    assert registry.drive(steps) == lmqs("a")
    assert reg.add("b", lmqs("b", BIG // 2), model.UNLIMITED, 0) == lmqs("b", BIG // 2)
    assert reg.pair_count() == reg.max_pairs


def test_topics_being_subscribed_count_as_subscribed() -> None:
    """A compare-and-delete that checks subscribers while a big change runs keeps the topics it subscribes."""
    reg = Registry()
    reg.add("other", [lmqs("a")[0]], model.UNLIMITED, 0)
    steps = reg.add_steps("a", lmqs("a"), model.UNLIMITED, 0)
    next(steps)
    last = lmqs("a")[-1]
    assert last not in held(reg, "a")
    assert reg.subscriber_count(last) == 1
    assert reg.subscriber_count(lmqs("a")[0]) == 2  # the other client, and this change
    registry.drive(steps)
    assert reg.subscriber_count(last) == 1
    assert reg.subscriber_count(lmqs("a")[0]) == 2


def test_a_client_dropped_while_its_change_runs_keeps_nothing() -> None:
    reg = Registry()
    steps = reg.add_steps("a", lmqs("a"), model.UNLIMITED, 0)
    while reg.pair_count() == 0:
        next(steps)
    reg.drop("a")
    registry.drive(steps)
    assert reg.get("a") is None
    assert reg.pair_count() == 0
    assert not reg.subscribed()


# --- the dispatcher, on the event loop -----------------------------------------------------------------------
async def steps_until(condition: Callable[[], bool], limit: int = 100_000) -> None:
    """Loop steps until ``condition`` holds; fail after ``limit`` of them."""
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def sample_pairs(lite: Lite, task: asyncio.Future[Any]) -> list[int]:
    """The broker's subscription count at every loop step until ``task`` is done."""
    seen = []
    while not task.done():
        seen.append(lite.dispatcher.registry.pair_count())
        await asyncio.sleep(0)
    return seen


@pytest.mark.asyncio
async def test_a_big_complete_add_lets_a_send_in_and_subscribes_exactly(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, client_quota=BIG))
    names = [f"big-{i}" for i in range(BIG)]
    big = asyncio.ensure_future(lite.dispatcher.replace_lite("c1", GROUP, PARENT, names))
    sampler = asyncio.ensure_future(sample_pairs(lite, big))
    await steps_until(lambda: lite.dispatcher.registry.pair_count() > 0)  # the change is under way
    await lite.send("probe")
    assert not big.done(), "the send waited for the whole subscription change"
    added, removed = await big
    assert (len(added), removed) == (BIG, [])
    assert any(0 < count < BIG for count in await sampler)
    state = lite.dispatcher.registry.get("c1")
    assert state is not None and state.lite_topics == {lmq_name(PARENT, n) for n in names}


@pytest.mark.asyncio
async def test_a_big_complete_add_over_quota_is_refused_whole(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, client_quota=BIG - 1))
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["kept"])
    big = asyncio.ensure_future(lite.dispatcher.replace_lite("c1", GROUP, PARENT, [f"big-{i}" for i in range(BIG)]))
    sampler = asyncio.ensure_future(sample_pairs(lite, big))
    with pytest.raises(errors.SubscriptionQuotaExceeded):
        await big
    assert set(await sampler) == {1}
    state = lite.dispatcher.registry.get("c1")
    assert state is not None and state.lite_topics == {lmq_name(PARENT, "kept")}


@pytest.mark.asyncio
async def test_a_cancelled_big_complete_add_still_finishes_its_change(lite: Lite) -> None:
    lite.put_group(model.LiteGroup(GROUP, PARENT, client_quota=BIG))
    names = [f"big-{i}" for i in range(BIG)]
    big = asyncio.ensure_future(lite.dispatcher.replace_lite("c1", GROUP, PARENT, names))
    await steps_until(lambda: 0 < lite.dispatcher.registry.pair_count() < BIG)
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    await until(lambda: lite.dispatcher.registry.pair_count() == BIG)
    after = await lite.dispatcher.replace_lite("c1", GROUP, PARENT, ["one"])  # the next change waited for it
    assert len(after[1]) == BIG
    state = lite.dispatcher.registry.get("c1")
    assert state is not None and state.lite_topics == {lmq_name(PARENT, "one")}


# --- a broker process over gRPC ------------------------------------------------------------------------------
HUGE = 100_000
SUBSCRIBER = (("x-mq-client-id", "big-subscriber"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
PROBE = (("x-mq-client-id", "probe-producer"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
OPTIONS = (("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20))


@pytest.fixture
def big_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    broker = start_broker(tmp_path / "data", extra_args=["--no-bootstrap", "--max-subscriptions-per-broker", "300000"])
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(GROUP, PARENT, client_quota=HUGE))
    yield broker
    broker.stop()


def complete_add(names: list[str]) -> spb.SyncLiteSubscriptionRequest:
    return spb.SyncLiteSubscriptionRequest(
        action=pb.COMPLETE_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=names
    )


async def probe_sends(stub: sg.MessagingServiceAsyncStub, big: asyncio.Future[Any]) -> int:
    """One send at a time while ``big`` runs; how many were answered. Their latency is a figure, not a test:
    bench/bench_subscribe_stall.py prints it."""
    answered = 0
    while not big.done():
        message = pb.Message(
            topic=pb.Resource(name=PARENT),
            body=b"probe",
            system_properties=pb.SystemProperties(message_id=f"p{answered}", message_type=pb.LITE, lite_topic="probe"),
        )
        reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=PROBE, timeout=30)
        assert reply.status.code == pb.OK, reply.status
        answered += 1
        await asyncio.sleep(0.01)  # pacing the probes (a load), not a wait for anything
    return answered


@pytest.mark.asyncio
async def test_sends_are_answered_while_another_client_subscribes_100k(big_broker: BrokerProcess) -> None:
    names = [f"agent-{i:06d}" for i in range(HUGE)]
    async with (
        grpc.aio.insecure_channel(big_broker.endpoint, options=OPTIONS) as big_channel,
        grpc.aio.insecure_channel(big_broker.endpoint, options=OPTIONS) as probe_channel,
    ):
        subscriber: sg.MessagingServiceAsyncStub = sg.MessagingServiceStub(big_channel)
        prober: sg.MessagingServiceAsyncStub = sg.MessagingServiceStub(probe_channel)
        await asyncio.gather(big_channel.channel_ready(), probe_channel.channel_ready())
        big = asyncio.ensure_future(
            subscriber.SyncLiteSubscription(complete_add(names), metadata=SUBSCRIBER, timeout=120)
        )
        answered = await probe_sends(prober, big)
        reply = await big
        assert reply.status.code == pb.OK, reply.status
        refused = await subscriber.SyncLiteSubscription(complete_add([*names, "one-more"]), metadata=SUBSCRIBER)
        assert refused.status.code == pb.LITE_SUBSCRIPTION_QUOTA_EXCEEDED, refused.status
    # The second probe began after the first was answered, while the big call still ran: sends get in.
    assert answered >= 2, "the big call was over before a second probe"
    with AdminClient(big_broker.admin_endpoint, timeout_s=30, **big_broker.admin_keys) as admin:
        info = admin.get_lite_client("big-subscriber")
    assert info.lite_topics == tuple(names)  # all of them, and nothing of the refused change
