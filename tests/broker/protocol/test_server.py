"""The v2 endpoint on a real grpc.aio server (port 0) over LmqStore, driven with our own stubs."""

from __future__ import annotations

import asyncio
import hashlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from waiting import eventually_async

from lmq_broker import app, model
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.protocol.testing import Client
from lmq_broker.storage import index as index_mod
from lmq_broker.storage import store as lmq_store

pytestmark = pytest.mark.asyncio

PARENT = "AGENT_TASK_NS"
GROUP = "executor-group"
H = Client.headers


def resource(name: str) -> pb.Resource:
    return pb.Resource(name=name)


def lite_message(lite: str, body: bytes = b"hello", message_id: str = "0102AA", **sp: Any) -> pb.Message:
    props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite, body_encoding=pb.IDENTITY)
    for key, value in sp.items():
        if isinstance(value, list):
            getattr(props, key).extend(value)
        else:
            setattr(props, key, value)
    return pb.Message(topic=resource(PARENT), body=body, system_properties=props)


async def receive(client: Client, client_id: str = "c1", **fields: Any) -> list[spb.ReceiveMessageResponse]:
    request = spb.ReceiveMessageRequest(
        group=resource(fields.pop("group", GROUP)),
        message_queue=pb.MessageQueue(topic=resource(fields.pop("topic", PARENT))),
        batch_size=fields.pop("batch_size", 32),
        auto_renew=True,
        long_polling_timeout=fields.pop("long_polling_timeout", None),
        **fields,
    )
    return [frame async for frame in client.stub.ReceiveMessage(request, metadata=H(client_id), timeout=10)]


async def subscribe(
    client: Client, *lites: str, client_id: str = "c1", **headers: str
) -> spb.SyncLiteSubscriptionResponse:
    request = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=resource(PARENT), group=resource(GROUP), lite_topic_set=list(lites)
    )
    return await client.stub.SyncLiteSubscription(request, metadata=H(client_id, **headers))


async def test_query_route_of_a_lite_parent(client: Client) -> None:
    asked = pb.Endpoints(scheme=pb.IPv4, addresses=[pb.Address(host="127.0.0.1", port=1234)])
    reply = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource(PARENT), endpoints=asked), metadata=H())
    assert reply.status.code == pb.OK
    (queue,) = reply.message_queues
    assert queue.permission == pb.READ_WRITE and list(queue.accept_message_types) == [pb.LITE]
    assert queue.broker.id == 0 and queue.broker.endpoints == asked


async def test_query_route_of_normal_and_missing_topics(client: Client, broker: app.Broker) -> None:
    client.store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL, queue_count=2))
    assert broker.dispatcher is not None
    broker.dispatcher.metadata_changed()
    reply = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource("orders")), metadata=H())
    assert [q.id for q in reply.message_queues] == [0, 1]
    assert set(reply.message_queues[0].accept_message_types) == {pb.NORMAL, pb.FIFO}
    assert reply.message_queues[0].broker.endpoints.addresses[0].port == broker.port
    missing = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource("nope")), metadata=H())
    assert missing.status.code == pb.TOPIC_NOT_FOUND
    illegal = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource("a$b")), metadata=H())
    assert illegal.status.code == pb.ILLEGAL_TOPIC
    dlq = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource("%DLQ%g")), metadata=H())
    assert dlq.message_queues[0].permission == pb.READ


async def test_normal_routes_advertise_exactly_the_message_types_send_accepts(
    client: Client, broker: app.Broker
) -> None:
    client.store.put_parent_topic(model.ParentTopic("orders", model.MessageType.NORMAL))
    assert broker.dispatcher is not None
    broker.dispatcher.metadata_changed()
    route = await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource("orders")), metadata=H())
    advertised = set(route.message_queues[0].accept_message_types)
    accepted = set()
    for kind in pb.MessageType.values():
        if kind == pb.MESSAGE_TYPE_UNSPECIFIED:
            continue
        props = pb.SystemProperties(message_id=f"m{kind}", message_type=kind)
        props.message_group = "g" if kind == pb.FIFO else ""
        if kind == pb.DELAY:
            props.delivery_timestamp.FromMilliseconds(4_000_000_000_000)
        if kind == pb.PRIORITY:
            props.priority = 1
        if kind == pb.LITE:
            props.lite_topic = "t1"
        message = pb.Message(topic=resource("orders"), body=b"x", system_properties=props)
        reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=H("p"))
        if reply.status.code == pb.OK:
            accepted.add(kind)
        elif kind in (pb.DELAY, pb.TRANSACTION, pb.PRIORITY):
            assert reply.status.code == pb.UNSUPPORTED, (kind, reply.status)
    assert advertised == accepted == {pb.NORMAL, pb.FIFO}


