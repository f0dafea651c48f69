"""Memory a misbehaving client cannot grow without bound, measured on a real broker process."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import grpc
import psutil
from waiting import eventually

from lmq_broker import heap
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.testing import start_broker

MiB: Final = 1024 * 1024
FRAME_BYTES: Final = 160 * 1024
FRAMES: Final = 1000  # 160 MiB of settings frames, each answered with a copy of itself


def test_a_telemetry_stream_that_never_reads_does_not_grow_the_broker(tmp_path: Path) -> None:
    sent = 0
    stop = threading.Event()

    def frames() -> Iterator[spb.TelemetryCommand]:
        nonlocal sent
        settings = pb.Settings(
            client_type=pb.PRODUCER, publishing=pb.Publishing(), user_agent=pb.UA(hostname="h" * FRAME_BYTES)
        )
        for _ in range(FRAMES):
            if stop.is_set():
                return
            yield spb.TelemetryCommand(settings=settings)
            sent += 1
        stop.wait(60)

    with start_broker(tmp_path / "data") as broker, grpc.insecure_channel(broker.endpoint) as channel:
        process = psutil.Process(broker.pid)
        before = process.memory_info().rss
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        call = stub.Telemetry(frames(), metadata=(("x-mq-client-id", "never-reads"),))  # never iterated
        deadline = time.monotonic() + 8
        peak = before
        while time.monotonic() < deadline:  # RSS sampled over a window while the client pushes: the load
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.1)  # the sampling pace, not a wait for anything
        with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as response:
            refused = 'lmq_calls_refused_total{reason="unread",rpc="Telemetry"} 1.0' in response.read().decode()
        stop.set()
        call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leave cancel untyped
        assert broker.alive()
    growth_mib = (peak - before) / MiB
    assert growth_mib < 40, f"RSS grew {growth_mib:.0f} MiB while the client pushed {sent} frames"
    # its replies stopped at --telemetry-stream-buffer-bytes; its frames were read on and dropped (module
    # notes of protocol.handlers.telemetry: a stream that stopped reading would leave grpc core to buffer them)
    assert refused, "the stream was never refused for its unread replies"


def test_trimming_the_heap_hands_freed_memory_back() -> None:
    assert heap.supported(), "glibc's malloc_trim is missing: the broker's periodic trim would be a no-op"
    blocks = [bytes(5000) for _ in range(40_000)]  # ~200 MiB through malloc (too big for Python's arenas)
    del blocks[::2]  # every other block freed: pages stay resident, fragmented between live blocks
    released = heap.trim()
    del blocks
    assert released > 4 * MiB, f"malloc_trim released only {released} bytes"


def test_a_serving_broker_trims_its_heap_periodically(tmp_path: Path) -> None:
    with start_broker(tmp_path / "data", extra_args=["--heap-trim-interval-ms", "100"]) as broker:

        def trimmed_thrice() -> str:
            with urllib.request.urlopen(f"{broker.metrics_url}/metrics", timeout=5) as response:
                text = str(response.read().decode())
            trims = next(float(x.split()[1]) for x in text.splitlines() if x.startswith("lmq_heap_trims_total"))
            return text if trims >= 3 else ""

        text = eventually(trimmed_thrice, "3 heap trims at a 100 ms interval", interval_s=0.1)
        assert "lmq_heap_released_bytes_total" in text
