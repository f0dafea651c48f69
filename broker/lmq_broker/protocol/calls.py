"""The seam between the v2 service and a cluster of brokers: what ``Edge.cluster`` must provide.

A broker alone has ``Edge.cluster`` None and every handler answers for itself. In a cluster, the calls that
look different (routes and assignments list every broker; sends, subscription changes, a LiteSimpleConsumer's
receives and the settlements of what it gathered reach other brokers) go to the cluster's implementation
(``lmq_broker.cluster.calls``), which sits above this package and is installed in one place
(``lmq_broker.cluster.setup``). ``Metadata`` is the call's headers, read only when the cluster needs them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Protocol, TypeAlias

from lmq_broker.protocol.context import Caller
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

Metadata: TypeAlias = Iterable[tuple[str, str | bytes]] | None
Headers: TypeAlias = Callable[[], Metadata]  # the call's headers, read on demand (``context.invocation_metadata``)


class ClusterCalls(Protocol):
    def brokers(self, *, external: bool, lite_route: bool = False) -> Sequence[tuple[pb.Broker, int]]:
        """Every broker of the cluster in slot order, with the permission routes give its queues (``lite_route``:
        for a route of a LITE parent, which a LiteSimpleConsumer reads from its first readable queue only)."""
        ...

    def send(
        self, request: spb.SendMessageRequest, headers: Headers, data: bytes | None = None
    ) -> Awaitable[spb.SendMessageResponse]:
        """``data``: the bytes ``request`` was decoded from, when kept (``protocol.wire``)."""
        ...

    def receive(
        self, request: spb.ReceiveMessageRequest, caller: Caller, headers: Headers, time_remaining_s: float | None
    ) -> AsyncIterator[spb.ReceiveMessageResponse]: ...

    def sync_lite(
        self, request: spb.SyncLiteSubscriptionRequest, caller: Caller, headers: Headers
    ) -> Awaitable[spb.SyncLiteSubscriptionResponse]: ...

    def ack(self, request: spb.AckMessageRequest, caller: Caller) -> Awaitable[spb.AckMessageResponse]: ...

    def change_invisible(
        self, request: spb.ChangeInvisibleDurationRequest, caller: Caller
    ) -> Awaitable[spb.ChangeInvisibleDurationResponse]: ...

    def dead_letter(
        self, request: spb.ForwardMessageToDeadLetterQueueRequest, caller: Caller
    ) -> Awaitable[spb.ForwardMessageToDeadLetterQueueResponse]: ...