async def telemetry(
    client: Client, settings: pb.Settings, client_id: str = "c1", *, language: str = "JAVA", version: str = "5.0.8"
) -> spb.TelemetryCommand:
    async def commands() -> AsyncIterator[spb.TelemetryCommand]:
        yield spb.TelemetryCommand(settings=settings)

    call = client.stub.Telemetry(commands(), metadata=H(client_id, language, version))
    reply = await call.read()
    call.cancel()
    assert isinstance(reply, spb.TelemetryCommand)
    return reply


async def test_telemetry_answers_lite_consumers_with_every_setting_they_read(client: Client) -> None:
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        subscription=pb.Subscription(
            group=resource(GROUP), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
        ),
    )
    reply = await telemetry(client, settings)
    assert reply.status.code == pb.OK
    sub = reply.settings.subscription
    assert sub.lite_subscription_quota == 2000 and sub.max_lite_topic_size == 64
    assert sub.long_polling_timeout.seconds == 20 and sub.receive_batch_size == 32 and sub.fifo
    policy = reply.settings.backoff_policy
    assert policy.max_attempts == 17 and policy.customized_backoff.next[0].seconds == 1


async def test_telemetry_gives_node_clients_an_exponential_backoff(client: Client) -> None:
    """Node 1.0.8 ignores a customized backoff and then dead-letters after one failed consumption."""
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        user_agent=pb.UA(language=pb.NODE_JS, version="1.0.8"),
        subscription=pb.Subscription(
            group=resource(GROUP), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
        ),
    )
    policy = (await telemetry(client, settings)).settings.backoff_policy
    assert policy.WhichOneof("strategy") == "exponential_backoff" and policy.max_attempts == 17
    assert (policy.exponential_backoff.initial.seconds, policy.exponential_backoff.max.seconds) == (1, 7200)


async def test_telemetry_answers_producers_with_body_limit_and_backoff(client: Client) -> None:
    reply = await telemetry(client, pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing()))
    assert reply.status.code == pb.OK
    assert reply.settings.publishing.max_body_size == 4 * 1024 * 1024
    assert reply.settings.backoff_policy.max_attempts == 3
    assert reply.settings.backoff_policy.WhichOneof("strategy") == "exponential_backoff"


async def test_telemetry_refuses_an_unknown_group(client: Client) -> None:
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        subscription=pb.Subscription(
            group=resource("ghost"), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
        ),
    )
    reply = await telemetry(client, settings, language="HTTP", version="1.0.8")
    assert reply.status.code == pb.CONSUMER_GROUP_NOT_FOUND and not reply.HasField("settings")


async def test_a_refused_settings_frame_ends_the_stream_with_an_error_naming_the_code(client: Client) -> None:
    """A client that ignores a frame without settings still learns that its start failed."""

    async def commands() -> AsyncIterator[spb.TelemetryCommand]:
        yield spb.TelemetryCommand(
            settings=pb.Settings(
                client_type=pb.LITE_PUSH_CONSUMER,
                subscription=pb.Subscription(
                    group=resource("ghost"), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
                ),
            )
        )
        await asyncio.Event().wait()  # the client keeps its side open; the broker ends the stream

    call = client.stub.Telemetry(commands(), metadata=H("n", "HTTP", "1.0.8"))  # what Node 1.0.8 sends
    first = await call.read()
    assert isinstance(first, spb.TelemetryCommand) and first.status.code == pb.CONSUMER_GROUP_NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await call.read()
    assert ended.value.code() == grpc.StatusCode.NOT_FOUND
    assert "CONSUMER_GROUP_NOT_FOUND (40403)" in (ended.value.details() or "")


async def test_python_512_and_java_learn_of_an_unknown_group_at_their_first_subscription(client: Client) -> None:
    """That client cannot report a failed start (it hides the cause behind an AttributeError), so its
    settings are accepted and the subscription call carries CONSUMER_GROUP_NOT_FOUND."""
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        subscription=pb.Subscription(
            group=resource("ghost"), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
        ),
    )
    reply = await telemetry(client, settings, "py", language="PYTHON", version="5.1.2")
    assert reply.status.code == pb.OK and reply.settings.subscription.lite_subscription_quota > 0
    sync = await client.stub.SyncLiteSubscription(
        spb.SyncLiteSubscriptionRequest(
            action=pb.PARTIAL_ADD, topic=resource(PARENT), group=resource("ghost"), lite_topic_set=["t1"]
        ),
        metadata=H("py", "PYTHON", "5.1.2"),
    )
    assert sync.status.code == pb.CONSUMER_GROUP_NOT_FOUND
    newer = await telemetry(client, settings, "py2", language="PYTHON", version="5.1.3")
    assert newer.status.code == pb.CONSUMER_GROUP_NOT_FOUND
    java = await telemetry(client, settings, "j", language="JAVA", version="5.2.0")
    assert java.status.code == pb.OK


