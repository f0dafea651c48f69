"""Tag filters: which messages a consumer's subscription takes, decided when they are read.

A filter is applied where a group's messages are handed out (``delivery``), not where they are written: the
store keeps one queue per topic whatever the subscriptions, and a message a group's filter does not take is
settled for that group as if it were consumed (RocketMQ does the same), so the group's lag does not grow and
its commit point passes the message in order. Only TAG expressions exist here: SQL92 needs message
properties evaluated per group, which this broker does not do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from lmq_broker import errors, model
from lmq_broker.dispatch import leases

SUB_ALL: Final = "*"
MAX_EXPRESSION_CHARS: Final = 4096


@dataclass(frozen=True, slots=True)
class TagFilter:
    """``tags`` None takes every message; otherwise only messages whose tag is one of ``tags`` (a message
    without a tag is taken by ``*`` alone)."""

    tags: frozenset[str] | None = None

    @property
    def takes_all(self) -> bool:
        return self.tags is None

    def matches(self, tag: str | None) -> bool:
        return self.tags is None or (tag is not None and tag in self.tags)


ALL: Final = TagFilter()


def parse_tags(expression: str) -> TagFilter:
    """``*`` (or blank) takes everything; ``a || b`` takes tags a and b. Blanks around names and empty names
    are ignored, and a ``*`` among the names takes everything. A name with ``|`` left in it (``a | b``) is
    refused: no tag can hold one, so it would silently take nothing."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise errors.InvalidArgument(f"filter expression longer than {MAX_EXPRESSION_CHARS} characters", kind="filter")
    names = {name for part in expression.split("||") if (name := part.strip())}
    if not names or SUB_ALL in names:
        return ALL
    if any("|" in name for name in names):
        raise errors.InvalidArgument(f"bad tag expression {expression!r}: tags are joined by '||'", kind="filter")
    return TagFilter(frozenset(names))


def split(
    picks: list[leases.Pick], messages: Mapping[int, model.StoredMessage], tags: TagFilter
) -> tuple[list[leases.Pick], list[leases.Pick]]:
    """(picks to go on with, picks whose message ``tags`` does not take). A pick without its message read
    stays with the first: the caller decides what a missing message means."""
    kept: list[leases.Pick] = []
    passed: list[leases.Pick] = []
    for pick in picks:
        message = messages.get(pick.offset)
        (kept if message is None or tags.matches(message.tag) else passed).append(pick)
    return kept, passed
