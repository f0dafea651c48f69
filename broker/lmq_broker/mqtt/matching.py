"""What a broker does for an MQTT subscription over the lite topics and retained messages it holds: used by
its own sessions (``connection``) and, in a cluster, for the sessions of other brokers (the admin service's
``MqttStartAtEnd`` and ``MqttRetained``, docs/mqtt.md "In a cluster")."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

from lmq_broker import model
from lmq_broker.dispatch import offsets, wildcards
from lmq_broker.mqtt import durable, mapping, topics

PAGE: Final = 512
RETAINED_LIMIT: Final = 10_000  # retained messages one broker answers for one filter
Scan = Callable[[str, str, str, int], Awaitable[Sequence[model.LiteTopicMeta]]]  # ``Store.scan_lite_topics``
Run = Callable[..., Awaitable[Any]]  # ``Dispatcher.run``: a blocking call on the store's worker threads
Indexed = Callable[[Sequence[wildcards.Filter]], Awaitable[Sequence[model.LiteTopicMeta] | None]]
Reset = Callable[
    [str, str, Sequence[str], offsets.OffsetReset, Sequence[int] | None], Awaitable[None]
]  # ``LiveView.reset_offsets``, with ``copy_later`` (``later``)


def later(reset: Callable[..., Awaitable[None]]) -> Reset:
    """``reset`` (``LiveView.reset_offsets``) as an MQTT start at the end calls it: with ``copy_later``, so a
    SUBSCRIBE is not refused because too few in-sync replicas stored the start (its new filters would be dropped,
    and MQTT clients do not subscribe again); the start is copied to them later (docs/replication.md)."""
    return functools.partial(reset, copy_later=True)


async def start_at_end(  # noqa: PLR0917 (where, whose, which)
    scan: Scan,
    reset: Reset,
    group: str,
    parent: str,
    new: Sequence[wildcards.Filter],
    older: Sequence[wildcards.Filter],
    *,
    default: str = "",
    indexed: Indexed | None = None,
) -> int:
    """The group's start in each existing lite topic that only the ``new`` filters match: its end as the scan
    read it (what it held was published before the subscription; what is stored from then on, also while the
    SUBACK is on its way, is delivered). Pages over the range those filters can match; returns how many lite
    topics moved. In the ``default`` parent hashed names match no level filter: the session takes them all from
    its first filter there on (``topics.registered``), so they start at their ends then."""
    if parent == default:
        new, older = (new, [*older, topics.HASHED]) if older else ([*new, topics.HASHED], older)
    lites: list[str] = []
    ends: list[int] = []
    found = None if indexed is None else await indexed(new)  # ``Dispatcher.lite_topics_matching``
    if found is not None:  # no literal prefix: the parent's level index, not a walk of the whole parent
        for meta in found:
            if meta.max_offset > meta.min_offset and not _any(older, meta.lite):
                lites.append(meta.lite)
                ends.append(meta.max_offset)
    else:
        await _scan_new(scan, parent, new, older, lites, ends)
    for i in range(0, len(lites), PAGE):
        await reset(
            group, parent, lites[i : i + PAGE], offsets.OffsetReset(offsets.OffsetPolicy.MAX), ends[i : i + PAGE]
        )
    return len(lites)


async def _scan_new(  # noqa: PLR0917 (how, where, which, into)
    scan: Scan,
    parent: str,
    new: Sequence[wildcards.Filter],
    older: Sequence[wildcards.Filter],
    lites: list[str],
    ends: list[int],
) -> None:
    """The plain twin of the level index: every lite name in the range of ``new``, tested against each filter."""
    start_after, end_before = wildcards.scan_range(new)
    while True:
        page = await scan(parent, start_after, end_before, PAGE)
        for meta in page:
            if meta.max_offset > meta.min_offset and _any(new, meta.lite) and not _any(older, meta.lite):
                lites.append(meta.lite)
                ends.append(meta.max_offset)
        if len(page) < PAGE:
            return
        start_after = page[-1].lite


def _any(filters: Sequence[wildcards.Filter], lite: str) -> bool:
    levels = lite.split(wildcards.LEVEL_SEPARATOR)
    return any(wildcards.matches(f, levels) for f in filters)


def retained(  # noqa: PLR0917 (where, which, when, how many)
    store: durable.Durable,
    parent: str,
    levels: wildcards.Filter,
    now_ms: int,
    limit: int | None = None,
    tombstones: bool = False,
    default: str = "",
) -> tuple[list[durable.Retained], bool]:
    """The retained messages ``store`` holds that ``levels`` matches and that have not expired, at most
    ``limit`` (None: all); and whether more matched; ``tombstones``: clears kept in a cluster too (an empty payload).
    Blocking (run on the dispatcher's pool)."""
    start_after, end_before = wildcards.scan_range(topics.registered(default, parent, [levels]))
    found: list[durable.Retained] = []
    for r in store.retained_between(parent, start_after, end_before):
        if (
            (r.payload or tombstones)
            and topics.takes(default, parent, levels, r.lite, r.properties)
            and not mapping.expired(r.properties, now_ms)
        ):
            if limit is not None and len(found) >= limit:
                return found, True
            found.append(r)
    return found, False


async def stream_retained(  # noqa: PLR0917 (how, where, which, when, and the cluster's)
    run: Run,
    store: durable.Durable,
    parent: str,
    levels: wildcards.Filter,
    now_ms: int,
    elsewhere: Sequence[durable.Retained] | None = None,
    *,
    default: str = "",
) -> AsyncIterator[durable.Retained]:
    """The retained messages ``levels`` matches, one at a time, in topic order: their keys read a page at a
    time, each payload only when its turn comes (a subscriber sending them at the pace its client reads holds
    one). ``elsewhere`` (in a cluster): the other brokers' retained messages; per topic the newest wins, a
    newest clear leaves none (this broker's keys are then all read first, without payloads)."""
    if elsewhere is None:
        async for key in _retained_keys(run, store, parent, levels, now_ms, tombstones=False, default=default):
            one = await run(store.retained_one, parent, key.lite)
            if one is not None and one.payload:
                yield one
        return
    newest = {r.lite: r for r in elsewhere}
    mine: set[str] = set()
    async for key in _retained_keys(run, store, parent, levels, now_ms, tombstones=True, default=default):
        if key.lite not in newest or newest[key.lite].stored_ms < key.stored_ms:
            newest[key.lite] = key
            mine.add(key.lite)
    for lite in sorted(newest):
        r = newest[lite]
        if lite in mine and r.payload:
            r = await run(store.retained_one, parent, lite) or durable.Retained(parent, lite, b"", 0, 0)
        if r.payload:
            yield r


async def _retained_keys(
    run: Run,
    store: durable.Durable,
    parent: str,
    levels: wildcards.Filter,
    now_ms: int,
    *,
    tombstones: bool,
    default: str,
) -> AsyncIterator[durable.Retained]:
    start_after, end_before = wildcards.scan_range(topics.registered(default, parent, [levels]))
    while True:
        page: list[durable.Retained] = await run(store.retained_keys, parent, start_after, end_before, PAGE)
        for r in page:
            if (
                (r.payload or tombstones)
                and topics.takes(default, parent, levels, r.lite, r.properties)
                and not mapping.expired(r.properties, now_ms)
            ):
                yield r
        if len(page) < PAGE:
            return
        start_after = page[-1].lite