async def test_closing_the_telemetry_stream_removes_the_client(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    await subscribe(client, "t1", client_id="gone")
    assert broker.dispatcher.subscription_count() == 1
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        subscription=pb.Subscription(
            group=resource(GROUP), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
        ),
    )
    await telemetry(client, settings, client_id="gone")
    await eventually_async(
        lambda: broker.dispatcher is not None and broker.dispatcher.subscription_count() == 0, "the client removed"
    )


async def test_send_receive_ack_round_trip(client: Client) -> None:
    assert (await subscribe(client, "t1")).status.code == pb.OK
    sent = await client.stub.SendMessage(spb.SendMessageRequest(messages=[lite_message("t1")]), metadata=H("p"))
    assert sent.status.code == pb.OK and sent.entries[0].message_id == "0102AA" and sent.entries[0].offset == 0
    frames = await receive(client)
    assert frames[0].status.code == pb.OK
    (message,) = [f.message for f in frames if f.HasField("message")]
    assert frames[-1].HasField("delivery_timestamp")
    sp = message.system_properties
    assert (message.body, sp.lite_topic, sp.message_type, sp.delivery_attempt) == (b"hello", "t1", pb.LITE, 1)
    assert sp.body_encoding == pb.IDENTITY and sp.body_digest.type == pb.MD5
    assert sp.body_digest.checksum == hashlib.md5(b"hello").hexdigest().upper()
    ack = await client.stub.AckMessage(
        spb.AckMessageRequest(
            group=resource(GROUP), topic=resource(PARENT),
            entries=[spb.AckMessageEntry(message_id=sp.message_id, receipt_handle=sp.receipt_handle, lite_topic="t1")],
        ),
        metadata=H(),
    )  # fmt: skip
    assert ack.status.code == pb.OK
    assert client.store.get_offset(model.QueueId.lmq(PARENT, "t1"), GROUP) == 1
    empty = await receive(client, long_polling_timeout=duration(0))
    assert [f.status.code for f in empty] == [pb.MESSAGE_NOT_FOUND]


def duration(ms: int) -> Any:
    from google.protobuf import duration_pb2  # noqa: PLC0415

    return duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


async def test_change_invisible_duration_returns_a_new_handle(client: Client) -> None:
    await subscribe(client, "t1")
    await client.stub.SendMessage(spb.SendMessageRequest(messages=[lite_message("t1")]), metadata=H("p"))
    (message,) = [f.message for f in await receive(client) if f.HasField("message")]
    reply = await client.stub.ChangeInvisibleDuration(
        spb.ChangeInvisibleDurationRequest(
            group=resource(GROUP), topic=resource(PARENT), receipt_handle=message.system_properties.receipt_handle,
            invisible_duration=duration(100), lite_topic="t1", suspend=True,
        ),
        metadata=H(),
    )  # fmt: skip
    assert reply.status.code == pb.OK and reply.receipt_handle != message.system_properties.receipt_handle
    frames = await receive(client, long_polling_timeout=duration(3000))
    (again,) = [f.message for f in frames if f.HasField("message")]
    assert again.system_properties.delivery_attempt == 1  # suspended: not counted


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (lite_message("t1", body=b""), pb.MESSAGE_BODY_EMPTY),
        (lite_message("t1", body=b"x" * (4 * 1024 * 1024 + 1)), pb.MESSAGE_BODY_TOO_LARGE),
        (lite_message("bad topic!"), pb.ILLEGAL_LITE_TOPIC),
        (lite_message("x" * 65), pb.ILLEGAL_LITE_TOPIC),
        (lite_message("t1", message_id=""), pb.ILLEGAL_MESSAGE_ID),
        (lite_message("t1", message_type=pb.NORMAL), pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (lite_message("t1", message_type=99), pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (lite_message("t1", message_group="g"), pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        (lite_message("t1", tag="a|b"), pb.ILLEGAL_MESSAGE_TAG),
        (lite_message("t1", tag=" \t"), pb.ILLEGAL_MESSAGE_TAG),
        (lite_message("t1", tag="a\nb"), pb.ILLEGAL_MESSAGE_TAG),
        (lite_message("t1", tag="a\x7f"), pb.ILLEGAL_MESSAGE_TAG),
        (lite_message("t1", tag="a\x85"), pb.ILLEGAL_MESSAGE_TAG),
        (lite_message("t1", keys=["ok", "a\x00b"]), pb.ILLEGAL_MESSAGE_KEY),
        (lite_message("t1", keys=["a\rb"]), pb.ILLEGAL_MESSAGE_KEY),
        (lite_message("t1", keys=[" "]), pb.ILLEGAL_MESSAGE_KEY),
        (lite_message("t1", body_encoding=pb.GZIP), pb.BAD_REQUEST),
        (pb.Message(topic=resource("nope"), body=b"x"), pb.TOPIC_NOT_FOUND),
        (pb.Message(topic=resource(""), body=b"x"), pb.ILLEGAL_TOPIC),
    ],
)
async def test_invalid_messages_get_their_code_and_nothing_is_stored(
    client: Client, message: pb.Message, code: int
) -> None:
    reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=H("p"))
    assert reply.status.code == code, reply.status.message
    assert client.store.lite_topic_count(PARENT) == 0
    assert client.store.queue_offsets(model.QueueId(PARENT, 0)) == (0, 0)


