"""The broker seam as the operator sees it: a small Protocol, its error value, and an in-memory twin.

The twin lets kopf handler flows run without broker processes; a contract suite runs the same checks on it
and on ``grpcadmin.GrpcAdmin`` against a real broker, so the twin cannot drift from what brokers do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from lmq_operator import model


class AdminError(Exception):
    def __init__(self, failure: model.Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


class BrokerAdmin(Protocol):
    """The admin calls the operator makes on one broker; the gRPC twin is ``GrpcAdmin``."""

    async def get(self, kind: model.Kind, key: str) -> model.Observed | None: ...
    async def put(self, config: model.Config) -> bool: ...
    async def delete(self, kind: model.Kind, key: str, purge: bool) -> bool: ...
    async def undrained_messages(self) -> int: ...
    async def close(self) -> None: ...


AdminFactory = Callable[[str], BrokerAdmin]


@dataclass
class AdminPool:
    """One admin connection per broker endpoint, closed when the broker leaves the fleet."""

    factory: AdminFactory
    _open: dict[str, BrokerAdmin] = field(default_factory=dict)

    def __call__(self, broker: model.Broker) -> BrokerAdmin:
        admin = self._open.get(broker.endpoint)
        if admin is None:
            admin = self._open[broker.endpoint] = self.factory(broker.endpoint)
        return admin

    async def prune(self, keep: Iterable[model.Broker]) -> None:
        endpoints = {b.endpoint for b in keep}
        for endpoint in [e for e in self._open if e not in endpoints]:
            await self._open.pop(endpoint).close()

    async def close(self) -> None:
        await self.prune(())


class MemoryAdmin:
    """``BrokerAdmin``'s in-memory twin: one dict per kind, figures always zero. For handler-flow tests
    without a broker process; the contract suite runs the same checks against ``GrpcAdmin`` and a real broker.
    ``down`` makes every call fail as an unreachable broker would. ``reclaims`` stands for the reclaim job's
    records (parent topic -> last run); deleting a parent topic drops its record, as a broker does."""

    def __init__(self, endpoint: str = "memory") -> None:
        self.endpoint = endpoint
        self.objects: dict[model.Kind, dict[str, model.Config]] = {k: {} for k in model.Kind}
        self.undrained = 0
        self.reclaims: dict[str, model.ReclaimRun] = {}
        self.down = False
        self.calls: list[tuple[str, str]] = []

    def _check(self, verb: str, key: str) -> None:
        self.calls.append((verb, key))
        if self.down:
            raise AdminError(model.Failure.UNAVAILABLE, f"UNAVAILABLE: {self.endpoint} is down")

    async def get(self, kind: model.Kind, key: str) -> model.Observed | None:
        self._check("get", key)
        found = self.objects[kind].get(key)
        if found is None:
            return None
        figures = {
            model.Kind.PARENT_TOPIC: (("liteTopicCount", 0),),
            model.Kind.LITE_GROUP: (("subscriptionCount", 0), ("clientCount", 0), ("lag", 0)),
            model.Kind.LITE_QUOTA: (),
            model.Kind.LMQ_USER: (),
        }[kind]
        if isinstance(found, model.UserConfig):  # a broker never returns a secret, nor where it came from
            found = dataclasses.replace(found, secret="", secret_version="")
        reclaim = self.reclaims.get(key) if kind is model.Kind.PARENT_TOPIC else None
        orphan = isinstance(found, model.GroupConfig) and found.bind_topic not in self.objects[model.Kind.PARENT_TOPIC]
        return model.Observed(found, figures, reclaim, parent_missing=orphan)

    async def put(self, config: model.Config) -> bool:
        self._check("put", config.key)
        kind = _KIND_OF[type(config)]
        if isinstance(config, model.GroupConfig) and config.bind_topic not in self.objects[model.Kind.PARENT_TOPIC]:
            raise AdminError(model.Failure.MISSING_PARENT, f"NOT_FOUND: parent topic {config.bind_topic!r} not found")
        created = config.key not in self.objects[kind]
        self.objects[kind][config.key] = config
        return created

    async def delete(self, kind: model.Kind, key: str, purge: bool) -> bool:
        self._check("delete", key)
        if kind is model.Kind.PARENT_TOPIC:
            self.reclaims.pop(key, None)
        return self.objects[kind].pop(key, None) is not None

    async def undrained_messages(self) -> int:
        self._check("info", "")
        return self.undrained

    async def close(self) -> None:
        return None


_KIND_OF: dict[type, model.Kind] = {
    model.TopicConfig: model.Kind.PARENT_TOPIC,
    model.GroupConfig: model.Kind.LITE_GROUP,
    model.QuotaConfig: model.Kind.LITE_QUOTA,
    model.UserConfig: model.Kind.LMQ_USER,
}
