"""Replicated broker processes on a real apiserver, some of them inside a network namespace (``netns``) that a
test cuts off: the ring of the partition suites (tests/broker/replication/test_replication_partition*.py).

Brokers inside listen everywhere in the namespace, so their clients there call them on 127.0.0.1, which stays
up in the cut. With some brokers on this host, the ones inside are members at the namespace's address; with all
of them inside (``inside`` every slot), they are members at 127.0.0.1 and still reach each other in the cut,
while the apiserver (on this host) is out of reach."""

from __future__ import annotations

import concurrent.futures
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from netns import Namespace

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.config import StoreConfig
from lmq_broker.replication import kube as kube_api
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports

if TYPE_CHECKING:
    from lmq_operator.testing import KubeAPI

PARENT: Final = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
LEASE_MS: Final = 1500
LEASE_S: Final = LEASE_MS / 1000


@dataclass
class Ring:
    """R broker processes, those of the slots ``inside`` in the namespace, the others on this host."""

    namespace: Namespace
    kube: KubeAPI
    tmp_path: Path
    members: list[str]
    inside: frozenset[int]
    min_insync: int
    prefix: str
    brokers: list[testing.BrokerProcess | None]
    logs: list[str] = field(default_factory=list)  # each broker's log, once stopped

    @classmethod
    def start(
        cls,
        namespace: Namespace,
        kube: KubeAPI,
        tmp_path: Path,
        replicas: int,
        m: int,
        *,
        inside: frozenset[int] = frozenset({0}),
        prefix: str = "",
    ) -> Ring:
        everyone = len(inside) == replicas
        # Any port is free in the new namespace; inside, a member is at 127.0.0.1 when every member is inside.
        members = [
            f"{'127.0.0.1' if everyone else namespace.inner_ip}:{free_ports('127.0.0.1', 1)[0]}"
            if slot in inside
            else f"{namespace.host_ip}:{free_ports(namespace.host_ip, 1)[0]}"
            for slot in range(replicas)
        ]
        ring = cls(namespace, kube, tmp_path, members, inside, m, prefix or f"part-m{m}", [None] * replicas)
        with concurrent.futures.ThreadPoolExecutor(replicas) as pool:
            starting = [pool.submit(ring._start, slot) for slot in range(replicas)]
        ring.brokers = [f.result() if f.exception() is None else None for f in starting]
        failed = next((f.exception() for f in starting if f.exception() is not None), None)
        if failed is not None:
            ring.stop()
            raise failed
        return ring

    def _start(self, slot: int) -> testing.BrokerProcess:
        token = self.tmp_path / "token"
        token.write_text(self.kube.token)
        inside = slot in self.inside
        host = "0.0.0.0" if inside else self.namespace.host_ip
        server = self.kube.server.replace("127.0.0.1", self.namespace.host_ip) if inside else self.kube.server
        flags = ["--peers", ",".join(self.members), "--ordinal", str(slot), "--host", host]
        flags += ["--advertised-address", self.members[slot], "--flush-mode", "sync"]
        flags += ["--admin-access-key", "ak", "--admin-secret-key", "sk", "--replicas", str(len(self.members))]
        flags += ["--min-insync-replicas", str(self.min_insync), "--lease-namespace", "default"]
        flags += ["--lease-prefix", self.prefix, "--lease-duration-ms", str(LEASE_MS), "--kube-api-server", server]
        flags += ["--kube-token-file", str(token), "--kube-ca-file", str(self.kube.ca_file)]
        wrapper = self.namespace.wrapper if inside else ()
        return testing.start_broker(self.tmp_path / f"b{slot}", self.port(slot), flags, wrapper=wrapper)

    def port(self, slot: int) -> int:
        return int(self.members[slot].rsplit(":", 1)[1])

    def api(self) -> kube_api.ApiServer:
        return kube_api.ApiServer(self.kube.server, self.kube.token, self.kube.ca_file, "default")

    def lease(self, slot: int = 0) -> kube_api.Lease:
        found = self.api().get(f"{self.prefix}-slot-{slot}")
        assert found is not None
        return found

    def in_sync(self, slot: int = 0) -> tuple[int, ...] | None:
        """The slot's in-sync set as its lease records it; None before the owner created the lease."""
        found = self.api().get(f"{self.prefix}-slot-{slot}")
        return None if found is None else found.in_sync

    def metrics(self, slot: int) -> str:
        """Broker ``slot``'s metrics, read from this host (a broker inside: before the cut or after the heal)."""
        broker = self.brokers[slot]
        assert broker is not None
        address = self.namespace.inner_ip if slot in self.inside else self.namespace.host_ip
        with urllib.request.urlopen(f"http://{address}:{broker.metrics_port}/metrics", timeout=5) as response:
            body: bytes = response.read()
        return body.decode()

    def followers_reconciled(self) -> bool:
        """Every follower says it is in sync with slot 0's holder (``lmq_replication_in_sync``): reconciled with it,
        which a takeover needs besides being in the lease's in-sync set (the owner probed it)."""
        return all('lmq_replication_in_sync{slot="0"} 1.0' in self.metrics(s) for s in range(1, len(self.members)))

    def lite(self) -> str:
        """A lite topic of slot 0."""
        membership = mb.Membership.parse(",".join(self.members))
        return next(f"t{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"t{i}").topic) == 0)

    def stop(self) -> None:
        for b in self.brokers:
            if b is not None and b.alive():
                b.stop()
        self.logs = [b.log() if b is not None else "" for b in self.brokers]

    def held(self, slot: int, lite: str) -> list[str]:
        """What broker ``slot`` stored of ``lite`` (read once it is stopped)."""
        return held(self.tmp_path / f"b{slot}", lite)


def held(data_dir: Path, lite: str) -> list[str]:
    """The message ids a stopped broker's store holds of lite topic ``lite``, in offset order."""
    store = lmq_store.LmqStore(StoreConfig(data_dir=data_dir))
    try:
        return [m.message_id for m in store.read(model.QueueId.lmq(PARENT, lite), 0, 100_000)]
    finally:
        store.close()