async def test_a_client_cannot_store_an_empty_body_with_the_brokers_mqtt_marker(client: Client) -> None:
    """``MQTT_EMPTY`` lets an empty MQTT publish be stored; a RocketMQ client that sets it is refused."""
    marked = lite_message("t1", body=b"")
    marked.user_properties[model.EMPTY_BODY_PROPERTY] = "1"
    reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=[marked]), metadata=H("p"))
    assert reply.status.code == pb.ILLEGAL_MESSAGE_PROPERTY_KEY, reply.status.message
    assert model.EMPTY_BODY_PROPERTY in reply.status.message
    assert client.store.lite_topic_count(PARENT) == 0


async def test_one_bad_message_rejects_the_whole_batch(client: Client) -> None:
    batch = [lite_message("t1", message_id="a"), lite_message("t2", body=b"")]
    reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=batch), metadata=H("p"))
    assert reply.status.code == pb.MESSAGE_BODY_EMPTY
    assert client.store.lite_topic_count(PARENT) == 0


async def test_a_control_character_in_one_messages_tag_or_key_rejects_the_batch_with_its_code(client: Client) -> None:
    """As RocketMQ's proxy: a tag or key with a control character is ILLEGAL_MESSAGE_TAG / _KEY (a log line or an
    index entry would carry it), named in the status; nothing of the batch is stored; printable non-ASCII is kept."""
    fine = lite_message("t1", message_id="a", tag="étiquette", keys=["clé-1"])
    for bad, code in ((lite_message("t2", tag="x\x1b[31m"), pb.ILLEGAL_MESSAGE_TAG),
                      (lite_message("t2", keys=["k", "line\nbreak"]), pb.ILLEGAL_MESSAGE_KEY)):  # fmt: skip
        reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=[fine, bad]), metadata=H("p"))
        assert reply.status.code == code, reply.status.message
        assert "control characters" in reply.status.message
        assert client.store.lite_topic_count(PARENT) == 0
    reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=[fine]), metadata=H("p"))
    assert reply.status.code == pb.OK, reply.status.message


async def test_gzip_bodies_are_stored_inflated(client: Client) -> None:
    import gzip  # noqa: PLC0415

    await subscribe(client, "t1")
    packed = lite_message("t1", body=gzip.compress(b"inflated"), body_encoding=pb.GZIP)
    assert (
        await client.stub.SendMessage(spb.SendMessageRequest(messages=[packed]), metadata=H("p"))
    ).status.code == pb.OK
    (message,) = [f.message for f in await receive(client) if f.HasField("message")]
    assert message.body == b"inflated"


async def test_batched_send_answers_one_entry_per_message(client: Client) -> None:
    batch = [lite_message(f"t{i % 3}", message_id=f"m{i}") for i in range(9)]
    reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=batch), metadata=H("p"))
    assert reply.status.code == pb.OK
    assert [e.message_id for e in reply.entries] == [f"m{i}" for i in range(9)]
    assert [e.offset for e in reply.entries] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"language": "PYTHON", "version": "5.1.2"}, {"session-1"}),
        ({"language": "PYTHON", "version": "5.1.3"}, set("session-1")),
        ({"language": "JAVA", "version": "5.1.2"}, set("session-1")),
    ],
)
async def test_python_5_1_2_character_split_subscription_is_joined(
    client: Client, broker: app.Broker, headers: dict[str, str], expected: set[str]
) -> None:
    assert broker.dispatcher is not None
    reply = await subscribe(client, *"session-1", client_id="py", **headers)
    assert reply.status.code == pb.OK
    state = broker.dispatcher.registry.get("py")
    assert state is not None
    assert {name.rsplit("$", 1)[1] for name in state.lite_topics} == expected


def subscribed(broker: app.Broker, client_id: str) -> set[str]:
    """The lite topics the registry holds for ``client_id``."""
    assert broker.dispatcher is not None
    state = broker.dispatcher.registry.get(client_id)
    return set() if state is None else {name.rsplit("$", 1)[1] for name in state.lite_topics}


async def sync(
    client: Client, action: Any, *lites: str, client_id: str = "c1", **headers: str
) -> spb.SyncLiteSubscriptionResponse:
    request = spb.SyncLiteSubscriptionRequest(
        action=action, topic=resource(PARENT), group=resource(GROUP), lite_topic_set=list(lites)
    )
    return await client.stub.SyncLiteSubscription(request, metadata=H(client_id, **headers))


