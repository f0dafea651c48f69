"""A lite topic's slot is recorded on its records and read back, not computed from today's ring
(docs/replication.md, *Changing the ring with R > 1*, step 1): ``replication.owning.Slots`` over both stores,
and the copy format. Two brokers on the real apiserver stamping and copying it: ``test_replication.py``,
``test_the_owner_and_its_follower_record_each_topics_slot``."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from lmq_broker import errors, model
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import owners
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.replication import moved, owning, sources, stamps, wire
from lmq_broker.storage import memory
from lmq_broker.storage import store as lmq_store
from lmq_broker.storage.api import Store

PARENT = "P"


@dataclass
class Held:
    """The part of ``Leadership`` that ``Slots`` reads: this broker's slot and the leases it holds (epochs)."""

    me: int
    epochs: dict[int, int] = field(default_factory=dict)

    def holds(self, slot: int) -> bool:
        return slot in self.epochs

    def epoch(self, slot: int) -> int | None:
        return self.epochs.get(slot)


@dataclass
class Door:
    """A ``copies.Owner`` as far as admitting goes: fenced unless its slot's lease is held."""

    held: Held
    slot: int

    def admit(self) -> None:
        if not self.held.holds(self.slot):
            raise errors.Fenced(f"this broker does not hold the lease of slot {self.slot} now")

    async def copy(self, messages: Sequence[model.NewMessage], results: Sequence[model.AppendResult]) -> None:
        """No followers here: the batch is stored on this broker only."""


def slots_over(store: Store, held: Held, ring: Callable[[str], int]) -> owning.Slots:
    leadership: Any = held  # the Protocol-less seam: Slots reads only me, holds and epoch
    make: Any = lambda slot: Door(held, slot)  # noqa: E731
    return owning.Slots(leadership, ring, make, lambda topic: sources.recorded_slot(store, topic))


def lite(name: str, n: int = 0) -> model.NewMessage:
    return dispatch_testing.lite_message(name, f"{name}/{n}".encode(), parent=PARENT, message_id=f"{name}-{n}")


def lmq(name: str) -> str:
    return model.QueueId.lmq(PARENT, name).topic


