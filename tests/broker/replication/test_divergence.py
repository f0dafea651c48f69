"""The leader-epoch rule a rejoining replica cuts its lite topics by (``replication.divergence``), on lists of
record epochs: hand-made histories, then random ones made the way the brokers make them."""

from __future__ import annotations

import random

import pytest

from lmq_broker.replication import divergence
from lmq_broker.replication.divergence import Listed


def rejoin(mine: Listed, owner: Listed) -> int:
    """What ``following`` does for one topic: ask, cut, ask again while the answer's epoch is not ours."""
    while (last := divergence.last_epoch(mine)) is not None:
        theirs = divergence.answer(owner, last)
        mine.cut(divergence.cut_point(mine, last, theirs))
        if theirs[0] == last:
            break
    return len(mine.epochs)


@pytest.mark.parametrize(
    ("mine", "owner", "kept"),
    [
        ([0, 0, 0, 0, 0], [0, 0, 0, 1, 1], 3),  # a deposed owner's records the new owner never got
        ([0, 0], [0, 0, 0, 1], 2),  # behind: nothing to cut, it fetches the rest
        ([0, 0, 2, 2], [0, 0, 3, 3], 2),  # its own epoch 2 never reached the owner of 3: asked again with 0
        ([0, 1, 1, 1, 2], [0, 1, 3], 2),  # the owner has only the first record of epoch 1
        ([0, 0, 0], [], 0),  # the owner holds none of the topic
        ([0, 0, 0, 0], [0, None, 0, 1], 3),  # a lost record on the owner's side is looked past
        ([1, 1, 1], [1, 1, 1, 1], 3),  # the same epoch: it is a prefix of the owner's
    ],
)
def test_a_replica_keeps_exactly_what_it_shares_with_the_owner(
    mine: list[int | None], owner: list[int | None], kept: int
) -> None:
    assert rejoin(Listed(list(mine)), Listed(owner)) == kept


def test_the_owners_answer_is_its_newest_epoch_at_or_below_and_where_the_next_begins() -> None:
    owner = Listed([0, 0, 2, 2, 5])
    assert divergence.answer(owner, 0) == (0, 2)
    assert divergence.answer(owner, 1) == (0, 2)
    assert divergence.answer(owner, 3) == (2, 4)
    assert divergence.answer(owner, 9) == (5, 5)
    assert divergence.answer(Listed([3, 3]), 1) == (None, 0)


Log = list[tuple[int, int]]  # (epoch, id) per offset


def rejoined(log: Log, owner: Log) -> Log:
    """A replica back: cut by the rule (exactly where it parts from the owner's log), then caught up."""
    kept = rejoin(Listed([e for e, _ in log]), Listed([e for e, _ in owner]))
    shared = next((i for i, (a, b) in enumerate(zip(log, owner, strict=False)) if a != b), min(len(log), len(owner)))
    assert kept == shared  # no less (a record the owner lacks would stay), no more (it would be fetched again)
    return log[:kept] + owner[kept:]


def simulate(rng: random.Random) -> tuple[list[Log], Log, set[tuple[int, int]]]:
    """Three replicas of one topic through random sends, lost copies, failovers and restarts, as the brokers
    run them: the owner of an epoch stores (epoch, id) records and copies them in order to the followers in
    sync; one that misses a copy drops out until it rejoins; a send is acknowledged once all three stored it;
    an owner dies with its last records copied to some followers only in part (or to none), a follower in sync
    takes over with the next epoch (or one more: a forced takeover), and the others rejoin it before they take
    its copies; the dead owner and the dropped followers come back later, after the new owner wrote at their
    offsets. Returns the logs, the owner's, and the acknowledged records."""
    logs: list[Log] = [[], [], []]
    owner, epoch, serial = 0, 0, 0
    synced, acked = {1, 2}, set()
    for _ in range(rng.randint(1, 10)):
        for r in {0, 1, 2} - synced - {owner}:
            if rng.random() < 0.5:
                logs[r] = rejoined(logs[r], logs[owner])
                synced.add(r)
        for _ in range(rng.randint(0, 6)):
            serial += 1
            logs[owner].append((epoch, serial))
            for r in sorted(synced):
                if rng.random() < 0.15:
                    synced.discard(r)
                else:
                    logs[r].append((epoch, serial))
            if len(synced) == 2:
                acked.add((epoch, serial))
        if not synced or rng.random() < 0.3:
            continue  # no failover (with none in sync, the slot refuses sends until one catches up)
        dying = [(epoch, serial + n) for n in range(1, rng.randint(0, 3) + 1)]  # the owner dies storing these:
        serial += len(dying)
        logs[owner] += dying
        for r in sorted(synced):
            logs[r] += dying[: rng.randint(0, len(dying))]  # copied to some in part (in order), never acknowledged
        owner, epoch = rng.choice(sorted(synced)), epoch + 1 + rng.randint(0, 1)
        synced = {r for r in synced if r != owner}
        for r in synced:
            logs[r] = rejoined(logs[r], logs[owner])
    for r in {0, 1, 2} - {owner}:
        logs[r] = rejoined(logs[r], logs[owner])
    return logs, logs[owner], acked


@pytest.mark.parametrize("seed", range(100))
def test_random_failovers_leave_every_replica_with_the_owners_log_and_every_acknowledged_record(seed: int) -> None:
    logs, owner, acked = simulate(random.Random(seed))
    assert all(log == owner for log in logs)
    assert acked <= set(owner)
