"""The membership loop's I/O: observe the StatefulSet, the operator's ConfigMap and every broker's GetCluster,
let ``scaling.decide`` choose the next step, and carry it out.

One pass every few seconds, leader only (it runs inside kopf's startup, like the resync loop). A pass writes in
a fixed order so that an interrupted one leaves nothing unsafe behind: the record (the target membership, an
annotation of the ConfigMap) and the flags starting pods take (its data) first, then ``spec.replicas`` when it
grows, then SetCluster on each broker in the safe order, and ``spec.replicas`` when it shrinks only after every
broker has accepted the smaller ring (a broker refuses to remove a peer it cannot ask whether it is drained).

Before the first SetCluster that makes a broker know a new member, that member gets every resource the operator
manages (``prepare``, supplied by the handlers, which own the resources): a ring that sends producers to a
broker without their ParentTopic fails them. Until it holds them all, nobody is told and the pass says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import kubernetes

from lmq_broker import errors
from lmq_broker.admin.client import AsyncAdminClient
from lmq_broker.admin.credentials import KeyPair
from lmq_broker.cluster import membership as mb
from lmq_operator import kube, metrics, model, replicas, scaling, settings, slices

log = logging.getLogger(__name__)

COMPONENT: Final = "lmq-operator"
# A leaving broker counts its undrained messages by walking all its lite topics: while it still has some, it
# is asked again after ten times what the last count took (the counting then costs it at most a tenth of its
# time), at least UNDRAINED_MIN_S and at most UNDRAINED_EVERY_S apart (an answer of none is acted on at once,
# and the broker checks it again). A count of a few topics is cheap, so a drain that ends is seen within a
# second or two rather than up to 15 s later; one over millions of topics is asked for every 15 s.
UNDRAINED_EVERY_S: Final = 15.0
UNDRAINED_MIN_S: Final = 1.0
UNDRAINED_COST_FACTOR: Final = 10.0


# Applies every resource the operator manages to these brokers; None once each holds them all.
Prepare = Callable[[Sequence[model.Broker]], Awaitable[scaling.Unprepared | None]]


async def _nothing_to_prepare(brokers: Sequence[model.Broker]) -> scaling.Unprepared | None:
    return None


@dataclass
class Scaler:
    conf: settings.Settings
    client: Callable[[], Any]  # the Kubernetes ApiClient, made on first use
    keys: KeyPair | None = None
    ring_pods: int | None = None  # pods of today's ring after the last pass (leaving ones excluded)
    last: scaling.Decision | None = None
    _admins: dict[str, AsyncAdminClient] = field(default_factory=dict)
    _asks: dict[int, str] = field(default_factory=dict)  # slot -> admin endpoint, of the last observation
    _undrained: dict[str, tuple[float, int]] = field(default_factory=dict)  # endpoint -> (ask again at, count > 0)
    clock: Callable[[], float] = time.monotonic
    prepare: Prepare = _nothing_to_prepare
    _failed: str = ""
    replication: replicas.Report | None = None  # the last pass's report (replication above 1 only)
    _leases: list[Mapping[str, Any]] | None = None  # the slot Leases this pass observed (replication above 1)
    _undeleted: set[str] = field(default_factory=set)  # removed slots' Leases whose deletion was refused (logged)

    # ---- Kubernetes reads and writes ---------------------------------------------------------------------

    @property
    def _ns(self) -> str:
        assert self.conf.broker_namespace is not None
        return self.conf.broker_namespace

    async def _call(self, api: str, method: str, *args: Any, **kw: Any) -> Any:
        def call() -> Any:
            target = getattr(kubernetes.client, api)(self.client())
            return getattr(target, method)(*args, **kw)

        return await asyncio.to_thread(call)

    async def _json(self, api: str, method: str, *args: Any) -> dict[str, Any] | None:
        try:
            resp = await self._call(api, method, *args, _preload_content=False)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        found: dict[str, Any] = json.loads(resp.data)
        return found

    async def _slices(self) -> list[Mapping[str, Any]]:
        return await kube.endpoint_slices(self.client(), self._ns, str(self.conf.broker_service))

    async def _patch_sts(self, body: Mapping[str, Any]) -> None:
        await self._call(
            "AppsV1Api",
            "patch_namespaced_stateful_set",
            self.conf.broker_statefulset,
            self._ns,
            dict(body),
            field_manager=COMPONENT,
            _content_type="application/merge-patch+json",
        )

    async def _write_configmap(
        self,
        sts: Mapping[str, Any],
        current: Mapping[str, Any] | None,
        record: str | None,
        env: Mapping[str, str] | None,
        epoch: int | None = None,
    ) -> None:
        name = self.conf.membership_configmap
        annotations = {scaling.ANNOTATION_MEMBERSHIP: record} if record is not None else {}
        if epoch is not None:
            annotations[scaling.ANNOTATION_EPOCH] = str(epoch)
        if current is None:
            meta = sts["metadata"]
            owner = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": meta["name"], "uid": meta["uid"]}
            body = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "annotations": annotations, "ownerReferences": [owner]},
                "data": dict(env or {}),
            }
            await self._call("CoreV1Api", "create_namespaced_config_map", self._ns, body, field_manager=COMPONENT)
            return
        patch: dict[str, Any] = {}
        if annotations:
            patch["metadata"] = {"annotations": annotations}
        if env is not None:
            patch["data"] = dict(env)
        await self._call(
            "CoreV1Api",
            "patch_namespaced_config_map",
            name,
            self._ns,
            patch,
            field_manager=COMPONENT,
            _content_type="application/merge-patch+json",
        )

    async def _event(self, sts: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        meta = sts["metadata"]
        now = datetime.now(UTC)
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": self._ns},
            "involvedObject": {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "name": meta["name"],
                "namespace": self._ns,
                "uid": meta["uid"],
            },
            "type": kind,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.conf.identity,
            "firstTimestamp": now.isoformat(),
            "lastTimestamp": now.isoformat(),
            "count": 1,
        }
        try:
            await self._call("CoreV1Api", "create_namespaced_event", self._ns, body)
        except kubernetes.client.ApiException as exc:
            log.warning("event %s on the broker StatefulSet not posted: %s %s", reason, exc.status, exc.reason)

    # ---- brokers -----------------------------------------------------------------------------------------

    def _admin(self, endpoint: str) -> AsyncAdminClient:
        found = self._admins.get(endpoint)
        if found is None:
            timeout = self.conf.admin_timeout_s
            found = self._admins[endpoint] = AsyncAdminClient(
                endpoint, timeout, long_timeout_s=max(timeout, 60.0), keys=self.keys, tls=self.conf.tls
            )
        return found

    async def _view(self, endpoint: str, undrained: bool) -> tuple[scaling.View | None, int | None]:
        known = self._undrained.get(endpoint) if undrained else None
        fresh = known is not None and self.clock() < known[0]
        asked = self.clock()
        try:
            info = await self._admin(endpoint).cluster(with_undrained=undrained and not fresh)
        except errors.LmqError as exc:
            log.info("broker %s: GetCluster failed: %s", endpoint, exc.message)
            return None, None
        try:
            found = mb.Membership(tuple(info.members), tuple(info.ring_sizes))
        except errors.InvalidArgument:
            return None, None
        view = scaling.View(found, info.slot, info.epoch, info.ring_fixed)
        if not undrained:
            return view, None
        if fresh:
            assert known is not None
            return view, known[1]
        if info.undrained_messages > 0:  # kept until the time to ask again (``UNDRAINED_EVERY_S``)
            now = self.clock()
            wait = min(UNDRAINED_EVERY_S, max(UNDRAINED_MIN_S, UNDRAINED_COST_FACTOR * (now - asked)))
            self._undrained[endpoint] = (now + wait, info.undrained_messages)
        else:
            self._undrained.pop(endpoint, None)
        return view, info.undrained_messages

    # ---- one pass ----------------------------------------------------------------------------------------

    def _pod(self, ordinal: int) -> str:
        pods = self.conf.broker_addresses
        if len(pods) == 1 and "{pod}" in pods[0]:
            return pods[0].replace("{pod}", f"{self.conf.broker_statefulset}-{ordinal}")
        return pods[ordinal] if ordinal < len(pods) else f"unknown-pod-{ordinal}:0"

    async def observe(self) -> tuple[dict[str, Any], dict[str, Any] | None, scaling.Observed]:
        sts = await self._json("AppsV1Api", "read_namespaced_stateful_set", self.conf.broker_statefulset, self._ns)
        if sts is None:
            raise LookupError(f"StatefulSet {self._ns}/{self.conf.broker_statefulset} not found")
        cm = await self._json("CoreV1Api", "read_namespaced_config_map", self.conf.membership_configmap, self._ns)
        annotations = sts["metadata"].get("annotations") or {}
        raw = annotations.get(scaling.ANNOTATION_REPLICAS)
        try:
            wanted = int(raw) if raw is not None and str(raw).strip() else None
        except ValueError:
            wanted = -1  # reported as Stalled: not a count
        cm_annotations = (cm or {}).get("metadata", {}).get("annotations") or {}
        record = cm_annotations.get(scaling.ANNOTATION_MEMBERSHIP)
        target = mb.Membership.from_json(record) if record else None
        raw_epoch = str(cm_annotations.get(scaling.ANNOTATION_EPOCH) or "")
        epoch = int(raw_epoch) if raw_epoch.isdigit() else None
        p = self.conf.processes
        pods = {pod.ordinal: pod for pod in slices.pods(await self._slices(), self.conf.admin_port)}
        leaving = set(target.leaving_slots) if target is not None else set()
        asks: dict[int, str] = {}
        for ordinal, pod in pods.items():
            if ordinal is None:
                continue
            for i, endpoint in enumerate(pod.admin_endpoints(p)):
                asks[ordinal * p + i] = endpoint
        for gone in [e for e in self._admins if e not in asks.values()]:  # pods gone or moved to another IP
            self._undrained.pop(gone, None)
            with contextlib.suppress(Exception):
                await self._admins.pop(gone).close()
        answers = await asyncio.gather(*(self._view(e, s in leaving) for s, e in asks.items()))
        views = {s: a[0] for s, a in zip(asks, answers, strict=True)}
        undrained = {s: a[1] for s, a in zip(asks, answers, strict=True) if s in leaving}
        replicas = int((sts.get("spec") or {}).get("replicas", 1))
        in_sync = holders = None
        if self.conf.replication > 1 and target is not None:
            self._leases = await self._list_leases()
            if self._leases is not None:
                in_sync, holders = self._in_sync(self._leases, len(target.members))
        observed = scaling.Observed(
            wanted,
            replicas,
            p,
            target,
            views,
            undrained,
            self._pod,
            epoch,
            replication=self.conf.replication,
            in_sync=in_sync,
            holders=holders,
        )
        self._asks = asks
        return sts, cm, observed

    async def _list_leases(self) -> list[Mapping[str, Any]] | None:
        """The release namespace's Leases (``list`` only); None when they cannot be listed."""
        try:
            found = await self._json("CoordinationV1Api", "list_namespaced_lease", self._ns)
        except kubernetes.client.ApiException as exc:
            log.warning("replication: the slot Leases could not be listed: %s %s", exc.status, exc.reason)
            return None
        items: list[Mapping[str, Any]] = (found or {}).get("items") or []
        return items

    def _in_sync(
        self, leases: Sequence[Mapping[str, Any]], slots: int
    ) -> tuple[dict[int, tuple[int, ...] | None], dict[int, int | None]]:
        """Each slot's in-sync set and the ring slot of its holder, as the slot Leases record them."""
        by_name = {str(lease["metadata"]["name"]): lease for lease in leases}
        prefix, now = self.conf.slot_lease_prefix, datetime.now(UTC)
        found = [by_name.get(f"{prefix}-slot-{s}", {}) for s in range(slots)]
        in_sync = {s: replicas.in_sync_of(lease) for s, lease in enumerate(found)}
        return in_sync, {s: replicas.holder_of(lease, now) for s, lease in enumerate(found)}

    async def run_once(self) -> scaling.Decision:
        sts, cm, observed = await self.observe()
        decision = scaling.decide(observed)
        target = decision.target or observed.target
        record = decision.target.to_json() if decision.target is not None else None
        env = decision.env
        if env is not None and cm is not None and (cm.get("data") or {}) == env:
            env = None
        epoch = decision.epoch if decision.tell and decision.epoch != observed.epoch else None
        if record is not None or env is not None or epoch is not None or (cm is None and target is not None):
            await self._write_configmap(sts, cm, record or (target.to_json() if target else None), env, epoch)
        shrinking = decision.replicas is not None and decision.replicas < observed.replicas
        if decision.replicas is not None and not shrinking:
            await self._patch_sts({"spec": {"replicas": decision.replicas}})
        unprepared = await self._prepare(target, decision.prepare) if target is not None and decision.tell else None
        if unprepared is not None:
            decision = dataclasses.replace(
                decision,
                phase=scaling.Phase.STALLED if unprepared.stalled else scaling.Phase.WAITING,
                message=unprepared.message,
                event=None,
            )
        told = unprepared is None and (await self._tell(target, decision.tell, decision.epoch) if target else True)
        if unprepared is not None:
            self._failed = unprepared.message
        if told and shrinking:
            assert decision.replicas is not None
            await self._patch_sts({"spec": {"replicas": decision.replicas}})
        if decision.warning:
            await self._event(sts, "Warning", "ReplicasRestored", decision.warning)
        if decision.event and told:
            await self._event(sts, "Normal", decision.phase.value, decision.event)
        text = f"{decision.phase.value}: {decision.message}" if told else f"{decision.phase.value}: {self._failed}"
        if (sts["metadata"].get("annotations") or {}).get(scaling.ANNOTATION_STATUS) != text:
            await self._patch_sts({"metadata": {"annotations": {scaling.ANNOTATION_STATUS: text}}})
            if decision.phase is scaling.Phase.STALLED or not told:
                reason = decision.phase.value if told or unprepared is not None else "SetClusterFailed"
                await self._event(sts, "Warning", reason, text)
        if target is not None:
            self.ring_pods = target.size // observed.processes
            if self.conf.replication > 1:
                await self.report_replication(sts, target, observed)
        self.last = decision
        return decision

    async def report_replication(self, sts: Mapping[str, Any], target: mb.Membership, o: scaling.Observed) -> None:
        """The slots' Leases and answering replicas into the StatefulSet's lmq.io/replication and the metrics; an
        Event when the condition's reason changes. A failure is logged: it never stops the membership pass."""
        found = self._leases if self._leases is not None else await self._list_leases()
        self._leases = None  # read again by the next pass
        if found is None:
            return
        if not target.leaving_slots and o.replicas * o.processes == len(target.members):  # no change under way
            await self._delete_removed(found, len(target.members))
        answering = {slot for slot, view in o.views.items() if view is not None}
        seen = replicas.report(
            found,
            self.conf.slot_lease_prefix,
            len(target.members),
            o.processes,
            self.conf.replication,
            answering,
            datetime.now(UTC),
        )
        self.replication = seen
        metrics.REPLICATION_SLOTS.labels("unheld").set(len(seen.unheld))
        metrics.REPLICATION_SLOTS.labels("under_replicated").set(len(seen.under_replicated))
        metrics.REPLICATION_SLOTS.labels("all").set(len(seen.slots))
        text = seen.annotation()
        before = (sts["metadata"].get("annotations") or {}).get(replicas.ANNOTATION)
        if before == text:
            return
        await self._patch_sts({"metadata": {"annotations": {replicas.ANNOTATION: text}}})
        old_reason = str(json.loads(before).get("reason")) if before else None
        if old_reason != seen.reason.value:
            kind = "Normal" if seen.reason is replicas.Reason.REPLICATED else "Warning"
            await self._event(sts, kind, seen.reason.value, seen.message)

    async def _delete_removed(self, leases: Sequence[Mapping[str, Any]], slots: int) -> None:
        """Delete the Leases of the slots a finished scale-down removed (``replicas.removed``: beyond the ring, their
        pod gone, held by nobody), each only as listed (a precondition on its resourceVersion: one written since,
        by a pod that came back, stays). A later scale-up's pod of that slot creates its Lease afresh. A failure
        is logged; the next pass tries again."""
        gone = replicas.removed(leases, self.conf.slot_lease_prefix, slots, set(self._asks), datetime.now(UTC))
        for name, version in gone:
            body = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(
                resource_version=version or None))  # fmt: skip
            try:
                await self._call("CoordinationV1Api", "delete_namespaced_lease", name, self._ns, body=body)
            except kubernetes.client.ApiException as exc:
                if exc.status not in {404, 409} and name not in self._undeleted:  # gone / written since: next pass
                    self._undeleted.add(name)  # logged once (tried again each pass)
                    log.warning("replication: the removed slot's Lease %s not deleted: %s %s", name, exc.status,
                                exc.reason)  # fmt: skip
                continue
            log.info("replication: Lease %s of a slot the ring no longer has deleted", name)

    async def _prepare(self, target: mb.Membership, slots: Sequence[int]) -> scaling.Unprepared | None:
        """Every resource onto the joining slots' brokers, before anyone is told they are members."""
        if not slots:
            return None
        brokers = []
        for slot in slots:
            endpoint = self._asks.get(slot)
            if endpoint is None:
                return scaling.Unprepared(
                    f"waiting for {target.members[slot]} (slot {slot}) to be published: not told yet"
                )
            ordinal, process = divmod(slot, self.conf.processes)
            name = f"{self.conf.broker_statefulset}-{ordinal}"
            brokers.append(model.Broker(name if self.conf.processes == 1 else f"{name}-p{process}", endpoint, ordinal))
        found = await self.prepare(brokers)
        if found is not None:
            joiners = ", ".join(target.members[s] for s in slots)
            text = f"the joining brokers ({joiners}) do not hold every resource yet, no broker is told: {found.message}"
            return scaling.Unprepared(text, found.stalled)
        log.info("joining brokers %s hold every resource", ", ".join(b.name for b in brokers))
        return None

    async def _tell(self, target: mb.Membership, slots: Sequence[int], epoch: int | None = None) -> bool:
        """SetCluster on each slot in order, all with the same epoch; stops at the first refusal (the next pass
        observes and retries with the same epoch)."""
        for slot in slots:
            endpoint = self._asks.get(slot)
            if endpoint is None:
                self._failed = f"no endpoint for slot {slot}"
                return False
            mine = slot if slot < len(target.members) else -1
            try:
                await self._admin(endpoint).set_cluster(target.members, target.sizes, slot=mine, epoch=epoch or 0)
            except errors.LmqError as exc:
                self._failed = f"SetCluster on {endpoint} (slot {slot}) failed: {exc.message}"
                log.warning("%s", self._failed)
                return False
        return True

    async def close(self) -> None:
        for admin in self._admins.values():
            with contextlib.suppress(Exception):
                await admin.close()
        self._admins.clear()


async def run(scaler: Scaler, interval_s: float) -> None:
    """Pass after pass until cancelled; a failed pass is logged and the next one observes everything again."""
    while True:
        try:
            decision = await scaler.run_once()
            log.info("broker membership: %s: %s", decision.phase.value, decision.message)
        except asyncio.CancelledError:
            raise
        except LookupError as exc:
            log.warning("broker membership: %s", exc)
        except Exception:
            log.exception("broker membership pass failed")
        await asyncio.sleep(interval_s)
