"""Storing what an MQTT client published: its messages appended (one store call, or each at its lite topic's
owner in a cluster), then its retained messages recorded; both durable on return, the retained ones on the
replicas too (``--replicas``). Used by connections and by
wills, which may be published after their connection ended, or after a restart (``wills``)."""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Sequence
from dataclasses import replace

from lmq_broker import errors, model
from lmq_broker.mqtt import codec, durable, mapping, topics
from lmq_broker.mqtt.host import Host

log = logging.getLogger(__name__)


async def store(
    server: Host, client_id: str, host: str, publishes: Sequence[codec.Publish], message_ids: Sequence[str] = ()
) -> None:
    """Append the messages (one store call), then record the retained ones; both durable on return.
    ``message_ids``: per publish, the id to store it under (empty or missing: a new one)."""
    config = server.config
    messages: list[model.NewMessage] = []
    retained: list[durable.Retained] = []
    now = server.dispatcher.wall_clock()
    space = await space_of(server)
    for n, p in enumerate(publishes):
        parent, lite = space.lite_of(p.topic)
        props = mapping.incoming(p.properties, qos=p.qos, retain=p.retain, client_id=client_id, now_ms=now)
        if topics.is_hashed(lite) and parent == space.default:  # its topic, given back to subscribers
            props[topics.TOPIC_PROPERTY] = p.topic
        if p.retain:
            retained.append(durable.Retained(parent, lite, p.payload, p.qos, now, props))
        if p.payload or not p.retain:  # an empty retained publish only clears (MQTT-3.3.1-10)
            if not p.payload:  # an empty message is valid (section 3.3.3); the store keeps it marked
                props[model.EMPTY_BODY_PROPERTY] = "1"
            message_id = (message_ids[n] if n < len(message_ids) else "") or new_message_id()
            messages.append(_message(config.index_parent_queue, host, parent, lite, p.payload, now, props, message_id))
    owners = server.owners
    clustered = owners is not None and owners.active
    if messages:
        if owners is not None and clustered:  # a cluster: each at its lite topic's owner (docs/scale-out.md)
            await owners.store(messages)
        else:
            await server.dispatcher.send(messages)
    if retained:  # in a cluster a clear here outdates an older one kept elsewhere: kept as a tombstone
        put = functools.partial(server.durable.put_retained, retained, tombstones=clustered)
        await server.dispatcher.run(put)
        await server.rows_saved(client_id, "retained messages")  # on the replicas before the PUBACK (PUBREC)


async def space_of(server: Host) -> topics.Space:
    """The broker's MQTT topic space now (its default and named parents)."""
    return topics.space_of(await server.dispatcher.metadata())


async def publish_will(server: Host, client_id: str, host: str, will: codec.Will) -> bool:
    """Store ``will`` as the client's publish; False (and logged) when it could not be."""
    props = None if will.properties is None else replace(will.properties, will_delay_s=None)
    try:
        await store(server, client_id, host, [codec.Publish(will.topic, will.payload, will.qos, will.retain,
                                                            properties=props)])  # fmt: skip
    except (errors.LmqError, topics.TopicError, ValueError) as exc:
        log.warning("mqtt client %s: will to %s not published: %s", client_id, will.topic, exc)
        return False
    log.info("mqtt client %s: will published to %s", client_id, will.topic)
    return True


def new_message_id() -> str:
    return secrets.token_hex(16).upper()


def _message(  # noqa: PLR0917 (what, where, when, which)
    index_parent: bool,
    host: str,
    parent: str,
    lite: str,
    body: bytes,
    now_ms: int,
    props: dict[str, str],
    message_id: str,
) -> model.NewMessage:
    lmq = model.QueueId.lmq(parent, lite)
    queues = (model.QueueId(parent, 0), lmq) if index_parent else (lmq,)
    return model.NewMessage(
        message_id=message_id,
        topic=parent,
        body=body,
        queues=queues,
        lite_topic=lite,
        message_type=model.MessageType.LITE,
        born_timestamp_ms=now_ms,
        born_host=host,
        user_properties=props,
    )
