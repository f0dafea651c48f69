"""The copy of one stored batch, as one replica call carries it (pure: bytes in, bytes out).

Layout: a 4-byte big-endian length, a JSON header ``{"slot", "epoch", "messages": [fields…], "commits": […]}``
where each message's fields are those of ``model.NewMessage`` without the body (``ep``: the epoch it was
stored in) plus ``offsets`` (the owner's queue offsets), and each commit is ``[topic, queue, group, offset,
[acked above it…]]`` (a consumer group's commit point as persisted by the owner), and, when any commit carries
hand-outs, ``"handouts"``: per commit ``[mark, [[offset, attempts]…]]`` (``model.Handouts``; a key an older
decoder passes over); then every body, back to back, in order (their lengths are in the header).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from lmq_broker import errors, model

_LEN: Final = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class Copy:
    slot: int
    epoch: int
    messages: list[model.NewMessage]
    offsets: list[tuple[int, ...]]  # per message: the owner's offsets in its queues
    commits: list[Commit] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Commit:
    queue: model.QueueId
    group: str
    offset: int
    acked: tuple[int, ...]
    handouts: model.Handouts = model.NO_HANDOUTS  # delivery attempts above the point (``dispatch.leases``)


def _fields(m: model.NewMessage, offsets: tuple[int, ...]) -> dict[str, Any]:
    return {
        "id": m.message_id,
        "topic": m.topic,
        "size": len(m.body),
        "queues": [[q.topic, q.queue] for q in m.queues],
        "lite": m.lite_topic,
        "type": int(m.message_type),
        "born": m.born_timestamp_ms,
        "host": m.born_host,
        "tag": m.tag,
        "keys": list(m.keys),
        "group": m.message_group,
        "props": m.user_properties,
        "offsets": list(offsets),
        "ep": m.epoch,
    }


def encode(
    slot: int,
    epoch: int,
    messages: Sequence[model.NewMessage],
    results: Sequence[model.AppendResult],
    commits: Sequence[Commit] = (),
) -> bytes:
    listed = [_fields(m, r.queue_offsets) for m, r in zip(messages, results, strict=True)]
    points = [[c.queue.topic, c.queue.queue, c.group, c.offset, list(c.acked)] for c in commits]
    value: dict[str, Any] = {"slot": slot, "epoch": epoch, "messages": listed, "commits": points}
    if any(c.handouts.mark for c in commits):
        value["handouts"] = [[c.handouts.mark, [list(n) for n in c.handouts.counts]] for c in commits]
    head = json.dumps(value, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, *(m.body for m in messages)))


def decode(data: bytes) -> Copy:
    try:
        (n,) = _LEN.unpack_from(data)
        head = json.loads(data[4 : 4 + n])
        pos = 4 + n
        messages: list[model.NewMessage] = []
        offsets: list[tuple[int, ...]] = []
        for f in head["messages"]:
            body = data[pos : pos + f["size"]]
            pos += f["size"]
            messages.append(
                model.NewMessage(
                    message_id=f["id"],
                    topic=f["topic"],
                    body=body,
                    queues=tuple(model.QueueId(t, q) for t, q in f["queues"]),
                    lite_topic=f["lite"],
                    message_type=model.MessageType(f["type"]),
                    born_timestamp_ms=f["born"],
                    born_host=f["host"],
                    tag=f["tag"],
                    keys=tuple(f["keys"]),
                    message_group=f["group"],
                    user_properties=dict(f["props"]),
                    epoch=int(f.get("ep", 0)),
                )
            )
            offsets.append(tuple(f["offsets"]))
        if pos != len(data):
            raise ValueError(f"{len(data) - pos} bytes past the last body")
        listed_commits = head.get("commits", ())
        handouts = [model.Handouts(int(mark), tuple((int(o), int(n)) for o, n in counts))
                    for mark, counts in head.get("handouts", ())]  # fmt: skip
        handouts += [model.NO_HANDOUTS] * (len(listed_commits) - len(handouts))
        commits = [
            Commit(model.QueueId(topic, int(queue)), group, int(offset), tuple(acked), h)
            for (topic, queue, group, offset, acked), h in zip(listed_commits, handouts, strict=True)
        ]
        return Copy(int(head["slot"]), int(head["epoch"]), messages, offsets, commits)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise errors.InvalidArgument(f"unreadable replica copy: {exc}") from None
