"""The task-free waits of replication: ``events.nap`` (the state rows' look, the reconciler) and the in-sync
keeper's ``wait`` (every send at M > 1): woken early, timed out, cancelled, with nothing left behind; and
``nap``'s plain twin for a plain ``asyncio.Event``."""

from __future__ import annotations

import asyncio
import time

import pytest

from lmq_broker.replication import events, insync


@pytest.mark.asyncio
async def test_a_nap_on_signals_ends_when_one_is_set_and_leaves_no_listener() -> None:
    stopping, wake = events.Signal(), events.Signal()
    napping = asyncio.create_task(events.nap(30, stopping, wake))
    await asyncio.sleep(0)
    assert len(wake.listeners) == 1 and len(stopping.listeners) == 1
    wake.set()
    await asyncio.wait_for(napping, 1)
    assert wake.listeners == [] and stopping.listeners == []  # the other signal's listener went with the nap


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", [events.Signal, asyncio.Event], ids=["signals", "plain"])
async def test_a_nap_ends_after_its_timeout_or_at_once_when_an_event_is_set(kind: type[asyncio.Event]) -> None:
    stopping = kind()
    began = time.monotonic()
    await asyncio.wait_for(events.nap(0.05, stopping), 5)
    assert time.monotonic() - began >= 0.04
    assert isinstance(stopping, events.Signal) is (kind is events.Signal)
    if isinstance(stopping, events.Signal):
        assert stopping.listeners == []
    stopping.set()
    began = time.monotonic()
    await asyncio.wait_for(events.nap(30, stopping), 1)
    assert time.monotonic() - began < 1


@pytest.mark.asyncio
async def test_a_nap_with_a_plain_event_among_signals_is_woken_by_either() -> None:
    plain, signal = asyncio.Event(), events.Signal()
    napping = asyncio.create_task(events.nap(30, plain, signal))
    await asyncio.sleep(0.01)
    plain.set()
    await asyncio.wait_for(napping, 1)


@pytest.mark.asyncio
async def test_a_cancelled_nap_leaves_no_listener() -> None:
    wake = events.Signal()
    napping = asyncio.create_task(events.nap(30, wake))
    await asyncio.sleep(0)
    napping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await napping
    assert wake.listeners == []


@pytest.mark.asyncio
async def test_a_keeper_wait_returns_at_its_timeout_and_when_cancelled_leaves_no_waiter() -> None:
    keeper = insync.Keeper(None, 0)  # type: ignore[arg-type]  # ``wait`` needs no lease
    began = time.monotonic()
    await asyncio.wait_for(keeper.wait(0.05, (1, 7)), 5)
    assert time.monotonic() - began >= 0.04
    assert keeper._on.get(1) == []  # the timed-out waiter is gone
    waiting = asyncio.create_task(keeper.wait(30, (1, 8)))
    await asyncio.sleep(0)
    assert len(keeper._on[1]) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert keeper._on[1] == []
    woken = asyncio.create_task(keeper.wait(30, (1, 9)))
    await asyncio.sleep(0)
    keeper._answered(1, 9)  # the member answered for its batch
    await asyncio.wait_for(woken, 1)
