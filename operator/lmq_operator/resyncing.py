"""Drift repair for every resource from one loop, instead of one kopf timer per resource.

A kopf timer is a task per resource, and kopf keeps that resource's whole last-seen body for it (managed
fields, the diff-base annotation and all) for as long as the resource lives: at 10,000 resources those
bodies and tasks were most of the operator's memory, and 10,000 tasks woke up on their own schedules. Here
one task makes a *pass* every interval over the resources the operator's index knows, starting their
resyncs evenly spread over the interval with at most ``concurrency`` running at once, so the load on the
brokers and the apiserver is as flat as the timers' random start made it. The index keeps each resource
as a few hundred bytes of compact JSON (``compact``), not its body.

Besides the paced passes, ``sweep`` visits resources at once (a broker that lost or never had them, a drain
that started or ended): the same per-resource work, as fast as ``concurrency`` allows.

Pure scheduling and a pure projection: no kopf, no I/O; handlers.py supplies the resources and the resync.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from lmq_operator import model

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY: Final = 20
# What a reconcile reads of a resource: the annotations it obeys, never the bookkeeping of others.
_METADATA: Final = ("name", "namespace", "uid", "generation", "creationTimestamp", "deletionTimestamp")
_ANNOTATIONS: Final = (model.ANNOTATION_MANAGED, model.ANNOTATION_PAUSED)

Entry = tuple[model.Kind, str]  # (kind, uid)


def compact(body: Mapping[str, Any]) -> bytes:
    """The part of a resource a reconcile reads, as compact JSON: metadata without managedFields or foreign
    annotations, the spec, the status. ``body`` may be kopf's Body, whose parts are mapping views, not dicts."""
    meta = body.get("metadata") or {}
    kept: dict[str, Any] = {key: meta[key] for key in _METADATA if key in meta}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k in _ANNOTATIONS}
    if annotations:
        kept["annotations"] = annotations
    projected = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": kept,
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }
    return json.dumps(projected, separators=(",", ":"), sort_keys=True, default=_plain).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def expand(raw: bytes) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(raw)
    return found


async def run(
    entries: Callable[[], Sequence[Entry]],
    resync: Callable[[model.Kind, str], Awaitable[None]],
    *,
    interval_s: float,
    concurrency: int = DEFAULT_CONCURRENCY,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Pass after pass, forever: the first one an interval after the start (the resume handlers have just
    reconciled everything). A resource created during a pass is visited by the next one; one that is gone by
    its turn is ``resync``'s to skip. A pass that cannot keep up (slow brokers) is followed by the next at
    once, never by two at a time."""
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def one(kind: model.Kind, uid: str) -> None:
        try:
            await resync(kind, uid)
        except Exception:  # one resource's trouble never stops the loop
            log.exception("resync of %s %s failed", kind.value, uid)
        finally:
            slots.release()

    try:
        await sleep(interval_s)
        while True:
            started = clock()
            todo = list(entries())
            for i, (kind, uid) in enumerate(todo):
                wait = started + interval_s * i / len(todo) - clock()
                if wait > 0:
                    await sleep(wait)
                await slots.acquire()
                task = asyncio.create_task(one(kind, uid))
                running.add(task)
                task.add_done_callback(running.discard)
            rest = started + interval_s - clock()
            if rest > 0:
                await sleep(rest)
    finally:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def sweep(
    entries: Iterable[Entry],
    visit: Callable[[model.Kind, str], Awaitable[None]],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> None:
    """``visit`` every entry once, now, at most ``concurrency`` at a time, in the order given (callers put
    ParentTopics before the groups bound to them); one entry's failure is logged and never stops the others."""
    todo = iter(entries)

    async def worker() -> None:
        for kind, uid in todo:  # the workers share one iterator: each entry is taken once
            try:
                await visit(kind, uid)
            except Exception:
                log.exception("visit of %s %s failed", kind.value, uid)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
