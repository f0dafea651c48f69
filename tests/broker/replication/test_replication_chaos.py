"""The replication chaos loop (docs/replication.md, Failover): two brokers with --replicas 2 on a real
kube-apiserver + etcd, a producer sending to lite topics of both slots all along, and round after round the
owner of a random slot killed with -9 while sends are in flight, its data directory deleted every other round
(disk loss), then restarted. A round starts only once both replicas are back in sync (a send of each slot
acknowledged since the restart: with --min-insync-replicas 2 that needs both). At the end both brokers hold
every acknowledged message, in the order it was acknowledged: 0 acknowledged messages lost.

``make test`` runs 2 rounds; ``make torture`` runs LMQ_REPLICATION_CHAOS_ROUNDS (default 20). Prints the
failover time of every round."""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.config import StoreConfig
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.replication.leadership import slot_of_identity
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports
from lmq_operator import testing as kube_testing

PARENT = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
LEASE_MS = 1500
PREFIX = "chaos"
ROUNDS = int(os.environ.get("LMQ_REPLICATION_CHAOS_ROUNDS", "2"))
SEND_TIMEOUT_S = 3.0


def start(tmp_path: Path, kube: kube_testing.KubeAPI, members: list[str], slot: int) -> testing.BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    port = members[slot].rsplit(":", 1)[1]
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--flush-mode", "sync"]
    flags += ["--replicas", "2", "--lease-namespace", "default", "--lease-prefix", PREFIX]
    flags += ["--lease-duration-ms", str(LEASE_MS), "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return testing.start_broker(tmp_path / f"b{slot}", int(port), flags)


class Producer:
    """Sends one message at a time, to each lite topic in turn, through whichever broker acknowledges it (the
    other one is tried when a call fails: a broker down, or a slot between owners). Records what was
    acknowledged, per topic, in order."""

    def __init__(self, members: list[str], topics: dict[str, int]) -> None:
        self._members = members
        self.topics = topics  # lite topic -> its slot
        self.acked: dict[str, list[str]] = {t: [] for t in topics}
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="chaos-producer")
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the producer did not stop"

    def count(self, slot: int) -> int:
        with self._lock:
            return sum(len(ids) for topic, ids in self.acked.items() if self.topics[topic] == slot)

    async def _run(self) -> None:
        channels = [grpc.aio.insecure_channel(m) for m in self._members]
        stubs: list[Any] = [service_grpc.MessagingServiceStub(c) for c in channels]  # aio: calls are awaited
        headers = protocol_testing.Client.headers("chaos", "PYTHON", "5.1.2")
        n = 0
        try:
            while not self._stop.is_set():
                for topic in self.topics:
                    n += 1
                    if await self._send(stubs, headers, topic, f"{topic}-{n}"):
                        with self._lock:
                            self.acked[topic].append(f"{topic}-{n}")
        finally:
            for channel in channels:
                await channel.close(None)

    async def _send(self, stubs: list[Any], headers: tuple[tuple[str, str], ...], topic: str, mid: str) -> bool:
        props = pb.SystemProperties(message_id=mid, message_type=pb.LITE, lite_topic=topic)
        msg = pb.Message(topic=pb.Resource(name=PARENT), body=mid.encode(), system_properties=props)
        for stub in random.sample(stubs, len(stubs)):
            try:
                reply = await stub.SendMessage(
                    spb.SendMessageRequest(messages=[msg]), metadata=headers, timeout=SEND_TIMEOUT_S
                )
            except grpc.aio.AioRpcError:
                continue
            if reply.status.code == pb.OK:
                return True
        self.refused += 1
        await asyncio.sleep(0.05)  # both refused (a slot between owners): not a busy loop
        return False


