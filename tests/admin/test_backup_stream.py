"""The broker's side of ``Backup`` in-process, over a real store: one backup per data directory at a time (a
second is refused and counted), none while the store is unwell, none of an in-memory store, and the staging
links go when the stream does, however it ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from waiting import eventually

from lmq_broker import errors, model
from lmq_broker.admin import backups, service
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.testing import LoopThread
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.api import StaticLiveView
from lmq_broker.protocol import native
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2_grpc
from lmq_broker.storage import memory
from lmq_broker.storage import store as storage_store
from lmq_broker.storage.api import Store


def _fill(store: Store) -> None:
    lmq = model.QueueId.lmq("P", "a")
    store.append([model.NewMessage(f"m{i}", "P", b"x" * 100, (lmq,), lite_topic="a") for i in range(10)])


def test_a_second_backup_is_refused_while_one_runs(lmq_store: Store, broker_config: BrokerConfig) -> None:
    _fill(lmq_store)
    data_dir = broker_config.store.data_dir
    first, second = backups.Backups(lmq_store, data_dir), backups.Backups(lmq_store, data_dir)  # two admin ports

    async def scenario() -> None:
        stream = first.stream(pb.BackupRequest(chunk_bytes=64))
        part = await anext(stream)  # the snapshot is taken, the first chunk on its way
        assert part.chunk.path == "commitlog/0000000000.log" and (data_dir / backups.STAGING).is_dir()
        refused = backups.TALLY.refused
        with pytest.raises(errors.Conflict, match="already running"):
            await anext(second.stream(pb.BackupRequest()))
        assert backups.TALLY.refused == refused + 1
        await stream.aclose()  # the caller went away
        assert not (data_dir / backups.STAGING).exists()
        parts = [p async for p in second.stream(pb.BackupRequest())]  # free again
        assert parts[-1].WhichOneof("part") == "manifest"
        assert {f.path for f in parts[-1].manifest.files} >= {"commitlog/0000000000.log", "meta/CURRENT"}

    asyncio.run(scenario())


def test_no_backup_while_the_store_is_unwell_or_in_memory(tmp_path: Path, lmq_store: Store) -> None:
    assert isinstance(lmq_store, storage_store.LmqStore)
    lmq_store._core.rebuilding = "a damaged block"  # as a read that found one sets it
    try:
        with pytest.raises(errors.BrokerUnavailable, match="index rebuilding"):
            lmq_store.snapshot(tmp_path / "staging")
    finally:
        lmq_store._core.rebuilding = None

    async def scenario() -> None:
        with pytest.raises(errors.Unsupported):
            await anext(backups.Backups(memory.MemoryStore(), tmp_path).stream(pb.BackupRequest()))
        with pytest.raises(errors.InvalidArgument, match="chunk_bytes"):
            await anext(backups.Backups(lmq_store, tmp_path).stream(pb.BackupRequest(chunk_bytes=8 << 20)))

    asyncio.run(scenario())


@pytest.mark.parametrize("edge", ["native", "grpcio"])
def test_a_caller_that_stops_reading_is_cut_off_and_lets_go_of_the_broker(
    lmq_store: Store, broker_config: BrokerConfig, loop_thread: LoopThread, monkeypatch: pytest.MonkeyPatch, edge: str
) -> None:
    """On either edge (``--edge``), a caller that takes the first message and then nothing (a suspended
    ``lmq-admin backup``) is cut off after ``STALL_S``: the staging links go and the next backup runs. Before
    2026-11-30 its write waited on flow control for as long as the connection lived, every later backup refused
    "already running" and the linked segments kept from retention."""
    monkeypatch.setattr(backups, "STALL_S", 1.0)
    body = b"x" * 100_000
    lmq = model.QueueId.lmq("P", "a")
    for i in range(200):  # 20 MB: more than the connection's windows and buffers hold
        lmq_store.append([model.NewMessage(f"m{i}", "P", body, (lmq,), lite_topic="a")])
    data_dir = broker_config.store.data_dir
    live = StaticLiveView(store=lmq_store)

    async def start() -> tuple[native.NativeServer | grpc.aio.Server, int]:
        server: native.NativeServer | grpc.aio.Server
        if edge == "native":
            server = native.NativeServer(64 << 20, 8)
            port = server.listen("127.0.0.1", 0)
        else:
            server = grpc.aio.server()
            port = server.add_insecure_port("127.0.0.1:0")
        service.register(server, lmq_store, live, broker_config, admin_keys=None)
        await server.start()
        return server, port

    server, port = loop_thread.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 8 << 20)]) as ch:
            stalled = admin_pb2_grpc.LmqAdminStub(ch).Backup(pb.BackupRequest(chunk_bytes=65536))
            assert next(iter(stalled)).chunk.path == "commitlog/0000000000.log"  # and then nothing is read
            eventually(lambda: not (data_dir / backups.STAGING).exists(), "the stalled backup let go", timeout_s=30)
            with AdminClient(f"127.0.0.1:{port}", 30.0) as admin:
                assert admin.backup(Path(f"{data_dir}-snap")).files >= 2
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stalled:
                    pass
            assert ended.value.code() == grpc.StatusCode.CANCELLED
    finally:
        loop_thread.run(server.stop(None))
