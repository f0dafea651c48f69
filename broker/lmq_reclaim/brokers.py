"""The only module of the job that talks to brokers: the admin service's scan, compare-and-delete and
the few unary calls the driver needs, over the generated ``lmq.admin.v1`` stubs.

The hot paths stay columnar end to end: a scan response's repeated fields become Arrow arrays without a
Python object per row in our code, and a delete request is filled from Arrow columns. gRPC failures are
turned into ``lmq_broker.errors`` values here and nowhere else, so a caller decides per broker whether to
carry on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Self, cast

import grpc
import pyarrow as pa

from lmq_broker import errors
from lmq_broker.admin.tls import ClientTls
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc
from lmq_reclaim import columns as c
from lmq_reclaim import report
from lmq_reclaim.columns import Outcome
from lmq_reclaim.keyspace import KeyRange

UNARY_TIMEOUT_S: Final = 30.0
_CHANNEL_OPTIONS: Final = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
]
_UNAVAILABLE: Final = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_OUTCOME_NAMES: Final = {
    admin_pb2.DELETED: Outcome.DELETED.value,
    admin_pb2.KEPT_CHANGED: Outcome.KEPT_CHANGED.value,
    admin_pb2.KEPT_SUBSCRIBED: Outcome.KEPT_SUBSCRIBED.value,
    admin_pb2.NOT_FOUND: Outcome.NOT_FOUND.value,
    admin_pb2.WOULD_DELETE: Outcome.WOULD_DELETE.value,
}


@dataclass(frozen=True, slots=True)
class Credentials:
    """Keys of brokers that require signed calls (the v2 HMAC scheme guards the admin service too)."""

    access_key: str
    secret_key: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What a broker did with a run's records, by parent name (see RecordReclaimRunsResponse)."""

    recorded: tuple[str, ...]
    unknown_parents: tuple[str, ...]
    superseded: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ParentPolicy:
    name: str
    expiration_minutes: int
    lite_topic_count: int


def _translate(endpoint: str, exc: grpc.RpcError) -> errors.LmqError:
    # Errors raised by a call are also grpc.Call objects (code, details); anything else is UNKNOWN.
    call = cast(grpc.Call, exc) if hasattr(exc, "code") else None
    code = call.code() if call is not None else grpc.StatusCode.UNKNOWN
    detail = call.details() if call is not None else str(exc)
    text = f"{endpoint}: {code.name}: {detail}"
    if code in _UNAVAILABLE:
        return errors.BrokerUnavailable(text, endpoint=endpoint, code=code.name)
    return errors.LmqError(text, endpoint=endpoint, code=code.name)


