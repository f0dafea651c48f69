"""The copy of one stored batch, as one replica call carries it (pure: bytes in, bytes out).

Two layouts, told apart by the first byte; ``decode`` reads both, whoever sent them.

*Binary* (``encode``, the copy path's): ``FF 02``, then ``slot`` (u32), ``epoch`` (u64), the number of messages
(u32) and of commit points (u32), all big-endian; then each message: a head ``type`` (u8), ``present`` (u8: 1
lite topic, 2 tag, 4 message group; absent is None), ``born`` (i64 ms), ``ep`` (u64: the epoch it was stored
in), ``sl`` (i32: the ring slot its topic was placed on, -1 when not recorded), the body's size (u32), the text
block's size in bytes (u32), and the counts of queues, offsets, keys and properties (u16 each); then the
code-point length (u32) of each text (id, topic, lite, host, tag, group, each queue's topic, each key, each
property's name and value), each queue's id (u32) and each offset (i64: the owner's queue offsets); then the
text block (every text back to back, UTF-8, lone surrogates passed through) and the body. Then each commit
point: ``queue`` (u32), ``offset`` (i64), the number of acked offsets (u32), the code-point lengths of its topic
and group (u32 each), its text block's size (u32), its hand-outs' ``mark`` (i64) and number of counted offsets
(u32; ``model.Handouts``), the acked offsets (i64 each), the counted ones as (offset, attempts) pairs (i64
each), and the block. Why the lengths are in code points: a message's texts are decoded in one call and cut
apart.

*JSON* (``encode_json``, the plain twin and what a broker of an older version reads): a 4-byte big-endian
length, a JSON header ``{"slot", "epoch", "messages": [fields…], "commits": […]}`` where each message's fields
are those of ``model.NewMessage`` without the body (``ep``: the epoch it was stored in; ``sl``: the ring slot
its topic was placed on, -1 or absent when not recorded) plus ``offsets`` (the owner's queue offsets), and each
commit is ``[topic, queue, group, offset, [acked above it…]]`` (a consumer group's commit point as persisted by
the owner), and, when any commit carries hand-outs, ``"handouts"``: per commit ``[mark, [[offset, attempts]…]]``
(a key an older decoder passes over); then every body, back to back, in order (their lengths are in the
header). Its first byte is 0 for any header under 16 MiB (a call carries 64 MiB at most), never ``FF``.

Measured (bench/RESULTS.md, 2026-11-29): JSON cost the owner ~17 µs and the follower ~10 µs per message in a
quiet micro-benchmark and ~10 % of a follower's samples under load; binary is the copy path's since then.
"""

from __future__ import annotations

import bisect
import functools
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from lmq_broker import errors, model

_LEN: Final = struct.Struct(">I")
MAGIC: Final = 0xFF
BINARY: Final = 2  # the binary layout's version (the byte after ``MAGIC``)
_HEAD: Final = struct.Struct(">BBIQII")  # magic, version, slot, epoch, messages, commits
# type, present, born, ep, body, block, queues, offsets, keys, props, then the lengths of the six texts every
# message has
_MESSAGE: Final = struct.Struct(">BBqQiIIHHHH6I")
_COMMIT: Final = struct.Struct(">IqIIIIqI")  # queue, offset, acked, topic and group lengths, block, mark, counts
_LITE, _TAG, _GROUP = 1, 2, 4
_TEXTS: Final = 6  # id, topic, lite, host, tag, group: then queue topics, keys, properties


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


def acked_below(acked: tuple[int, ...], end: int) -> tuple[int, ...]:
    """The offsets acked above a commit point that lie below ``end``, a queue's end at a replica (ascending, as a
    store keeps them). One at or past it names a record that replica does not hold: stored there, it would settle
    whatever the replica stores at that offset later (as the slot's next holder: an acknowledged send, never
    delivered)."""
    if not acked or acked[-1] < end:
        return acked
    return acked[: bisect.bisect_left(acked, end)]


def is_binary(data: bytes) -> bool:
    return data[:1] == b"\xff"


def encode(
    slot: int,
    epoch: int,
    messages: Sequence[model.NewMessage],
    results: Sequence[model.AppendResult],
    commits: Sequence[Commit] = (),
) -> bytes:
    """The binary layout (a follower of an older version gets ``as_json`` of it)."""
    parts = [_HEAD.pack(MAGIC, BINARY, slot, epoch, len(messages), len(commits))]
    for m, r in zip(messages, results, strict=True):
        _message(parts, m, r.queue_offsets)
    for c in commits:
        block = (c.queue.topic + c.group).encode("utf-8", "surrogatepass")
        h = c.handouts
        head = _COMMIT.pack(
            c.queue.queue, c.offset, len(c.acked), len(c.queue.topic), len(c.group), len(block), h.mark, len(h.counts)
        )
        counted = [n for pair in h.counts for n in pair]
        parts += [head, _numbers(0, 0, len(c.acked) + len(counted)).pack(*c.acked, *counted), block]
    return b"".join(parts)


def _message(parts: list[bytes], m: model.NewMessage, offsets: tuple[int, ...]) -> None:
    lite, tag, group = m.lite_topic, m.tag, m.message_group
    present = (lite is not None) * _LITE | (tag is not None) * _TAG | (group is not None) * _GROUP
    props = m.user_properties
    fixed = (m.message_id, m.topic, lite or "", m.born_host, tag or "", group or "")
    texts = [q.topic for q in m.queues]
    texts += m.keys
    for k, v in props.items():
        texts += (k, v)
    block = "".join((*fixed, *texts)).encode("utf-8", "surrogatepass")
    queues = len(m.queues)
    head = _MESSAGE.pack(
        int(m.message_type), present, m.born_timestamp_ms, m.epoch, m.slot, len(m.body), len(block), queues,
        len(offsets), len(m.keys), len(props), *map(len, fixed),
    )  # fmt: skip
    numbers = _numbers(len(texts), queues, len(offsets)).pack(*map(len, texts), *(q.queue for q in m.queues), *offsets)
    parts += [head, numbers, block, m.body]


