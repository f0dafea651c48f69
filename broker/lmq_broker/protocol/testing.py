"""Test harness for the wire layer: an async v2 stub on a channel to a running broker, for suites that do
not import the official client (tests/broker), plus the headers an official client would send."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc
from lmq_broker.storage.api import Store


@dataclass
class Client:
    channel: grpc.aio.Channel
    stub: service_pb2_grpc.MessagingServiceAsyncStub
    endpoint: str
    store: Store  # the broker's store, for assertions on what was (not) stored

    @staticmethod
    def headers(
        client_id: str = "client-1", language: str = "JAVA", version: str = "5.0.8"
    ) -> tuple[tuple[str, str], ...]:
        return (("x-mq-client-id", client_id), ("x-mq-language", language), ("x-mq-client-version", version))

    async def close(self) -> None:
        await self.channel.close(None)


def connect(endpoint: str, store: Store, *, ca_cert: Path | None = None) -> Client:
    if ca_cert is not None:
        channel = grpc.aio.secure_channel(endpoint, grpc.ssl_channel_credentials(ca_cert.read_bytes()))
    else:
        channel = grpc.aio.insecure_channel(endpoint)
    stub = service_pb2_grpc.MessagingServiceStub(channel)
    return Client(channel, stub, endpoint, store)
