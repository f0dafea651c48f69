"""This broker's view of the cluster and its links to the other brokers: the membership and its slot, the
routes that name every broker, one gRPC channel per peer, and the headers that make a call a peer's.

Every call to another broker carries the peer header (``cluster.trust``, signed with the cluster secret and
this broker's membership epoch). A v2 call made for a client also carries that client's id and namespace and,
when client auth is on, a client signature with this broker's own client key pair (the receiver's auth
interceptor checks every v2 call); an admin call is signed with the admin key pair every broker of a cluster
shares. With ``--admin-port`` a peer's admin service is on its host at that port (every broker of a cluster
runs with the same flags).

Routes come in two sets: the internal one names every slot by its member endpoint, the external one (for the
``--external-port`` listener, clients outside the cluster) by its external address (``cluster.external``).
Calls between brokers always use the member endpoints. With TLS they trust ``--tls-ca`` (the CA that signed the
brokers' certificates; without it the certificate itself, which must then be self-signed) and check the name
``--tls-server-name`` when given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Final

import grpc

from lmq_broker import errors
from lmq_broker.cluster import external as ext
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import trust
from lmq_broker.config import BrokerConfig
from lmq_broker.protocol import auth, context, convert
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc as admin_grpc

log = logging.getLogger(__name__)

# RocketMQ's proxy gives its broker calls 2 s. Calls to peers wait that long for a connection (wait_for_ready):
# a peer that was just started or restarted is reached as soon as it listens, and one that is down fails the
# call after CALL_TIMEOUT_S (the official clients' own request timeout is 3 s).
CALL_TIMEOUT_S: Final = 2.0
V2: Final = "/apache.rocketmq.v2.MessagingService/"
ADMIN: Final = "/lmq.admin.v1.LmqAdmin/"
_CHANNEL_OPTIONS: Final = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    # A peer that was down (not started yet, restarting) is tried again soon: calls fail fast while a channel
    # waits to reconnect, so a long backoff would refuse sends for that long after the peer is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
Headers = tuple[tuple[str, str], ...]


def external_of(config: BrokerConfig) -> ext.ExternalAddresses | None:
    """The external addresses of the config's slots; None without an external listener. InvalidArgument when
    the listener is on but some member of ``--peers`` has no address (neither listed nor by template)."""
    if config.external_port < 0:
        return None
    addresses = ext.ExternalAddresses.parse(
        config.external_addresses, config.external_address_template, config.pod_processes
    )
    if config.peers:
        addresses.of_slots(len(mb.Membership.parse(config.peers).members))
    return addresses


endpoints_of = convert.endpoints_of_address


def _probe_options(probe: bool) -> tuple[tuple[str, int | str], ...]:
    return (("grpc.use_local_subchannel_pool", 1),) if probe else ()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Links:
    def __init__(self, config: BrokerConfig, secret: bytes, admin_keys: tuple[str, str] | None) -> None:
        self.config = config
        self.secret = secret
        self._admin_keys = admin_keys
        self._external = external_of(config)
        self._channels: dict[str, grpc.aio.Channel] = {}  # by endpoint: slots keep theirs across a change
        self._closing: set[asyncio.Task[None]] = set()
        self.membership = mb.Membership.single()
        self.me = 0
        self.told = False  # the membership came from its writer (SetCluster), not from this broker's flags
        self.brokers: list[tuple[pb.Broker, int]] = []
        self.external_brokers: list[tuple[pb.Broker, int]] = []

    def apply(self, membership: mb.Membership, me: int, *, told: bool = False) -> None:
        """A new membership: routes follow it at once, channels to members that left are closed (calls still
        running on them get their answers). ``me`` is -1 when this broker is no member."""
        name = self.config.broker_name.rsplit("-", 1)[0]
        self.membership = membership
        self.me = me
        self.told = told
        self.brokers = [
            (
                pb.Broker(name=f"{name}-{slot}", id=0, endpoints=convert.endpoints_of_address(member)),
                self.permission(slot),
            )
            for slot, member in enumerate(membership.members)
        ]
        self.external_brokers = [
            (pb.Broker(name=broker.name, id=0, endpoints=endpoints_of(self._external_address(slot))), p)
            for slot, (broker, p) in enumerate(self.brokers)
        ]
        kept = {*membership.members, *(f"probe {m}" for m in membership.members)}
        for endpoint in [e for e in self._channels if e not in kept]:
            channel = self._channels.pop(endpoint)
            task = asyncio.get_running_loop().create_task(channel.close(CALL_TIMEOUT_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _external_address(self, slot: int) -> str:
        """Slot ``slot``'s external address; its member endpoint (and a warning) when it has none, which
        ``SetCluster`` refuses beforehand: a client outside then cannot reach that broker."""
        if self._external is None:
            return self.membership.members[slot]
        try:
            return self._external.of(slot)
        except errors.InvalidArgument as exc:
            log.warning("%s: external clients get its internal address %s", exc.message, self.membership.members[slot])
            return self.membership.members[slot]

    def routed(self, external: bool) -> list[tuple[pb.Broker, int]]:
        return self.external_brokers if external and self._external is not None else self.brokers

    def permission(self, slot: int) -> int:
        return pb.READ_WRITE if self.membership.writable(slot) else pb.READ

    @property
    def size(self) -> int:
        return len(self.membership.members)

    @property
    def routes_forwarded(self) -> bool:
        """Peers' sends are routed here, not just stored: this broker is leaving, or no member."""
        return self.me < 0 or self.membership.leaving(self.me)

    def channel(self, target: str, *, probe: bool = False) -> grpc.aio.Channel:
        """The channel to ``target``; ``probe``: a second one of its own (own connection), for the watch's
        probes, whose failures while a peer is down must not hold the calls that carry work in a failed state."""
        key = f"probe {target}" if probe else target
        channel = self._channels.get(key)
        if channel is None:
            config = self.config
            if config.tls_cert is not None:
                trusted = (config.tls_ca or config.tls_cert).read_bytes()  # read per channel: a renewed CA counts
                options: tuple[tuple[str, int | str], ...] = _CHANNEL_OPTIONS + _probe_options(probe)
                if config.tls_server_name:
                    options += (("grpc.ssl_target_name_override", config.tls_server_name),)
                credentials = grpc.ssl_channel_credentials(root_certificates=trusted)
                channel = grpc.aio.secure_channel(target, credentials, options=options)
            else:
                channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS + _probe_options(probe))
            self._channels[key] = channel
        return channel

    def peer_header(self, method: str) -> tuple[str, str]:
        return trust.header(self.secret, method, self.membership.epoch, now_ms())

    def v2_headers(self, method: str, caller: context.Caller | None = None) -> Headers:
        """Headers of a v2 call to a peer: the peer header, the client's id and namespace (``caller``), and a
        client signature when client auth is on. Under ``--acl`` the signature is the admin pair's, the super
        user: the broker the client called has checked the client's rights (``protocol.authorizing``); the
        client's user (``caller.user``) goes with it, for the owner's check of whose client id it is."""
        headers: Headers = (self.peer_header(V2 + method),)
        if caller is not None:
            headers += ((context.CLIENT_ID, caller.client_id), (context.NAMESPACE, caller.namespace))
            if caller.user:  # whose client id it is: the receiver refuses it under another user's id too
                headers += ((context.ON_BEHALF, caller.user),)
            if caller.source:  # and where it called from, for the receiver's checks of its rules that name networks
                headers += ((context.ON_BEHALF_FROM, caller.source),)
        if self.config.acl and self._admin_keys is not None and self._admin_keys[0]:
            headers += auth.sign_metadata(self._admin_keys[0], self._admin_keys[1], datetime.now(UTC))
        elif self.config.access_key:
            headers += auth.sign_metadata(self.config.access_key, self.config.secret_key, datetime.now(UTC))
        return headers

    def admin(
        self, endpoint: str, method: str = "", *, probe: bool = False
    ) -> tuple[admin_grpc.LmqAdminAsyncStub, Headers]:
        """A stub of another broker's admin service and the headers to sign a call to ``method`` with (this
        broker's admin pair, which every broker of a cluster shares, and the peer header)."""
        target = mb.admin_endpoint(endpoint, self.config.admin_port)
        headers: Headers = (self.peer_header(ADMIN + method),) if method else ()
        if self._admin_keys is not None and self._admin_keys[0]:
            headers += auth.sign_metadata(self._admin_keys[0], self._admin_keys[1], datetime.now(UTC))
        stub: admin_grpc.LmqAdminAsyncStub = admin_grpc.LmqAdminStub(self.channel(target, probe=probe))
        return stub, headers

    async def close(self) -> None:
        closing: list[Awaitable[None]] = [*self._closing, *(c.close(None) for c in self._channels.values())]
        await asyncio.gather(*closing, return_exceptions=True)
        self._channels.clear()
