"""Subscriptions saved at shutdown, and while the broker runs, come back on the next start."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from durability import fsyncs

from lmq_broker import model
from lmq_broker.dispatch import saved_subscriptions
from lmq_broker.dispatch.testing import GROUP, PARENT, Lite

pytestmark = pytest.mark.asyncio


async def test_save_and_take_round_trip_and_skip_damage(tmp_path: Path) -> None:
    path = tmp_path / saved_subscriptions.FILE_NAME
    records = [saved_subscriptions.ClientRecord("c1", 5, "g", "P", ("%LMQ%$P$a", "%LMQ%$P$b"))]
    saved_subscriptions.save(records, path)
    with path.open("a") as damaged:
        damaged.write('{"client": "half\n')
    assert saved_subscriptions.load(path) == records
    assert saved_subscriptions.load(tmp_path / "never-written") == []


async def test_a_save_is_durable_rename_included(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot is fsynced, renamed over the old one, and the directory fsynced: after a power cut the new
    snapshot is there, not the older one the rename replaced."""
    path = tmp_path / saved_subscriptions.FILE_NAME
    with fsyncs(monkeypatch) as synced:
        saved_subscriptions.save([saved_subscriptions.ClientRecord("c1", 5, "g", "P", ("%LMQ%$P$a",))], path)
    assert synced == [path.with_name(path.name + ".tmp"), Path(f"{tmp_path}/")]


async def test_a_line_that_is_not_utf8_is_skipped_and_the_rest_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / saved_subscriptions.FILE_NAME
    first, second = (saved_subscriptions.ClientRecord(f"c{i}", 5, GROUP, PARENT, (f"%LMQ%$P$t{i}",)) for i in (1, 2))
    saved_subscriptions.save([first], path)
    with path.open("ab") as out:
        out.write(b'{"client": "\xff\xfe"}\n')
    kept = path.read_bytes()
    saved_subscriptions.save([second], tmp_path / "other")
    path.write_bytes(kept + (tmp_path / "other").read_bytes())
    assert saved_subscriptions.load(path) == [first, second]
    assert "1 damaged line(s) skipped" in caplog.text


async def test_restored_clients_receive_what_their_topics_hold(lite: Lite) -> None:
    await lite.send("t1", b"waiting")
    lmq = model.QueueId.lmq(PARENT, "t1").topic
    lite.dispatcher.restore_subscriptions([saved_subscriptions.ClientRecord("back", 5, GROUP, PARENT, (lmq,))])
    assert "back" in lite.dispatcher.subscribers(model.QueueId.lmq(PARENT, "t1"))
    lite.dispatcher.tick()  # the catch-up pass it scheduled
    for _ in range(100):
        got = await lite.receive("back")
        if got:
            break
        await lite.dispatcher.run(lambda: None)  # let the background catch-up task reach the store
    assert [d.message.body for d in got] == [b"waiting"]


async def test_a_record_over_a_lower_limit_is_skipped(lite: Lite) -> None:
    lite.dispatcher.registry.max_pairs = 1
    lite.dispatcher.restore_subscriptions(
        [
            saved_subscriptions.ClientRecord("fits", 5, GROUP, PARENT, ("%LMQ%$P$a",)),
            saved_subscriptions.ClientRecord("too-many", 5, GROUP, PARENT, ("%LMQ%$P$b", "%LMQ%$P$c")),
        ]
    )
    assert lite.dispatcher.subscription_count() == 1


async def test_the_saver_writes_only_changes_and_retries_a_failed_write(tmp_path: Path) -> None:
    state = {"version": 0}
    records = [saved_subscriptions.ClientRecord("c1", 5, GROUP, PARENT, ("%LMQ%$P$a",))]
    path = tmp_path / "missing-dir" / saved_subscriptions.FILE_NAME  # a write fails until the directory exists
    saver = saved_subscriptions.Saver(lambda: state["version"], lambda: records, path, 1000)
    assert not await saver.save_if_changed()
    assert (saver.failures, saver.writes) == (1, 0)
    path.parent.mkdir()
    assert await saver.save_if_changed()  # the first pass writes even with no change: a stale file is replaced
    assert saved_subscriptions.load(path) == records
    assert not await saver.save_if_changed()  # nothing moved: no write
    state["version"] = 1
    records = []
    assert await saver.save_if_changed()
    assert saved_subscriptions.load(path) == []
    assert (saver.failures, saver.writes) == (1, 2)


async def test_a_cancelled_saver_ends_only_after_its_write_so_the_final_save_never_races_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown cancels the saver and then saves once more to the same file: the cancelled write's thread must
    have renamed its temporary file first (it once raced the final save: FileNotFoundError on the rename)."""
    started, release = threading.Event(), threading.Event()
    real_save = saved_subscriptions.save

    def slow_save(records: list[saved_subscriptions.ClientRecord], path: Path) -> None:
        started.set()
        release.wait(10)
        real_save(records, path)

    monkeypatch.setattr(saved_subscriptions, "save", slow_save)
    path = tmp_path / saved_subscriptions.FILE_NAME
    old = [saved_subscriptions.ClientRecord("c1", 5, GROUP, PARENT, ("%LMQ%$P$a",))]
    saver = saved_subscriptions.Saver(lambda: 1, lambda: old, path, 1)
    task = asyncio.create_task(saver.run())
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.2)
    assert not done  # still waiting for its thread
    release.set()
    await asyncio.wait([task])
    assert task.cancelled()
    assert saved_subscriptions.load(path) == old and not path.with_name(path.name + ".tmp").exists()
    real_save([], path)  # the final save, after the cancelled one: it wins
    assert saved_subscriptions.load(path) == []


async def test_the_registry_version_moves_with_subscriptions_not_with_heartbeats(lite: Lite) -> None:
    registry = lite.dispatcher.registry
    before = registry.version
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])
    after_add = registry.version
    assert after_add > before
    await lite.dispatcher.add_lite("c1", GROUP, PARENT, ["t1"])  # already held: nothing to write
    registry.touch("c1", lite.clock())
    assert registry.version == after_add
    await lite.dispatcher.remove_lite("c1", GROUP, PARENT, ["t1"])
    assert registry.version > after_add


async def test_a_live_member_is_offered_a_topic_before_a_restored_one_that_has_not_called(lite: Lite) -> None:
    """A client restored from the data dir may be gone for good (killed with the broker): a new message of a
    topic it shares with a live member of its group goes to the live one, whatever the random start; once the
    restored client calls again it is a member like any other."""
    lmq = model.QueueId.lmq(PARENT, "t1").topic
    lite.dispatcher.restore_subscriptions([saved_subscriptions.ClientRecord("gone", 5, GROUP, PARENT, (lmq,))])
    await lite.dispatcher.add_lite("live", GROUP, PARENT, ["t1"])
    for n in range(10):  # ten random starts: each would pick "gone" with odds 1/2 without the rule
        lite.dispatcher.runtime.rng.seed(n)
        await lite.send("t1", b"m%d" % n)
        (got,) = await lite.receive("live")
        await lite.dispatcher.ack(GROUP, got.receipt_handle)
    state = lite.dispatcher.registry.get("gone")
    assert state is not None and state.restored
    lite.dispatcher.registry.touch("gone", lite.clock())
    assert not state.restored
