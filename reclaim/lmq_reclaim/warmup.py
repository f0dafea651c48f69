"""``python -m lmq_reclaim.warmup FILE``: write the class archive that ``--class-archive FILE`` then maps.

An archive must come from the same JDK and jars as the runs that map it, so the place to make it is where
those are fixed: the image build. No broker exists there, so this runs the real job (planning probes, scan,
decide, checkpoints, the per-broker shuffle, deletes, audit) against a synthetic broker served in this
process: a few thousand made-up lite topics, every one expired, every delete answered DELETED. The JVM loads
the classes a real run loads and writes them out as it exits.
"""

from __future__ import annotations

import bisect
import sys
import tempfile
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Final

import grpc

from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2, admin_pb2_grpc
from lmq_reclaim import job, options, session

PARENT: Final = "Warmup"
TOPICS: Final = 4_000
NOW_MS: Final = 1_750_000_000_000
STORED_MS: Final = NOW_MS - 24 * 3_600_000  # a day before "now": past any expiration below


class SyntheticBroker(admin_pb2_grpc.LmqAdminServicer):
    """Just the admin calls the job makes, over ``TOPICS`` idle lite topics of one parent."""

    def __init__(self) -> None:
        self.lites = [f"lite-{i:06d}" for i in range(TOPICS)]  # sorted, as a broker's keys are
        self.recorded: list[admin_pb2.ReclaimRun] = []

    def GetBrokerInfo(  # noqa: N802 - generated servicer's name
        self, request: admin_pb2.GetBrokerInfoRequest, context: grpc.ServicerContext
    ) -> admin_pb2.GetBrokerInfoResponse:
        return admin_pb2.GetBrokerInfoResponse(broker_name="warmup", lite_topic_count=TOPICS, undrained_messages=-1)

    def ListParentTopics(  # noqa: N802
        self, request: admin_pb2.ListParentTopicsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListParentTopicsResponse:
        topic = admin_pb2.ParentTopic(name=PARENT, message_type=5, expiration_minutes=60, queue_count=1)
        return admin_pb2.ListParentTopicsResponse(
            topics=[admin_pb2.GetParentTopicResponse(topic=topic, lite_topic_count=TOPICS)]
        )

    def ListLiteTopics(  # noqa: N802
        self, request: admin_pb2.ListLiteTopicsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.ListLiteTopicsResponse:
        start = bisect.bisect_right(self.lites, request.start_after)
        names = self.lites[start : start + max(1, request.limit)]
        return admin_pb2.ListLiteTopicsResponse(topics=[admin_pb2.LiteTopicInfo(parent=PARENT, lite=n) for n in names])

    def ScanLiteTopics(  # noqa: N802
        self, request: admin_pb2.ScanLiteTopicsRequest, context: grpc.ServicerContext
    ) -> Iterator[admin_pb2.ScanLiteTopicsResponse]:
        start = bisect.bisect_right(self.lites, request.start_after)
        stop = bisect.bisect_left(self.lites, request.end_before) if request.end_before else len(self.lites)
        size = request.batch_size or 1_000
        for first in range(start, stop, size):
            names = self.lites[first : min(stop, first + size)]
            n = len(names)
            yield admin_pb2.ScanLiteTopicsResponse(
                parent=[PARENT] * n,
                lite=names,
                created_ms=[STORED_MS] * n,
                last_store_ms=[STORED_MS] * n,
                last_consume_ms=[0] * n,
                min_offset=[0] * n,
                max_offset=[1] * n,
                subscriber_count=[0] * n if request.with_subscribers else [],
                fully_consumed=[True] * n if request.with_fully_consumed else [],
            )

    def CompareAndDeleteLiteTopics(  # noqa: N802
        self, request: admin_pb2.CompareAndDeleteRequest, context: grpc.ServicerContext
    ) -> admin_pb2.CompareAndDeleteResponse:
        outcome = admin_pb2.WOULD_DELETE if request.dry_run else admin_pb2.DELETED
        return admin_pb2.CompareAndDeleteResponse(outcome=[outcome] * len(request.lite))

    def RecordReclaimRuns(  # noqa: N802
        self, request: admin_pb2.RecordReclaimRunsRequest, context: grpc.ServicerContext
    ) -> admin_pb2.RecordReclaimRunsResponse:
        self.recorded = list(request.runs)
        return admin_pb2.RecordReclaimRunsResponse(recorded=[r.parent for r in request.runs])


def write_archive(archive: Path, extra_args: Sequence[str] = ()) -> bool:
    """Run the job once against a synthetic broker with ``--class-archive archive``; True when written."""
    archive.unlink(missing_ok=True)  # the point is a fresh one: an existing file would be mapped, not written
    with tempfile.TemporaryDirectory(prefix="lmq-reclaim-warmup-") as scratch:

        def parse(endpoint: str) -> options.Options:
            return options.parse(
                [
                    *("--brokers", endpoint, "--now-ms", str(NOW_MS), "--class-archive", str(archive)),
                    *("--local-dir", str(Path(scratch) / "spark"), "--audit-path", str(Path(scratch) / "audit")),
                    *("--max-deletes-per-second", "0", "--rows-per-task", str(TOPICS // 4), "--log-level", "WARNING"),
                    *extra_args,
                ]
            )

        # Spark's JVM first: launching it forks this process, which gRPC warns about once its threads run.
        spark = session.build(parse("127.0.0.1:1"))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        broker = SyntheticBroker()  # type: ignore[abstract]  # abstract only in the generated stubs
        admin_pb2_grpc.add_LmqAdminServicer_to_server(broker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            report = job.run(parse(f"127.0.0.1:{port}"), spark=spark)
        finally:
            server.stop(None)
            session.stop(spark)  # the JVM writes the archive as it exits
    return report.exit_code == 0 and report.total.reclaimed == TOPICS and archive.exists()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 1 or args[0].startswith("-"):
        print("usage: python -m lmq_reclaim.warmup FILE [job options, e.g. --jvm-options=...]", file=sys.stderr)
        return 2
    archive = Path(args[0])
    if not write_archive(archive, args[1:]):
        print(f"lmq-reclaim warmup: no class archive written to {archive}", file=sys.stderr)
        return 1
    print(f"class archive: {archive} ({archive.stat().st_size // (1 << 20)} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
