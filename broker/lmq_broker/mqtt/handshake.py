"""The CONNECT: read within a time and size bound, refused with a CONNACK code (5.0 with words), or taken as
the session's settings (the client's receive maximum, maximum packet size, session expiry) and answered with
ours in the CONNACK's properties; under ``--acl``, whether the client id's stored session is the user's to resume
(``open_session``)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import secrets
from typing import Final

from lmq_broker.dispatch import metadata
from lmq_broker.mqtt import aliases, codec, durable, framing, limits, properties, publishing, stats, topics
from lmq_broker.mqtt.link import MAX_INFLIGHT, Closed, Link
from lmq_broker.mqtt.properties import Properties, Reason

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S: Final = 10.0
NEVER: Final = durable.NEVER  # 5.0: a session expiry interval that never ends
_PLAIN_ID: Final = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


def group_of(client_id: str) -> str:
    """The implicit lite group of an MQTT client id: the id itself when it is a short plain name, else a hash
    (a ``%`` marks it, which no plain id holds, so two ids never share a group)."""
    if _PLAIN_ID.match(client_id):
        return metadata.MQTT_GROUP_PREFIX + client_id
    return metadata.MQTT_GROUP_PREFIX + "%" + hashlib.sha256(client_id.encode()).hexdigest()[:40]


async def read_connect(link: Link) -> codec.Connect | None:
    """The CONNECT (within ``CONNECT_TIMEOUT_S``, at most ``limits.connect_bytes``); None: closed first."""
    async with asyncio.timeout(CONNECT_TIMEOUT_S):
        try:
            frame = await framing.read_frame(
                link.reader, limits.connect_bytes(link.config), link.host.read_budget, address=link.address
            )
        except codec.PacketTooLarge:
            link.host.stats.refused[stats.CONNECT_TOO_LARGE] += 1
            with contextlib.suppress(asyncio.IncompleteReadError):  # 5.0 (read so far): answered with 0x95
                if limits.is_v5_connect(await link.reader.readexactly(7)):
                    link.writer.write(codec.encode_connack(False, Reason.PACKET_TOO_LARGE, codec.LEVEL_5))
            raise
    if frame is None:
        return None
    first, body = frame
    try:
        connect = codec.decode_packet(first, body)
    except codec.UnsupportedProtocol as exc:
        link.writer.write(codec.encode_connack(False, codec.ConnectCode.BAD_PROTOCOL_VERSION, exc.level))
        raise Closed(exc.reason) from None
    except codec.MalformedPacket as exc:
        if limits.is_v5_connect(body):  # 5.0 section 3.1.4: a bad CONNECT may be answered with its code
            link.writer.write(codec.encode_connack(False, exc.code, codec.LEVEL_5))
        raise
    if not isinstance(connect, codec.Connect):
        raise codec.MalformedPacket("the first packet is not CONNECT")  # MQTT-3.1.0-1
    return connect


async def refuse(link: Link, connect: codec.Connect) -> None:
    """A CONNECT over a cap or otherwise refused (``limits.refusal``): answered, counted, and the end."""
    space = topics.space_of(await link.dispatcher.metadata())  # where a will's topic is stored
    refused = limits.refusal(connect, link.config, link.host.access, link.address, space)
    if refused is None:
        return
    code, counted = refused
    why = limits.words(counted, link.config)
    if counted:  # a cap: counted, and said
        link.host.stats.refused[counted] += 1
    link.writer.write(codec.encode_connack(False, code, connect.level, link.why(why) if link.v5 else None))
    await link.writer.drain()
    raise Closed(f"CONNECT refused: {code:#04x} {why}".rstrip(), graceful=True)


def settle(link: Link, connect: codec.Connect) -> Properties:
    """The session's settings from the CONNECT; the CONNACK's properties (5.0; none for 3.1.1)."""
    link.client_id = connect.client_id or "auto-" + secrets.token_hex(8)  # MQTT-3.1.3-6
    link.user = connect.username or ""
    link.group = group_of(link.client_id)
    if connect.properties is None:  # 3.1.1: a persistent session has no expiry but ours
        link.expiry_s = 0 if connect.clean_session else limits.session_expiry_s(None, link.config)
        return properties.NONE
    p = connect.properties
    asked = None if p.session_expiry_s == NEVER else p.session_expiry_s or 0
    link.expiry_s = limits.session_expiry_s(asked, link.config)
    link.max_inflight = min(MAX_INFLIGHT, p.receive_max or MAX_INFLIGHT)
    link.max_packet_out = min(codec.MAX_REMAINING_LENGTH, p.max_packet_size or codec.MAX_REMAINING_LENGTH)
    link.problem_info = p.request_problem_info != 0
    link.aliases = aliases.Outbound(p.topic_alias_max or 0)
    kept = limits.keep_alive_s(connect, link.config)
    return Properties(
        receive_max=publishing.RECEIVE_MAXIMUM,
        topic_alias_max=publishing.TOPIC_ALIAS_MAX,
        max_packet_size=link.max_packet_bytes() + 5,  # the fixed header's 5 bytes at most
        assigned_client_id=None if connect.client_id else link.client_id,
        server_keep_alive_s=None if kept == connect.keep_alive_s else kept,  # MQTT-3.2.2-21
        session_expiry_s=None if link.expiry_s == asked else link.expiry_s,  # 5.0 3.2.2.3.2: ours, when lower
    )


async def admit_session(link: Link) -> bool:
    """Whether room was reserved for a new persistent session (the caller says ``Sessions.made`` once its row is
    written); past ``--mqtt-max-sessions`` the CONNECT is refused (5.0: 0x97 quota exceeded, 3.1.1: 0x03 server
    unavailable), counted, and the end. Resuming or replacing a session (its row is there, expired or not: no
    row added) is never refused."""
    if not link.persistent or await link.dispatcher.run(link.host.durable.has_session, link.client_id):
        return False
    sessions = link.host.sessions
    if sessions.reserve(link.client_id):
        return True
    link.host.stats.refused[stats.SESSIONS] += 1
    why = f"--mqtt-max-sessions ({sessions.max_sessions}) persistent sessions are held"
    code = Reason.QUOTA_EXCEEDED if link.v5 else codec.ConnectCode.SERVER_UNAVAILABLE
    link.writer.write(codec.encode_connack(False, code, link.level, link.why(why) if link.v5 else None))
    await link.writer.drain()
    raise Closed(f"CONNECT refused: {code:#04x} {why}", graceful=True)


async def open_session(link: Link, clean_start: bool) -> tuple[bool, bool]:
    """(whether the session starts fresh, whether it must be recorded as the user's: ``owned``).

    Fresh when the CONNECT asks (clean start), and under ``--acl`` also when the client id's stored session
    was made by another user (or by one not recorded: a file older than owners, or a session made without
    ``--acl``): the newcomer gets a new session, session present 0, and the old one is discarded with its
    subscriptions, its queued messages' positions and its QoS 2 state, as a clean start discards it (MQTT 5
    section 3.2.2.1.1: the server may treat a CONNECT as new; client ids are one namespace, so the owner's next
    CONNECT finds the newcomer's session, not its own). A same-user reconnect resumes as before."""
    if not link.host.access.enabled:
        return clean_start, False
    exists, owner = await link.dispatcher.run(link.host.durable.session_owner, link.client_id)
    if exists and owner != link.user and not clean_start:
        log.info("mqtt client %s: user %s connected with the client id of a session of %s: a fresh session "
                 "(the old one is discarded)", link.client_id, link.user, owner or "an unknown user")  # fmt: skip
        return True, True
    return clean_start, owner != link.user