@functools.lru_cache(maxsize=256)
def _numbers(texts: int, queues: int, offsets: int) -> struct.Struct:
    return struct.Struct(f">{texts + queues}I{offsets}q")


_TYPES: Final = {int(t): t for t in model.MessageType}


def _decode_binary(data: bytes) -> Copy:
    _, version, slot, epoch, count, points = _HEAD.unpack_from(data)
    if version != BINARY:
        raise ValueError(f"copy layout {version} is not known here")
    pos = _HEAD.size
    messages: list[model.NewMessage] = []
    offsets: list[tuple[int, ...]] = []
    append, unpack_head, head_size, types = messages.append, _MESSAGE.unpack_from, _MESSAGE.size, _TYPES
    for _ in range(count):
        mtype, present, born, ep, sl, size, block, nq, no, nk, np_, l0, l1, l2, l3, l4, l5 = unpack_head(data, pos)
        pos += head_size
        nv = nq + nk + 2 * np_
        numbers = _numbers(nv, nq, no)
        nums = numbers.unpack_from(data, pos)
        pos += numbers.size
        end = pos + block
        text = data[pos:end].decode("utf-8", "surrogatepass")
        body = data[end : end + size]
        pos = end + size
        a = l0 + l1
        b = a + l2
        c = b + l3
        d = c + l4
        e = d + l5
        texts = []
        at = e
        for n in nums[:nv]:
            texts.append(text[at : at + n])
            at += n
        if at != len(text) or len(body) != size:
            raise ValueError("a message's texts or body do not fill it")
        kt = texts[nq : nq + nk]
        pt = texts[nq + nk :]
        append(
            model.NewMessage(
                message_id=text[:l0],
                topic=text[l0:a],
                body=body,
                queues=tuple(map(model.QueueId, texts[:nq], nums[nv : nv + nq])),
                lite_topic=text[a:b] if present & _LITE else None,
                message_type=types[mtype],
                born_timestamp_ms=born,
                born_host=text[b:c],
                tag=text[c:d] if present & _TAG else None,
                keys=tuple(kt),
                message_group=text[d:e] if present & _GROUP else None,
                user_properties=dict(zip(pt[::2], pt[1::2], strict=True)) if np_ else {},
                epoch=ep,
                slot=sl,
            )
        )
        offsets.append(nums[nv + nq :])
    commits = _commits(data, pos, points)
    return Copy(slot, epoch, messages, offsets, commits)


def _commits(data: bytes, pos: int, points: int) -> list[Commit]:
    commits: list[Commit] = []
    for _ in range(points):
        queue, offset, n, lt, lg, block, mark, nc = _COMMIT.unpack_from(data, pos)
        pos += _COMMIT.size
        numbers = _numbers(0, 0, n + 2 * nc)
        values = numbers.unpack_from(data, pos)
        pos += numbers.size
        acked, counted = values[:n], values[n:]
        handouts = model.Handouts(mark, tuple(zip(counted[::2], counted[1::2], strict=True)))
        text = data[pos : pos + block].decode("utf-8", "surrogatepass")
        pos += block
        if len(text) != lt + lg:
            raise ValueError("a commit point's texts do not fill its block")
        commits.append(Commit(model.QueueId(text[:lt], queue), text[lt:], offset, acked, handouts))
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} bytes past the last record")
    return commits


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
        "sl": m.slot,
    }


def encode_json(
    slot: int,
    epoch: int,
    messages: Sequence[model.NewMessage],
    results: Sequence[model.AppendResult],
    commits: Sequence[Commit] = (),
) -> bytes:
    """The JSON layout: the plain twin, and what a follower of an older version reads."""
    return _json(slot, epoch, messages, [r.queue_offsets for r in results], commits)


def _json(
    slot: int,
    epoch: int,
    messages: Sequence[model.NewMessage],
    offsets: Sequence[tuple[int, ...]],
    commits: Sequence[Commit],
) -> bytes:
    listed = [_fields(m, o) for m, o in zip(messages, offsets, strict=True)]
    points = [[c.queue.topic, c.queue.queue, c.group, c.offset, list(c.acked)] for c in commits]
    value: dict[str, Any] = {"slot": slot, "epoch": epoch, "messages": listed, "commits": points}
    if any(c.handouts.mark for c in commits):
        value["handouts"] = [[c.handouts.mark, [list(n) for n in c.handouts.counts]] for c in commits]
    head = json.dumps(value, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, *(m.body for m in messages)))


def as_json(data: bytes) -> bytes:
    """A copy in the JSON layout (for a follower of an older version): ``data`` itself when it is already."""
    if not is_binary(data):
        return data
    copy = decode(data)
    return _json(copy.slot, copy.epoch, copy.messages, copy.offsets, copy.commits)


def decode(data: bytes) -> Copy:
    try:
        if is_binary(data):
            return _decode_binary(data)
        return _decode_json(data)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise errors.InvalidArgument(f"unreadable replica copy: {exc}") from None


def _decode_json(data: bytes) -> Copy:
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
                slot=int(f.get("sl", -1)),
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
