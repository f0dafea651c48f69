"""Where a group starts in a lite topic (OffsetOption on subscribe, or the admin's reset).

A store write the dispatcher runs on its thread pool; kept here as a plain function over the store so the
rules read in one place. (Where given-up messages go is ``dead_letters``.)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lmq_broker import errors, model
from lmq_broker.storage.api import Store


class OffsetPolicy(enum.Enum):
    LAST = "last"  # keep the group's offset
    MIN = "min"
    MAX = "max"
    OFFSET = "offset"
    TAIL_N = "tail_n"  # only moves an offset the group already has (RocketMQ)
    TIMESTAMP = "timestamp"  # accepted and ignored, as RocketMQ 5.5.0 does


@dataclass(frozen=True, slots=True)
class OffsetReset:
    policy: OffsetPolicy
    value: int = 0

    def __post_init__(self) -> None:
        if self.policy in (OffsetPolicy.OFFSET, OffsetPolicy.TAIL_N) and self.value < 0:
            raise errors.InvalidArgument(f"{self.policy.value} must be >= 0", kind="offset")

    @property
    def moves(self) -> bool:
        return self.policy not in (OffsetPolicy.LAST, OffsetPolicy.TIMESTAMP)


def reset(
    store: Store, lmqs: Iterable[str], group: str, option: OffsetReset, ends: Sequence[int] | None = None
) -> list[tuple[model.QueueId, str, int]]:
    """Blocking: commit the group's new start in each LMQ, clamped to what the queue holds; returns the
    (queue, group, start) committed. ``ends`` (with
    ``MAX``): each LMQ's end as read earlier, the start instead of its end now (what was stored since stays
    to be delivered: an MQTT subscription starts where its broker read the ends, not later)."""
    if ends is not None and option.policy is OffsetPolicy.MAX:  # each end read earlier, at most the queue's now
        rows = [(model.QueueId(lmq), group, end) for lmq, end in zip(lmqs, ends, strict=True)]
        return store.commit_offsets(rows, capped=True)  # each queue read once, in the write
    commits: list[tuple[model.QueueId, str, int]] = []
    for lmq in lmqs:
        queue = model.QueueId(lmq)
        lo, hi = store.queue_offsets(queue)
        if option.policy is OffsetPolicy.MIN:
            target = lo
        elif option.policy is OffsetPolicy.MAX:
            target = hi
        elif option.policy is OffsetPolicy.OFFSET:
            target = option.value
        elif option.policy is OffsetPolicy.TAIL_N and store.get_offset(queue, group) is not None:
            target = hi - option.value
        else:
            continue
        commits.append((queue, group, min(max(target, lo), hi)))
    return store.commit_offsets(commits)  # one write for them all