@pytest.fixture(params=["lmq", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    config = dispatch_testing.config_for(tmp_path / "data").store
    if request.param == "memory":
        return memory.MemoryStore(config, memory.ManualClock())
    opened = lmq_store.open_store(config)
    request.addfinalizer(opened.close)
    return opened


def append(store: Store, messages: Sequence[model.NewMessage]) -> None:
    store.append(list(messages))


def test_a_topic_placed_on_an_older_slot_keeps_it_whatever_the_holder_holds(store: Store) -> None:
    """The fact-3 trace's crux, on one broker: topic T's ring slot today is 2, it was placed on slot 1 (its
    records say so). The broker holds slots 1 and 2 (it took 1 over): T is filed under 1, not under 2; once it
    loses slot 1 a send of T is fenced, never taken under slot 2 (its own)."""
    held = Held(me=2, epochs={1: 4, 2: 0})
    append(store, [dataclasses.replace(lite("T"), slot=1, epoch=3)])
    slots = slots_over(store, held, lambda topic: 2)
    assert slots.slot_of_topic(lmq("T")) == 1
    (stamped,) = slots.admit([lite("T", 1)])
    assert (stamped.slot, stamped.epoch) == (1, 4)
    assert sources.ends(store, 1, slots.slot_of_topic) == {lmq("T"): 1}
    assert sources.ends(store, 2, slots.slot_of_topic) == {}
    del held.epochs[1]
    with pytest.raises(errors.Fenced):
        slots.admit([lite("T", 2)])
    fresh = slots_over(store, held, lambda topic: 2)  # nothing remembered: read from the store
    with pytest.raises(errors.Fenced):
        fresh.admit([lite("T", 2)])


def test_a_topic_without_records_takes_todays_ring_and_keeps_it_once_stored(store: Store) -> None:
    held = Held(me=0, epochs={0: 2, 1: 5})
    slots = slots_over(store, held, lambda topic: 1)
    assert slots.recorded(lmq("U")) == -1
    (stamped,) = slots.admit([lite("U")])
    assert (stamped.slot, stamped.epoch) == (1, 5)
    append(store, [stamped])
    assert slots.slot_of_topic(lmq("U")) == 1
    assert slots_over(store, held, lambda topic: 0).slot_of_topic(lmq("U")) == 1  # another ring: stays on 1
    assert sources.recorded_slot(store, lmq("U")) == 1


def test_records_from_before_slots_were_recorded_keep_the_rule_of_todays_ring(store: Store) -> None:
    """No slot on a topic's records (stored by an older version): its ring slot when held, else this broker's."""
    append(store, [lite("V")])
    held = Held(me=0, epochs={0: 1})
    slots = slots_over(store, held, lambda topic: 1)
    assert slots.recorded(lmq("V")) == -1
    assert slots.slot_of_topic(lmq("V")) == 0
    assert slots.followed_slot(lmq("V")) == 1
    held.epochs[1] = 1
    assert slots.slot_of_topic(lmq("V")) == 1


def test_a_store_is_stamped_while_every_lite_topics_last_record_names_its_slot(store: Store, tmp_path: Path) -> None:
    """What a ring change at R > 1 needs (``stamps``): found by walking the lite topics, then kept in a marker
    file; an unstamped lite record stored since (a copy from an older owner), or a start at R = 1, takes it
    away; a topic whose last record is stamped again counts as stamped."""
    data = tmp_path / "stamps"
    assert stamps.Stamps(store, data).why_fixed() == ""  # empty
    assert (data / stamps.MARKER).exists()
    append(store, [dataclasses.replace(lite(f"s{i}"), slot=i % 2) for i in range(3)])
    append(store, [model.NewMessage("n-1", "N", b"x", (model.QueueId("N", 0),))])  # a normal topic: no slot ever
    (data / stamps.MARKER).unlink()
    assert stamps.first_unstamped(store) is None
    assert stamps.Stamps(store, data).why_fixed() == ""
    append(store, [lite("w")])  # stored at R = 1, or by an older version
    assert stamps.first_unstamped(store) == lmq("w")
    kept = stamps.Stamps(store, data)  # the marker says stamped: no walk at start
    assert kept.why_fixed() == ""
    kept.note(
        [
            dataclasses.replace(lite("s0", 1), slot=0),
            normal := model.NewMessage("n-2", "N", b"x", (model.QueueId("N", 0),)),
        ]
    )
    assert kept.why_fixed() == "" and normal.slot == -1
    kept.note([lite("w")])  # a copy without its slot
    assert lmq("w") in kept.why_fixed() and not (data / stamps.MARKER).exists()
    assert lmq("w") in stamps.Stamps(store, data).why_fixed()  # walked again at the next start
    append(store, [dataclasses.replace(lite("w", 1), slot=1)])  # its last record names its slot now
    assert stamps.Stamps(store, data).why_fixed() == "" and (data / stamps.MARKER).exists()
    stamps.forget(data)  # a start at R = 1
    assert not (data / stamps.MARKER).exists()


def test_a_normal_topics_message_is_not_stamped_with_a_slot(store: Store) -> None:
    held = Held(me=1, epochs={1: 2})
    normal = model.NewMessage("n-1", "N", b"x", (model.QueueId("N", 0),))
    (stamped,) = slots_over(store, held, lambda topic: 0).admit([normal])
    assert (stamped.slot, stamped.epoch) == (-1, 2)


def test_a_normal_topics_message_is_admitted_without_the_lease_but_not_a_lite_one_beside_it(store: Store) -> None:
    """A NORMAL topic's message is its broker's alone (not replicated): admitted whoever holds the broker's slot
    (epoch 0 then). A lite topic's message of that slot in the same batch is still fenced."""
    held = Held(me=1)  # another broker holds slot 1 (a failover)
    normal = model.NewMessage("n-1", "N", b"x", (model.QueueId("N", 0),))
    slots = slots_over(store, held, lambda topic: 1)
    (stamped,) = slots.admit([normal])
    assert (stamped.slot, stamped.epoch) == (-1, 0)
    with pytest.raises(errors.Fenced):
        slots.admit([normal, lite("x")])


def test_a_copy_carries_the_recorded_slot_and_an_older_copy_reads_as_not_recorded() -> None:
    m = dataclasses.replace(lite("x"), slot=3, epoch=9)
    result = model.AppendResult(m.message_id, m.queues, (0, 7), 0)
    for encode in (wire.encode, wire.encode_json):  # binary, and the JSON twin
        (copied,) = wire.decode(encode(3, 9, [m], [result])).messages
        assert copied == m
    data = wire.encode_json(3, 9, [m], [result])
    (n,) = struct.unpack_from(">I", data)
    head = json.loads(data[4 : 4 + n])
    del head["messages"][0]["sl"]  # as a version before recorded slots writes it
    older = json.dumps(head).encode()
    assert wire.decode(struct.pack(">I", len(older)) + older + data[4 + n :]).messages[0].slot == -1


@dataclass
class Asked:
    """``cluster.links.Links`` as ``Owners`` asks peers about a topic: every DescribeLiteTopic lands here."""

    membership: mb.Membership
    me: int
    holding: set[str]  # the members whose store holds the topic
    asked: list[str] = field(default_factory=list)

    def admin(self, endpoint: str, method: str = "") -> tuple[Any, tuple[()]]:
        return _Describer(self, endpoint), ()


@dataclass
class _Describer:
    links: Asked
    endpoint: str

    async def DescribeLiteTopic(self, request: Any, **kw: Any) -> None:  # noqa: N802 (the stub's name)
        self.links.asked.append(self.endpoint)
        if self.endpoint not in self.links.holding:
            raise _NotFound()


class _NotFound(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "no such topic", None)


class _Confirmed:
    async def confirm(self, slots: Any) -> None:
        return None


def moved_topic(membership: mb.Membership) -> str:
    """A lite topic of ``PARENT`` placed on slot 1 by the ring of 2 and on slot 2 by today's ring of 3."""
    return next(
        f"m-{i}"
        for i in range(10_000)
        if mb.candidates(membership, model.QueueId.lmq(PARENT, f"m-{i}").topic) == (2, 1)
    )


@pytest.mark.asyncio
async def test_a_placement_question_about_an_older_slot_goes_to_that_slots_lease_holder() -> None:
    """Slot 1's preferred owner ``b`` is down; slot 1's lease is held by ``a`` (slot 0), which has slot 1's
    topics: asked there, the topic is found on slot 1 (asked of ``b`` it was "unavailable", or "held nowhere" if
    ``b`` came back on an empty disk, and the topic would be created again on slot 2 without its history)."""
    membership = mb.Membership(("a:1", "b:1", "c:1"), (2, 3))
    name = moved_topic(membership)
    links = Asked(membership, 2, holding={"a:1"})
    placed = owners.Owners(cast_links(links), cast_epochs(), lambda slot, parent, lite: _never())
    placed.serving = lambda slot: {1: 0}.get(slot, slot)
    assert await placed.owners(PARENT, [name]) == [0]  # slot 1, served by slot 0's broker
    assert links.asked == ["a:1"]
    here = owners.Owners(cast_links(Asked(membership, 0, holding=set())), cast_epochs(), lambda s, p, lite: _held())
    here.serving = lambda slot: {1: 0}.get(slot, slot)
    assert await here.owners(PARENT, [name]) == [0]  # asked of its own store: it holds slot 1's lease


def cast_epochs() -> Any:
    return _Confirmed()


def cast_links(links: Asked) -> Any:
    return links


async def _never() -> bool:
    raise AssertionError("this broker's store was asked about a slot whose lease another broker holds")


async def _held() -> bool:
    return True


@pytest.mark.asyncio
async def test_a_deleted_topic_is_placed_afresh_when_it_is_created_again(tmp_path: Path) -> None:
    """A lite topic deleted (expiry, the reclaimer: ``forget_lite_topic``) forgets its recorded slot, so a topic
    of the same name created later takes the slot it is placed on then, not the deleted one's. (Here: its ring
    slot 1 is no longer held by this broker, so a new topic of that name would be its own slot's, 0.)"""
    clock = memory.ManualClock()
    store = memory.MemoryStore(dispatch_testing.config_for(tmp_path / "d").store, clock)
    lite_ = await dispatch_testing.Lite.start(store, clock, dispatch_testing.config_for(tmp_path / "d"))
    held = Held(me=0, epochs={0: 1, 1: 1})
    slots = slots_over(store, held, lambda topic: 1)
    lite_.dispatcher.ingest.replicas = slots
    try:
        await lite_.dispatcher.send([lite("W")])  # through ``Slots.admit``: stamped with slot 1
        assert slots.recorded(lmq("W")) == 1
        assert store.delete_lite_topic(PARENT, "W")
        del held.epochs[1]
        assert slots.slot_of_topic(lmq("W")) == 1  # remembered: not read again on every send
        lite_.dispatcher.forget_lite_topic(model.QueueId.lmq(PARENT, "W"))
        assert (slots.recorded(lmq("W")), slots.slot_of_topic(lmq("W"))) == (-1, 0)
    finally:
        lite_.dispatcher.ingest.replicas = None
        await lite_.dispatcher.close()


def test_a_commit_point_of_a_topic_of_another_slot_is_not_copied_as_this_brokers_own(store: Store) -> None:
    """An offset reset that reached a broker which is no replica of the topic's slot (lmq-admin's
    ResetLiteOffsets, an OffsetOption fanned out to every candidate) writes its own store only: filed under this
    broker's slot, its copy would replace the commit point at that slot's follower, maybe the topic's holder."""
    held = Held(me=2, epochs={2: 1})
    slots = slots_over(store, held, lambda topic: 0)  # every topic's ring slot is 0, held elsewhere
    queue = model.QueueId.lmq(PARENT, "elsewhere")
    assert slots.slot_of_topic(queue.topic) == 2  # what it would be filed under
    assert slots.committed(queue, "g", 0, ()) is None
    held.epochs[0] = 1  # once this broker holds slot 0, the topic's commit points are that slot's
    noted: list[wire.Commit] = []
    door: Any = slots.owner(0)
    door.note_commit = noted.append
    slots.committed(queue, "g", 3, ())
    assert [c.offset for c in noted] == [3]


def test_a_topic_taken_over_idle_belongs_to_the_slot_that_took_it_also_once_the_slot_it_left_is_back(
    store: Store, tmp_path: Path
) -> None:
    """T was slot 2's; slot 0 took it over idle (its last record still names 2). Written down (``moved``), T is
    slot 0's in a ring of 3 again (slot 2 brought back), after a restart (the rows read back from the file) and
    at a follower that got the row as a state row; a record stored since names its own slot; a topic deleted and
    stored again under slot 2 (another last record) is slot 2's."""
    append(store, [dataclasses.replace(lite("T"), slot=2, epoch=3)])
    taken = moved.Moved(tmp_path / "taker")
    assert taken.put(lmq("T"), moved.Move(2, 0, "T-0")) and not taken.put(lmq("T"), moved.Move(2, 0, "T-0"))
    held = Held(me=0, epochs={0: 1})
    leadership: Any = held
    make: Any = lambda slot: Door(held, slot)  # noqa: E731

    def slots_with(rows: moved.Moved) -> owning.Slots:
        recorded = lambda t: rows.slot_of(t, *sources.last_record(store, t))  # noqa: E731
        return owning.Slots(leadership, lambda t: 2, make, recorded, moved=rows.slot_of)

    assert slots_with(taken).slot_of_topic(lmq("T")) == 0
    assert slots_with(moved.Moved(tmp_path / "taker")).slot_of_topic(lmq("T")) == 0  # read back at a restart
    assert slots_over(store, held, lambda t: 2).slot_of_topic(lmq("T")) == 2  # without it: the new slot 2's
    follower = moved.Moved(tmp_path / "follower")
    assert follower.take(list(taken.rows_of(0).items())) == [lmq("T")] and taken.rows_of(1) == {}
    assert slots_with(follower).slot_of_topic(lmq("T")) == 0 and follower.left(lmq("T")) == 2
    fetched = slots_with(follower)  # a new replica that fetched T's records: noted as stored, still slot 0's
    fetched.note([dataclasses.replace(lite("T"), slot=2, epoch=3)])
    assert fetched.slot_of_topic(lmq("T")) == 0
    append(store, [dataclasses.replace(lite("T", 1), slot=0, epoch=1)])
    assert slots_with(taken).slot_of_topic(lmq("T")) == 0
    append(store, [dataclasses.replace(lite("T", 2), slot=2, epoch=1)])  # say, deleted and placed on 2 again
    assert slots_with(taken).slot_of_topic(lmq("T")) == 2


def test_a_take_over_written_after_a_line_torn_by_a_crash_is_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash in the middle of an append leaves the file ending in part of a line. The next take-over written
    down must not be glued onto that part (one line that decodes as nothing: the row would be gone at the next
    start, and the topic filed by today's ring); a damaged line before the last one is told, not skipped mutely."""
    taken = moved.Moved(tmp_path)
    assert taken.put(lmq("T"), moved.Move(2, 0, "T-0"))
    path = tmp_path / moved.FILE
    whole = path.read_bytes()
    path.write_bytes(whole + whole[: len(whole) // 2])  # a second row cut by a crash
    again = moved.Moved(tmp_path)
    assert again.left(lmq("T")) == 2
    assert again.put(lmq("U"), moved.Move(3, 1, "U-0"))
    back = moved.Moved(tmp_path)  # the next start
    assert (back.left(lmq("T")), back.left(lmq("U"))) == (2, 3)
    assert back.slot_of(lmq("U"), 3, "U-0") == 1
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0].replace(b"{", b"\xff", 1) + b"".join(lines[1:]))
    with caplog.at_level("ERROR", logger=moved.__name__):
        assert moved.Moved(tmp_path).left(lmq("U")) == 3
    assert "1 damaged lines" in caplog.text
