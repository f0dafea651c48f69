"""This broker among its peers: the parts of ``lmq_broker.cluster`` that act on other brokers, built once and
changed together when the membership changes.

* ``links``: the view (membership, slot, routes) and one channel per peer, every call signed as a peer's;
* ``epochs``: which peers confirmed this broker's membership epoch;
* ``owners``: where each lite topic lives;
* ``forwarder``: sends, stored at their owners;
* ``fanout``: subscriptions split by owner, and the intents that bring a restarted owner up to date;
* ``handoff``: a leaving broker's topics, handed over once drained (``draining``);
* ``watch``: peers up, down, restarted, behind.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from lmq_broker.cluster import draining, local_hop
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster.epochs import Adopt, Epochs
from lmq_broker.cluster.fanout import Fanout, Known, Subscribers
from lmq_broker.cluster.forwarding import Forwarder, StoreHere
from lmq_broker.cluster.links import Headers, Links
from lmq_broker.cluster.owners import LocalHolds, Owners
from lmq_broker.cluster.watch import Watch
from lmq_broker.config import BrokerConfig, LocalHop
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc


class Peers:
    def __init__(  # noqa: PLR0913 (its parts, each once)
        self,
        config: BrokerConfig,
        *,
        secret: bytes,
        incarnation: str,
        admin_keys: tuple[str, str] | None,
        holds_locally: LocalHolds,
        drained_locally: draining.Drained,
        subscribers: Subscribers,
        known: Known,
        store_here: StoreHere,
        adopt: Adopt,
        registry: CollectorRegistry,
    ) -> None:
        self.links = Links(config, secret, admin_keys)
        self.epochs = Epochs(self.links, adopt)
        self.owners = Owners(self.links, self.epochs, holds_locally)
        # With replication: told each membership applied (``replication.setup.Replication.rebuild``)
        self.changed: Callable[[mb.Membership, int], None] | None = None
        self.fanout = Fanout(self.links, self.owners, subscribers=subscribers, known=known)
        self.handoff = draining.Handoff(drained_locally, self.fanout.move_subscriptions)
        self.handoff.slots = lambda lmq: (self.links.me, mb.owner(self.links.membership, lmq))
        self.hop: local_hop.Hop | None = None
        if config.local_hop == LocalHop.SOCKET and config.local_hop_dir is not None:
            self.hop = local_hop.Hop(
                config.local_hop_dir, secret, lambda: self.links.membership.epoch, config.advertised_address
            )
        self.forwarder = Forwarder(self.links, self.owners, self.epochs, self.handoff, store_here, registry, self.hop)
        self.watch = Watch(self.links, self.epochs, self.fanout, registry, incarnation=incarnation)
        self.fanout.ring_changed = self.watch.ring_changed

    def apply(self, membership: mb.Membership, me: int, *, told: bool = False) -> None:
        """A new membership, in one step: routes, assignments and remembered placements follow it at once.
        ``me`` is -1 when this broker is no member (removed, still running: it only forwards); ``told``: it
        came from the membership's writer (SetCluster), not from the flags."""
        self.links.apply(membership, me, told=told)
        self.owners.forget()
        if self.changed is not None:
            self.changed(membership, me)

    @property
    def membership(self) -> mb.Membership:
        return self.links.membership

    @property
    def me(self) -> int:
        return self.links.me

    def admin(self, member: str, method: str = "") -> tuple[admin_grpc.LmqAdminAsyncStub, Headers]:
        """Another broker's admin service, and the headers of a call to ``method`` there."""
        return self.links.admin(member, method)

    async def close(self) -> None:
        await self.watch.close()
        await self.forwarder.close()
        if self.hop is not None:
            await self.hop.close()
        await self.links.close()