class BrokerAdmin:
    """A connection to one broker's admin service. Use as a context manager; not shared across threads."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = UNARY_TIMEOUT_S,
        credentials: Credentials | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._credentials = credentials
        if tls is None:
            self._channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        else:
            options = [*_CHANNEL_OPTIONS, *tls.options()]
            self._channel = grpc.secure_channel(endpoint, tls.credentials(), options=options)
        self._stub = admin_pb2_grpc.LmqAdminStub(self._channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self._credentials is None:
            return ()
        return auth.sign_metadata(self._credentials.access_key, self._credentials.secret_key, auth.utc_now())

    # --- driver side: small unary calls ----------------------------------------------------------------
    def broker_name(self) -> str:
        try:
            reply = self._stub.GetBrokerInfo(
                admin_pb2.GetBrokerInfoRequest(skip_undrained=True), timeout=self.timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as exc:
            raise _translate(self.endpoint, exc) from exc
        return reply.broker_name

    def parents(self) -> list[ParentPolicy]:
        try:
            reply = self._stub.ListParentTopics(
                admin_pb2.ListParentTopicsRequest(), timeout=self.timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as exc:
            raise _translate(self.endpoint, exc) from exc
        return [ParentPolicy(t.topic.name, t.topic.expiration_minutes, t.lite_topic_count) for t in reply.topics]

    def first_key_after(self, parent: str, after: str) -> str | None:
        """The smallest lite name of ``parent`` greater than ``after`` (a key-space probe)."""
        try:
            reply = self._stub.ListLiteTopics(
                admin_pb2.ListLiteTopicsRequest(parent=parent, start_after=after, limit=1),
                timeout=self.timeout_s,
                metadata=self._metadata(),
            )
        except grpc.RpcError as exc:
            raise _translate(self.endpoint, exc) from exc
        return reply.topics[0].lite if reply.topics else None

    def record_run(self, out: report.Report, parents: Mapping[str, report.ParentSummary]) -> Recorded:
        """Leave ``out``'s summary of each of ``parents`` (this broker's share) as that parent's last run."""
        runs = [
            admin_pb2.ReclaimRun(
                parent=parent,
                run_id=out.run_id,
                start_ms=out.now_ms,
                finish_ms=out.finish_ms,
                scanned=counts.scanned,
                expired=counts.expired,
                reclaimed=counts.reclaimed,
                kept_changed=counts.kept_changed,
                kept_subscribed=counts.kept_subscribed,
                not_found=counts.not_found,
                errors=counts.errors,
                dry_run=out.dry_run,
            )
            for parent, counts in parents.items()
        ]
        try:
            reply = self._stub.RecordReclaimRuns(
                admin_pb2.RecordReclaimRunsRequest(runs=runs), timeout=self.timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as exc:
            raise _translate(self.endpoint, exc) from exc
        return Recorded(tuple(reply.recorded), tuple(reply.unknown_parents), tuple(reply.superseded))

    # --- executor side: the columnar hot paths ---------------------------------------------------------
    def scan(
        self,
        *,
        broker: str,
        parent: str,
        key_range: KeyRange,
        batch_size: int,
        with_fully_consumed: bool,
        timeout_s: float,
        idle_since_before_ms: int = 0,
    ) -> Iterator[pa.RecordBatch]:
        """The rows of one key range of one parent, as Arrow batches in the ``columns.SCANNED`` schema."""
        request = admin_pb2.ScanLiteTopicsRequest(
            parent=parent,
            start_after=key_range.start_after,
            end_before=key_range.end_before,
            batch_size=batch_size,
            with_subscribers=True,
            with_fully_consumed=with_fully_consumed,
            idle_since_before_ms=idle_since_before_ms,
        )
        try:
            for reply in self._stub.ScanLiteTopics(request, timeout=timeout_s, metadata=self._metadata()):
                n = len(reply.lite)
                if n:
                    yield _scan_batch(broker, reply, n)
        except grpc.RpcError as exc:
            raise _translate(self.endpoint, exc) from exc

    def compare_and_delete(self, rows: pa.RecordBatch, *, dry_run: bool, timeout_s: float) -> pa.Array:
        """Outcome names (``columns.Outcome``) for each row of ``rows`` (parent, lite, expected columns and
        the subscriber count the scan saw: a subscriber beyond it keeps the row)."""
        return self.start_compare_and_delete(rows, dry_run=dry_run, timeout_s=timeout_s).result()

    def start_compare_and_delete(self, rows: pa.RecordBatch, *, dry_run: bool, timeout_s: float) -> PendingDelete:
        """Send the call and return at once: the caller prepares its next call while the broker works."""
        request = admin_pb2.CompareAndDeleteRequest(
            parent=rows.column(c.PARENT).to_pylist(),
            lite=rows.column(c.LITE).to_pylist(),
            expected_max_offset=rows.column(c.MAX_OFFSET).to_pylist(),
            expected_last_store_ms=rows.column(c.LAST_STORE_MS).to_pylist(),
            expected_last_consume_ms=rows.column(c.LAST_CONSUME_MS).to_pylist(),
            require_no_subscribers=True,
            dry_run=dry_run,
            expected_subscriber_count=rows.column(c.SUBSCRIBER_COUNT).to_pylist(),
        )
        try:
            call = self._stub.CompareAndDeleteLiteTopics.future(request, timeout=timeout_s, metadata=self._metadata())
        except grpc.RpcError as exc:
            raise _translate(self.endpoint, exc) from exc
        return PendingDelete(self.endpoint, rows.num_rows, call)


class PendingDelete:
    """A compare-and-delete call in flight; ``result`` waits for its outcome names."""

    def __init__(self, endpoint: str, rows: int, call: grpc.Future[admin_pb2.CompareAndDeleteResponse]) -> None:
        self._endpoint = endpoint
        self._rows = rows
        self._call = call

    def result(self) -> pa.Array:
        try:
            reply = self._call.result()
        except grpc.RpcError as exc:
            raise _translate(self._endpoint, exc) from exc
        if len(reply.outcome) != self._rows:
            raise errors.LmqError(
                f"{self._endpoint}: {len(reply.outcome)} outcomes for {self._rows} rows", endpoint=self._endpoint
            )
        names = [_OUTCOME_NAMES.get(o, Outcome.ERROR.value) for o in reply.outcome]
        return pa.array(names, pa.string())


def _scan_batch(broker: str, reply: admin_pb2.ScanLiteTopicsResponse, n: int) -> pa.RecordBatch:
    fully = pa.array(reply.fully_consumed, pa.bool_()) if len(reply.fully_consumed) == n else pa.nulls(n, pa.bool_())
    return pa.RecordBatch.from_arrays(
        [
            pa.array(itertools.repeat(broker, n), pa.string(), size=n),
            pa.array(reply.parent, pa.string()),
            pa.array(reply.lite, pa.string()),
            pa.array(reply.created_ms, pa.int64()),
            pa.array(reply.last_store_ms, pa.int64()),
            pa.array(reply.last_consume_ms, pa.int64()),
            pa.array(reply.min_offset, pa.int64()),
            pa.array(reply.max_offset, pa.int64()),
            pa.array(reply.subscriber_count, pa.int32())
            if len(reply.subscriber_count) == n
            else pa.repeat(0, n).cast(pa.int32()),
            fully,
        ],
        schema=c.SCANNED,
    )