def gauges(broker: testing.BrokerProcess) -> dict[str, float]:
    """The replication gauges a broker serves, by series (``name{labels}``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = re.finditer(r"^(lmq_replication_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)
    return {m.group(1): float(m.group(2)) for m in found}


def in_sync(broker: testing.BrokerProcess, slot: int) -> bool:
    return gauges(broker).get(f'lmq_replication_in_sync{{slot="{slot}"}}') == 1


def held(data_dir: Path, topic: str, limit: int) -> list[str]:
    store = lmq_store.LmqStore(StoreConfig(data_dir=data_dir))
    try:
        return [m.message_id for m in store.read(model.QueueId.lmq(PARENT, topic), 0, limit)]
    finally:
        store.close()


@dataclass
class Chaos:
    tmp_path: Path
    kube: kube_testing.KubeAPI
    members: list[str]
    brokers: list[testing.BrokerProcess]
    producer: Producer
    api: kube_api.ApiServer

    def holder(self, slot: int) -> int | None:
        lease = self.api.get(f"{PREFIX}-slot-{slot}")
        return slot_of_identity(lease.holder) if lease is not None and lease.holder else None

    def acknowledged_again(self, what: str) -> None:
        """Sends of both slots acknowledged from now on (with min-insync 2: stored by both replicas)."""
        base = [self.producer.count(0), self.producer.count(1)]
        eventually(lambda: all(self.producer.count(s) >= base[s] + 10 for s in (0, 1)), what, timeout_s=60)

    def round(self, number: int, slot: int, *, lose_disk: bool) -> None:
        """Kill -9 the owner of ``slot`` under load (its disk too), see the follower take over, restart it."""
        brokers, members = self.brokers, self.members
        self.acknowledged_again(f"round {number}: sends of both slots acknowledged by both replicas")
        victim = self.holder(slot)
        assert victim is not None
        other = 1 - victim
        # The follower says it is in sync (only then may it take the lease over); the owner, its epoch and lag.
        eventually(lambda: in_sync(brokers[other], slot), f"round {number}: the follower of slot {slot} in sync")
        owner, follower = gauges(brokers[victim]), gauges(brokers[other])
        assert owner[f'lmq_replication_owner{{slot="{slot}"}}'] == 1
        assert follower[f'lmq_replication_owner{{slot="{slot}"}}'] == 0
        epoch = f'lmq_replication_epoch{{slot="{slot}"}}'
        assert owner[epoch] == follower[epoch]
        lag = f'lmq_replication_lag_messages{{follower="{members[other]}",slot="{slot}"}}'
        assert owner[lag] >= 0 and owner["lmq_replication_replicas"] == 2
        brokers[victim].kill()
        killed = time.monotonic()
        if lose_disk:
            shutil.rmtree(self.tmp_path / f"b{victim}")
        eventually(lambda: self.holder(slot) == other, f"round {number}: slot {slot} taken over", timeout_s=30)
        print(
            f"\nround {number}: killed broker {victim} (owner of slot {slot}{', disk deleted' if lose_disk else ''}); "
            f"broker {other} took the lease {time.monotonic() - killed:.2f} s later"
        )
        brokers[victim] = start(self.tmp_path, self.kube, members, victim)


def test_kill_9_of_random_owners_with_and_without_their_disks_loses_no_acknowledged_message(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, members, slot) for slot in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    topics: dict[str, int] = {}  # two lite topics of each slot
    for i in range(1000):
        slot = mb.owner(membership, model.QueueId.lmq(PARENT, f"c{i}").topic)
        if sum(1 for s in topics.values() if s == slot) < 2:
            topics[f"c{i}"] = slot
        if len(topics) == 4:
            break

    producer = Producer(members, topics)
    chaos = Chaos(tmp_path, kube, members, brokers, producer, api)
    rng = random.Random(int(os.environ.get("LMQ_REPLICATION_CHAOS_SEED", "32")))
    try:
        eventually(lambda: chaos.holder(0) == 0 and chaos.holder(1) == 1, "each broker holds its own slot's lease")
        producer.start()
        for round_ in range(ROUNDS):
            chaos.round(round_, rng.choice((0, 1)), lose_disk=round_ % 2 == 0)
        chaos.acknowledged_again("sends go on after the last round")
    finally:
        producer.stop()
        for b in brokers:
            if b.alive():
                b.stop()
    total = sum(len(ids) for ids in producer.acked.values())
    print(f"{ROUNDS} rounds: {total} sends acknowledged, {producer.refused} refused")
    assert total > 0
    for broker in (0, 1):
        for topic, acked in producer.acked.items():
            found = held(tmp_path / f"b{broker}", topic, len(acked) * 4 + 100)
            # every acknowledged message, in order (an unacknowledged send may also have been stored)
            assert [m for m in dict.fromkeys(found) if m in set(acked)] == acked, (broker, topic)