async def send_lite(
    client: Client, lite: str, body: bytes, user_properties: dict[str, str] | None = None, **sp: Any
) -> None:
    message = lite_message(lite, body=body, message_id=f"{lite}-{body.decode()}")
    message.system_properties.MergeFrom(pb.SystemProperties(**sp))
    message.user_properties.update(user_properties or {})
    reply = await client.stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=H("p"))
    assert reply.status.code == pb.OK, reply.status.message


async def bodies(client: Client, client_id: str = "c1", poll_ms: int = 1000) -> list[tuple[str, bytes]]:
    frames = await receive(client, client_id, long_polling_timeout=duration(poll_ms))
    return sorted((f.message.system_properties.lite_topic, f.message.body) for f in frames if f.HasField("message"))


# A full sync as sent: these clients change their sets faster than the grace given to a full sync built before a
# subscribe's answer (``full_sync_grace_ms``, tests/broker/dispatch/test_full_sync_grace.py).
literal_full_sync = pytest.mark.parametrize("server_config", [{"full_sync_grace_ms": 0}], indirect=True)


@literal_full_sync
async def test_an_empty_complete_add_is_accepted_and_leaves_no_subscription(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    assert (await sync(client, pb.COMPLETE_ADD, client_id="fresh")).status.code == pb.OK  # a client with none yet
    assert subscribed(broker, "fresh") == set()
    assert (await subscribe(client, "a", "b")).status.code == pb.OK
    assert broker.dispatcher.subscription_count() == 2
    assert (await sync(client, pb.COMPLETE_ADD)).status.code == pb.OK  # the client unsubscribed everything
    assert subscribed(broker, "c1") == set() and broker.dispatcher.subscription_count() == 0
    await send_lite(client, "a", b"1")
    assert await bodies(client) == []


@literal_full_sync
async def test_a_complete_add_replaces_the_set(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    assert (await subscribe(client, "a", "b")).status.code == pb.OK
    # Python 5.1.2 headers: a COMPLETE_ADD of one-character names is taken literally (only PARTIAL_ADD is joined).
    reply = await sync(client, pb.COMPLETE_ADD, "b", "c", language="PYTHON", version="5.1.2")
    assert reply.status.code == pb.OK
    assert subscribed(broker, "c1") == {"b", "c"}
    assert broker.dispatcher.subscription_count() == 2
    for lite in ("a", "b", "c"):
        await send_lite(client, lite, b"1")
    assert await bodies(client) == [("b", b"1"), ("c", b"1")]  # "a" was dropped
    assert (await sync(client, pb.COMPLETE_ADD, "no spaces")).status.code == pb.ILLEGAL_LITE_TOPIC
    assert subscribed(broker, "c1") == {"b", "c"}  # a refused COMPLETE_ADD changes nothing


async def test_complete_remove_drops_every_subscription_of_the_client(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    assert (await subscribe(client, "a", "b")).status.code == pb.OK
    assert (await subscribe(client, "a", client_id="other")).status.code == pb.OK
    assert broker.dispatcher.subscription_count() == 3
    assert (await sync(client, pb.COMPLETE_REMOVE)).status.code == pb.OK
    assert subscribed(broker, "c1") == set()
    assert subscribed(broker, "other") == {"a"}
    assert broker.dispatcher.subscription_count() == 1
    await send_lite(client, "b", b"1")
    assert await bodies(client) == []
    assert (await sync(client, pb.COMPLETE_REMOVE)).status.code == pb.OK  # again: nothing left, still OK


async def test_a_duplicate_partial_add_is_accepted_once(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    assert (await subscribe(client, "a")).status.code == pb.OK
    assert (await subscribe(client, "a")).status.code == pb.OK
    assert (await subscribe(client, "a", "a")).status.code == pb.OK
    assert subscribed(broker, "c1") == {"a"}
    assert broker.dispatcher.subscription_count() == 1
    await send_lite(client, "a", b"1")
    assert await bodies(client) == [("a", b"1")]  # delivered once
    assert await bodies(client, poll_ms=200) == []


async def test_forward_to_the_dead_letter_queue_stores_the_message_for_any_reader(client: Client) -> None:
    assert (await subscribe(client, "t1")).status.code == pb.OK
    await send_lite(client, "t1", b"poison", tag="urgent", keys=["k1"], user_properties={"trace": "42"})
    (message,) = [f.message for f in await receive(client) if f.HasField("message")]
    sp = message.system_properties
    forward = spb.ForwardMessageToDeadLetterQueueRequest(
        group=resource(GROUP), topic=resource(PARENT), receipt_handle=sp.receipt_handle, message_id=sp.message_id,
        delivery_attempt=2, max_delivery_attempts=2, lite_topic="t1",
    )  # fmt: skip
    assert (await client.stub.ForwardMessageToDeadLetterQueue(forward, metadata=H())).status.code == pb.OK
    assert client.store.get_offset(model.QueueId.lmq(PARENT, "t1"), GROUP) == 1  # settled
    assert await bodies(client, poll_ms=200) == []
    # Forwarding again (the client retries until OK) stores no second copy.
    assert (await client.stub.ForwardMessageToDeadLetterQueue(forward, metadata=H())).status.code == pb.OK

    dlq = f"%DLQ%{GROUP}"
    frames = await receive(client, "reader", group="dlq-reader", topic=dlq, long_polling_timeout=duration(1000))
    assert frames[0].status.code == pb.OK
    (dead,) = [f.message for f in frames if f.HasField("message")]
    dsp = dead.system_properties
    assert (dead.topic.name, dead.body, dsp.message_id) == (dlq, b"poison", "t1-poison")
    assert (dsp.message_type, dsp.tag, list(dsp.keys), dsp.HasField("lite_topic")) == (
        pb.NORMAL,
        "urgent",
        ["k1"],
        False,
    )
    assert dict(dead.user_properties) == {"trace": "42", "__ORIGIN_TOPIC": PARENT, "__ORIGIN_LITE_TOPIC": "t1"}
    assert dsp.delivery_attempt == 1
    assert client.store.queue_offsets(model.QueueId(dlq, 0)) == (0, 1)


async def test_a_quiet_long_poll_is_answered_before_the_call_deadline(client: Client) -> None:
    """The client's deadline is its polling time + request timeout; the broker answers MESSAGE_NOT_FOUND
    0.5 s before it rather than letting the call run into DEADLINE_EXCEEDED."""
    assert (await subscribe(client, "quiet")).status.code == pb.OK
    request = spb.ReceiveMessageRequest(
        group=resource(GROUP), message_queue=pb.MessageQueue(topic=resource(PARENT)), batch_size=32,
        auto_renew=True, long_polling_timeout=duration(20_000),  # longer than the call may last
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    for deadline_s, at_least_s in ((2.0, 1.2), (0.4, 0.0)):  # shorter than the margin: answered at once
        started = loop.time()
        frames = [f async for f in client.stub.ReceiveMessage(request, metadata=H(), timeout=deadline_s)]
        elapsed = loop.time() - started
        assert [f.status.code for f in frames] == [pb.MESSAGE_NOT_FOUND]
        assert at_least_s <= elapsed < deadline_s, (deadline_s, elapsed)


async def test_subscription_errors(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    client.store.put_group(model.LiteGroup(GROUP, PARENT, client_quota=2))
    broker.dispatcher.metadata_changed()
    assert (await subscribe(client, "a", "b")).status.code == pb.OK
    assert (await subscribe(client, "c")).status.code == pb.LITE_SUBSCRIPTION_QUOTA_EXCEEDED
    assert (await subscribe(client, "no spaces")).status.code == pb.ILLEGAL_LITE_TOPIC
    no_client = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=resource(PARENT), group=resource(GROUP))
    assert (await client.stub.SyncLiteSubscription(no_client)).status.code == pb.CLIENT_ID_REQUIRED
    bad_action = spb.SyncLiteSubscriptionRequest(action=17, topic=resource(PARENT), group=resource(GROUP))  # type: ignore[arg-type]
    assert (await client.stub.SyncLiteSubscription(bad_action, metadata=H())).status.code == pb.BAD_REQUEST
    ghost = spb.SyncLiteSubscriptionRequest(action=pb.PARTIAL_ADD, topic=resource(PARENT), group=resource("ghost"))
    assert (await client.stub.SyncLiteSubscription(ghost, metadata=H())).status.code == pb.CONSUMER_GROUP_NOT_FOUND


async def test_lite_topic_quota_on_send(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    client.store.put_parent_topic(model.ParentTopic(PARENT, max_lite_topics=1))
    broker.dispatcher.metadata_changed()
    ok = await client.stub.SendMessage(spb.SendMessageRequest(messages=[lite_message("a")]), metadata=H("p"))
    assert ok.status.code == pb.OK
    over = await client.stub.SendMessage(spb.SendMessageRequest(messages=[lite_message("b")]), metadata=H("p"))
    assert over.status.code == pb.LITE_TOPIC_QUOTA_EXCEEDED


async def test_receive_validation(client: Client) -> None:
    frames = [f async for f in client.stub.ReceiveMessage(spb.ReceiveMessageRequest(group=resource(GROUP)))]
    assert [f.status.code for f in frames] == [pb.CLIENT_ID_REQUIRED]
    assert [f.status.code for f in await receive(client, batch_size=0)] == [pb.BAD_REQUEST]
    sql = pb.FilterExpression(type=pb.SQL, expression="a > 1")
    assert [f.status.code for f in await receive(client, filter_expression=sql)] == [pb.UNSUPPORTED]
    assert [f.status.code for f in await receive(client, group="ghost")] == [pb.CONSUMER_GROUP_NOT_FOUND]


async def test_ack_with_a_foreign_handle_is_invalid(client: Client) -> None:
    ack = await client.stub.AckMessage(
        spb.AckMessageRequest(
            group=resource(GROUP), topic=resource(PARENT),
            entries=[spb.AckMessageEntry(message_id="x", receipt_handle="r1 old %LMQ%$a$b 0 0 1")],
        ),
        metadata=H(),
    )  # fmt: skip
    assert ack.status.code == pb.INVALID_RECEIPT_HANDLE
    assert ack.entries[0].status.code == pb.INVALID_RECEIPT_HANDLE


async def test_unserved_rpcs_answer_not_implemented(client: Client) -> None:
    codes = [
        (await client.stub.EndTransaction(spb.EndTransactionRequest(), metadata=H())).status.code,
        (await client.stub.RecallMessage(spb.RecallMessageRequest(), metadata=H())).status.code,
        (await client.stub.QueryOffset(spb.QueryOffsetRequest(), metadata=H())).status.code,
        (await client.stub.GetOffset(spb.GetOffsetRequest(), metadata=H())).status.code,
        (await client.stub.UpdateOffset(spb.UpdateOffsetRequest(), metadata=H())).status.code,
    ]
    assert set(codes) == {pb.NOT_IMPLEMENTED}
    pulled = [f async for f in client.stub.PullMessage(spb.PullMessageRequest(), metadata=H())]
    assert [f.status.code for f in pulled] == [pb.NOT_IMPLEMENTED]


async def test_heartbeat_and_termination(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    beat = spb.HeartbeatRequest(client_type=pb.LITE_PUSH_CONSUMER, group=resource(GROUP))
    assert (await client.stub.Heartbeat(beat, metadata=H("hb"))).status.code == pb.OK
    assert broker.dispatcher.registry.get("hb") is not None
    bad = spb.HeartbeatRequest(client_type=42)  # type: ignore[arg-type]
    assert (await client.stub.Heartbeat(bad, metadata=H("hb"))).status.code == pb.UNRECOGNIZED_CLIENT_TYPE
    assert (await subscribe(client, "t1", "t2", client_id="hb")).status.code == pb.OK
    assert (await subscribe(client, "t1", client_id="stays")).status.code == pb.OK
    assert broker.dispatcher.subscription_count() == 3
    bye = spb.NotifyClientTerminationRequest(group=resource(GROUP))
    assert (await client.stub.NotifyClientTermination(bye, metadata=H("hb"))).status.code == pb.OK
    assert broker.dispatcher.registry.get("hb") is None
    assert broker.dispatcher.subscription_count() == 1  # all of hb's subscriptions, none of the other client's
    assert subscribed(broker, "stays") == {"t1"}


async def test_metrics_and_probes_over_http(client: Client, broker: app.Broker) -> None:
    await client.stub.QueryRoute(spb.QueryRouteRequest(topic=resource(PARENT)), metadata=H())

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""

    status, text = await asyncio.to_thread(get, "/metrics")
    assert status == 200 and 'lmq_rpc_total{code="20000",method="QueryRoute"} 1.0' in text
    assert "lmq_lite_subscriptions 0.0" in text
    assert 'lmq_append_commits_total{path="loop"} 0.0' in text
    send = spb.SendMessageRequest(messages=[lite_message("metrics-a")])
    assert (await client.stub.SendMessage(send, metadata=H())).status.code == pb.OK
    status, text = await asyncio.to_thread(get, "/metrics")
    assert 'lmq_append_commits_total{path="loop"} 1.0' in text  # one small send: appended on the event loop
    assert 'lmq_append_commits_total{path="thread"} 0.0' in text
    gauge = "lmq_append_inline_seconds_average "
    [average] = [float(line.split()[1]) for line in text.splitlines() if line.startswith(gauge)]
    assert 0.0 < average < 1.0
    assert (await asyncio.to_thread(get, "/healthz"))[0] == 200
    assert (await asyncio.to_thread(get, "/readyz"))[0] == 200
    assert (await asyncio.to_thread(get, "/nope"))[0] == 404


async def test_liveness_fails_once_a_storage_fault_cannot_heal_and_readiness_says_why_before(
    client: Client, broker: app.Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = broker.store
    assert isinstance(store, lmq_store.LmqStore)
    store._healer.give_up_s = 0.3

    def broken(self: index_mod.Index, wb: object) -> None:
        raise OSError("simulated: the index cannot write (not a full disk)")

    monkeypatch.setattr(index_mod.Index, "write", broken)
    send = spb.SendMessageRequest(messages=[lite_message("probe-a")])
    reply = await client.stub.SendMessage(send, metadata=H())
    assert reply.status.code == pb.INTERNAL_ERROR and "not stored" in reply.status.message
    code, _, body = broker._http_answer("/readyz")
    assert code.startswith("503") and b"index cannot write" in body
    assert broker._http_answer("/healthz")[0] == "200 OK"  # it may still heal

    def failing() -> tuple[str, str, bytes] | None:
        answer = broker._http_answer("/healthz")
        return None if answer[0] == "200 OK" else answer

    answer = await eventually_async(failing, "liveness fails")
    assert answer is not None
    code, _, body = answer
    assert code.startswith("503") and b"could not recover from a storage fault" in body
    text = broker._http_answer("/metrics")[2].decode()
    assert "lmq_store_index_writable 0.0" in text and "lmq_store_durable 1.0" in text


async def test_exclusive_eviction_is_told_over_telemetry(client: Client, broker: app.Broker) -> None:
    assert broker.dispatcher is not None
    client.store.put_group(model.LiteGroup(GROUP, PARENT, model=model.SubscriptionModel.EXCLUSIVE))
    broker.dispatcher.metadata_changed()
    commands: asyncio.Queue[spb.TelemetryCommand] = asyncio.Queue()
    settings = pb.Settings(
        client_type=pb.LITE_PUSH_CONSUMER,
        subscription=pb.Subscription(
            group=resource(GROUP), subscriptions=[pb.SubscriptionEntry(topic=resource(PARENT))]
        ),
    )
    await commands.put(spb.TelemetryCommand(settings=settings))

    async def outgoing() -> AsyncIterator[spb.TelemetryCommand]:
        while True:
            yield await commands.get()

    call = client.stub.Telemetry(outgoing(), metadata=H("first"))
    try:
        first = await call.read()
        assert isinstance(first, spb.TelemetryCommand) and first.status.code == pb.OK
        await subscribe(client, "shared", client_id="first")
        await subscribe(client, "shared", client_id="second")
        notice = await asyncio.wait_for(call.read(), 5)
        assert isinstance(notice, spb.TelemetryCommand)
        assert notice.notify_unsubscribe_lite_command.lite_topic == "shared"
    finally:
        call.cancel()


@pytest.mark.parametrize("index_parent", [False, True])
async def test_lite_messages_are_indexed_in_the_parent_queue_only_when_configured(
    tmp_path: Path, index_parent: bool
) -> None:
    config = config_for(tmp_path / "data", host="127.0.0.1", port=0, metrics_port=-1, index_parent_queue=index_parent)
    broker = app.Broker(config)
    await broker.start()
    try:
        assert broker.store is not None
        async with grpc.aio.insecure_channel(broker.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            reply = await stub.SendMessage(spb.SendMessageRequest(messages=[lite_message("t1")]), metadata=H("p"))
        assert reply.status.code == pb.OK
        assert broker.store.queue_offsets(model.QueueId.lmq(PARENT, "t1")) == (0, 1)
        assert broker.store.queue_offsets(model.QueueId(PARENT, 0)) == ((0, 1) if index_parent else (0, 0))
    finally:
        await broker.stop(0.2)


async def test_a_forged_receipt_handle_acks_nothing(client: Client) -> None:
    """Offsets and lease ids are sequential: a handle rebuilt from them must not settle the message."""
    await subscribe(client, "t1")
    await client.stub.SendMessage(spb.SendMessageRequest(messages=[lite_message("t1")]), metadata=H("p"))
    (message,) = [f.message for f in await receive(client) if f.HasField("message")]
    handle = message.system_properties.receipt_handle
    fields = handle.rpartition(" ")[0]
    for forged in (fields, f"{fields} {'ab' * 16}"):
        ack = await client.stub.AckMessage(
            spb.AckMessageRequest(
                group=resource(GROUP), topic=resource(PARENT),
                entries=[spb.AckMessageEntry(message_id=message.system_properties.message_id, receipt_handle=forged)],
            ),
            metadata=H(),
        )  # fmt: skip
        assert ack.status.code == pb.INVALID_RECEIPT_HANDLE, ack.status
        assert client.store.get_offset(model.QueueId.lmq(PARENT, "t1"), GROUP) in (None, 0)
    ack = await client.stub.AckMessage(
        spb.AckMessageRequest(
            group=resource(GROUP), topic=resource(PARENT),
            entries=[spb.AckMessageEntry(message_id=message.system_properties.message_id, receipt_handle=handle)],
        ),
        metadata=H(),
    )  # fmt: skip
    assert ack.status.code == pb.OK
    assert client.store.get_offset(model.QueueId.lmq(PARENT, "t1"), GROUP) == 1
