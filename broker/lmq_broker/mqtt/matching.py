"""What a broker does for an MQTT subscription over the lite topics and retained messages it holds: used by
its own sessions (``connection``) and, in a cluster, for the sessions of other brokers (the admin service's
``MqttStartAtEnd`` and ``MqttRetained``, docs/mqtt.md "In a cluster")."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from lmq_broker import model
from lmq_broker.dispatch import offsets, wildcards
from lmq_broker.mqtt import durable, mapping

PAGE: Final = 512
RETAINED_LIMIT: Final = 10_000  # retained messages one broker answers for one filter
Scan = Callable[[str, str, str, int], Awaitable[Sequence[model.LiteTopicMeta]]]  # ``Store.scan_lite_topics``
Reset = Callable[[str, str, Sequence[str], offsets.OffsetReset], Awaitable[None]]  # ``LiveView.reset_offsets``


async def start_at_end(  # noqa: PLR0917 (where, whose, which)
    scan: Scan,
    reset: Reset,
    group: str,
    parent: str,
    new: Sequence[wildcards.Filter],
    older: Sequence[wildcards.Filter],
) -> int:
    """The group's start in each existing lite topic that only the ``new`` filters match: its end (what it
    holds was published before the subscription). Pages over the range those filters can match; returns how
    many lite topics moved."""
    start_after, end_before = wildcards.scan_range(new)
    lites: list[str] = []
    while True:
        page = await scan(parent, start_after, end_before, PAGE)
        for meta in page:
            levels = meta.lite.split(wildcards.LEVEL_SEPARATOR)
            if (
                meta.max_offset > meta.min_offset
                and any(wildcards.matches(f, levels) for f in new)
                and not any(wildcards.matches(f, levels) for f in older)
            ):
                lites.append(meta.lite)
        if len(page) < PAGE:
            break
        start_after = page[-1].lite
    for i in range(0, len(lites), PAGE):
        await reset(group, parent, lites[i : i + PAGE], offsets.OffsetReset(offsets.OffsetPolicy.MAX))
    return len(lites)


def retained(  # noqa: PLR0917 (where, which, when, how many)
    store: durable.Durable,
    parent: str,
    levels: wildcards.Filter,
    now_ms: int,
    limit: int | None = None,
    tombstones: bool = False,
) -> tuple[list[durable.Retained], bool]:
    """The retained messages ``store`` holds that ``levels`` matches and that have not expired, at most
    ``limit`` (None: all); and whether more matched; ``tombstones``: clears kept in a cluster too (an empty payload).
    Blocking (run on the dispatcher's pool)."""
    start_after, end_before = wildcards.scan_range([levels])
    found: list[durable.Retained] = []
    for r in store.retained_between(parent, start_after, end_before):
        if (
            (r.payload or tombstones)
            and wildcards.matches(levels, r.lite.split(wildcards.LEVEL_SEPARATOR))
            and not mapping.expired(r.properties, now_ms)
        ):
            if limit is not None and len(found) >= limit:
                return found, True
            found.append(r)
    return found, False
