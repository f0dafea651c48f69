"""Fixtures of the reclaim suite: a real local SparkSession per module (built the way the job builds its
own), real broker processes, and a store-level seeder that writes lite topics of known ages."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from pyspark.sql import SparkSession

from lmq_broker import config, model, testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2, service_pb2, service_pb2_grpc
from lmq_broker.storage.store import open_store
from lmq_reclaim import options, session


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    opts = options.Options(brokers=("unused:1",), master="local[1]", local_dir=tmp_path_factory.mktemp("spark"))
    active = session.build(opts)
    yield active
    active.stop()


# --- real brokers holding lite topics of known ages ------------------------------------------------------
MINUTE_MS = 60_000


# (parent, lite, stored minutes before now, consumed minutes before now or None): one message stored then;
# when consumed, group "G" committed the offset past it then.
Seed = tuple[str, str, int, int | None]
Seeder = Callable[[Path, int, Sequence[model.ParentTopic], Sequence[model.LiteGroup], Sequence[Seed]], None]


def seed_store(
    data_dir: Path,
    now_ms: int,
    parents: Sequence[model.ParentTopic],
    groups: Sequence[model.LiteGroup],
    seeds: Sequence[Seed],
) -> None:
    """Write metadata through the store API with an injected clock, before the broker owns the directory."""
    clock = [now_ms]
    store = open_store(config.StoreConfig(data_dir=data_dir), clock=lambda: clock[0])
    try:
        for p in parents:
            store.put_parent_topic(p)
        for g in groups:
            store.put_group(g)
        for i, (parent, lite, stored_min, _) in enumerate(seeds):
            clock[0] = now_ms - stored_min * MINUTE_MS
            store.append([lite_message(parent, lite, f"seed-{i}")])
        for parent, lite, _, consumed_min in seeds:
            if consumed_min is not None:
                clock[0] = now_ms - consumed_min * MINUTE_MS
                store.commit_offset(model.QueueId.lmq(parent, lite), "G", 1)
    finally:
        store.close()


def lite_message(parent: str, lite: str, message_id: str) -> model.NewMessage:
    return model.NewMessage(
        message_id=message_id,
        topic=parent,
        body=b"x",
        queues=(model.QueueId(parent, 0), model.QueueId.lmq(parent, lite)),
        lite_topic=lite,
        message_type=model.MessageType.LITE,
    )


class V2Client:
    """Just enough of the apache.rocketmq.v2 wire to change a topic behind the reclaimer's back."""

    def __init__(self, endpoint: str, client_id: str = "reclaim-test-client") -> None:
        self._channel = grpc.insecure_channel(endpoint)
        self._stub = service_pb2_grpc.MessagingServiceStub(self._channel)
        self._metadata = (("x-mq-client-id", client_id), ("x-mq-language", "PYTHON"))

    def close(self) -> None:
        self._channel.close()

    def send(self, parent: str, lite: str) -> None:
        message = definition_pb2.Message(
            topic=definition_pb2.Resource(name=parent),
            body=b"late",
            system_properties=definition_pb2.SystemProperties(
                lite_topic=lite,
                message_id=uuid.uuid4().hex.upper(),
                message_type=definition_pb2.LITE,
                body_encoding=definition_pb2.IDENTITY,
            ),
        )
        reply = self._stub.SendMessage(
            service_pb2.SendMessageRequest(messages=[message]), metadata=self._metadata, timeout=10
        )
        assert reply.status.code == definition_pb2.OK, reply.status

    def subscribe(self, parent: str, group: str, lite: str) -> None:
        request = service_pb2.SyncLiteSubscriptionRequest(
            action=definition_pb2.PARTIAL_ADD,
            topic=definition_pb2.Resource(name=parent),
            group=definition_pb2.Resource(name=group),
            lite_topic_set=[lite],
        )
        reply = self._stub.SyncLiteSubscription(request, metadata=self._metadata, timeout=10)
        assert reply.status.code == definition_pb2.OK, reply.status


@pytest.fixture
def seeder() -> Seeder:
    return seed_store


@pytest.fixture
def v2_client() -> Iterator[Callable[..., V2Client]]:
    made: list[V2Client] = []

    def make(endpoint: str, client_id: str = "reclaim-test-client") -> V2Client:
        made.append(V2Client(endpoint, client_id))
        return made[-1]

    yield make
    for client in made:
        client.close()


@pytest.fixture
def start_brokers(tmp_path: Path) -> Iterator[Callable[[int], list[testing.BrokerProcess]]]:
    started: list[testing.BrokerProcess] = []

    def start(count: int) -> list[testing.BrokerProcess]:
        for i in range(count):
            started.append(
                testing.start_broker(
                    tmp_path / f"broker-{i}",
                    extra_args=["--no-bootstrap", "--broker-name", f"broker-{i}"],
                    env=testing.SHARED_ADMIN_ENV,
                )
            )
        return started

    yield start
    for b in started:
        b.stop()


@pytest.fixture(autouse=True)
def reclaim_admin_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job signs with the brokers' shared admin pair, from the variables the chart sets (options read them
    when parsing; job subprocesses inherit them)."""
    monkeypatch.setenv("LMQ_RECLAIM_ACCESS_KEY", testing.SHARED_ADMIN_KEYS["access_key"])
    monkeypatch.setenv("LMQ_RECLAIM_SECRET_KEY", testing.SHARED_ADMIN_KEYS["secret_key"])
