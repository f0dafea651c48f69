"""Exactly once for a persistent session's inbound QoS 2 across a broker crash (MQTT 3.1.1 and 5.0 section
4.3.3, method B).

The message append (the store) and the packet id's row (``mqtt.sqlite3``) are two durable writes, so one of
them must tell, after a crash between the two, whether the other happened. The row goes first: before a
batch is appended, each of its QoS 2 publishes gets its row, naming the message id the message is then stored
under and where its lite topic ended before (``Planned``). A PUBLISH resent after a restart (or a reconnect:
the state was read back from the rows) whose row names a message is looked for there: found, it is answered
PUBREC and not stored again; not found (the broker died before the append), it is stored now, under the same
id. Either way it is stored once. A crash before the row leaves nothing to look for: the client's resend is
stored as a new publish (nothing of it was).

In a cluster a message may be stored at another owner, so there the rows of a batch are also marked stored
(``durable.Durable.qos2_stored``: their text cleared) once the append returned and before the PUBRECs, and a
resend whose row is not marked is looked for at its lite topic's owner (``Owners.was_stored``: the admin call
``MqttFindMessage``, which reads at most ``FIND_LIMIT`` messages a call there; asked again from where it
stopped). There the row's end is the topic's end at its owner, asked for before the rows are written (the same
call without a message id). An owner that cannot be reached cannot tell: the resend is not answered (the
connection closes, the client sends it again later), never stored a second time.

``crash_point`` is a test's hook: ``LMQ_TEST_KILL_AT`` names a point where the broker process kills itself
(SIGKILL), to land a crash exactly in the window; unset (always, outside tests) it is one string comparison.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import Final, NamedTuple

from lmq_broker import model
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)

_KILL_AT: Final = os.environ.get("LMQ_TEST_KILL_AT", "")
RECORDED: Final = "mqtt-qos2-recorded"  # a batch's QoS 2 rows written, its append not begun
APPENDED: Final = "mqtt-qos2-appended"  # the append done, no PUBREC written yet
COMPLETED: Final = "mqtt-qos2-completed"  # a delivery's PUBCOMP: its message settled, its row not yet forgotten
SCAN_PAGE: Final = 256  # messages read per step while looking for a resent publish's message
FIND_LIMIT: Final = 100_000  # messages an owner reads at most for another broker's look-up (``MqttFindMessage``)


class Planned(NamedTuple):
    """Where a QoS 2 publish is (to be) stored: its message id, its lite topic, and that topic's end before."""

    message_id: str
    parent: str
    lite: str
    end: int

    def text(self) -> str:
        return json.dumps([self.message_id, self.parent, self.lite, self.end])


UNKNOWN: Final = Planned("", "", "", 0)  # a row whose text does not read: its resend is stored again, under a new id


def planned_of(text: str) -> Planned | None:
    """A row's message text read back (empty: a row of an older broker, whose message was stored; None too for a
    damaged one, which the caller tells apart by its text)."""
    if not text:
        return None
    try:
        message_id, parent, lite, end = json.loads(text)
        return Planned(str(message_id), str(parent), str(lite), int(end))
    except (ValueError, TypeError):
        return None


def plan(store: Store, message_id: str, parent: str, lite: str, end: int | None = None) -> Planned:
    """Blocking. ``message_id``'s place: its lite topic's end now (the message goes at or after it); ``end``
    given (the topic's end at its owner, another broker), that one."""
    if end is None:
        _, end = store.queue_offsets(model.QueueId.lmq(parent, lite))
    return Planned(message_id, parent, lite, end)


def end_of(store: Store, parent: str, lite: str) -> int:
    """Blocking. The lite topic's end offset here."""
    _, end = store.queue_offsets(model.QueueId.lmq(parent, lite))
    return end


def was_stored(store: Store, planned: Planned) -> bool:
    """Blocking. Does ``planned``'s lite topic hold its message (from the end it had before, to its end now)."""
    found, _ = find(store, planned.parent, planned.lite, planned.message_id, planned.end)
    return found


def find(  # noqa: PLR0917 (where, what, from where, how far)
    store: Store, parent: str, lite: str, message_id: str, offset: int, limit: int | None = None
) -> tuple[bool, int | None]:
    """Blocking. Is ``message_id`` in the lite topic at or after ``offset`` (found), and where to go on when
    ``limit`` messages were read before its end without finding it (None: read to the end; no limit: all)."""
    queue = model.QueueId.lmq(parent, lite)
    _, end = store.queue_offsets(queue)
    offset = max(offset, 0)
    read = 0
    while offset < end:
        if limit is not None and read >= limit:
            return False, offset
        page = SCAN_PAGE if limit is None else min(SCAN_PAGE, limit - read)
        messages, offset_after = store.read_span(queue, offset, page)
        if any(m.message_id == message_id for m in messages):
            return True, None
        if offset_after <= offset:
            break
        read += offset_after - offset
        offset = offset_after
    return False, None


def crash_point(name: str) -> None:
    if name == _KILL_AT:
        log.warning("LMQ_TEST_KILL_AT=%s: killing this broker process", name)
        os.kill(os.getpid(), signal.SIGKILL)
