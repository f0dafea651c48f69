"""The official client against a broker that requires signatures, and over TLS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer
from rocketmq.grpc_protocol import definition_pb2, service_pb2, service_pb2_grpc

from lmq_broker import errors
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import auth
from lmq_broker.testing import Inbox, start_broker


def lite(topic: str, lite_topic: str, body: bytes) -> Any:
    m = Message()
    m.topic, m.lite_topic, m.body = topic, lite_topic, body
    return m


def test_signed_clients_work_and_wrong_keys_are_refused(tmp_path: Path) -> None:
    with start_broker(tmp_path / "data", extra_args=["--access-key", "ak", "--secret-key", "sk"]) as broker:
        good = ClientConfiguration(broker.endpoint, Credentials("ak", "sk"))
        inbox = Inbox()
        consumer = LitePushConsumer(good, "executor-group", "AGENT_TASK_NS", inbox)
        consumer.startup()
        producer = Producer(good, ("AGENT_TASK_NS",))
        producer.startup()
        bad = Producer(ClientConfiguration(broker.endpoint, Credentials("ak", "wrong")), ("AGENT_TASK_NS",))
        bad.startup()
        try:
            consumer.subscribe_lite("signed")
            producer.send(lite("AGENT_TASK_NS", "signed", b"trusted"))
            assert inbox.wait_for(lambda i: i.bodies() == [b"trusted"], 15)
            # The route lookup is refused (UNAUTHORIZED), which 5.1.2 reports as a failed route fetch.
            with pytest.raises(Exception, match="route"):
                bad.send(lite("AGENT_TASK_NS", "signed", b"forged"))
        finally:
            bad.shutdown()
            producer.shutdown()
            consumer.shutdown()
        assert inbox.bodies() == [b"trusted"]
        with AdminClient(broker.admin_endpoint) as unsigned, pytest.raises(errors.Unauthorized):
            unsigned.list_parent_topics()


def raw_send(endpoint: str, lite_topic: str, metadata: tuple[tuple[str, str], ...]) -> Any:
    """A SendMessage as the official client would send it, with the headers we choose."""
    props = definition_pb2.SystemProperties(
        message_id=f"raw-{lite_topic}", message_type=definition_pb2.LITE, lite_topic=lite_topic,
        body_encoding=definition_pb2.IDENTITY,
    )  # fmt: skip
    message = definition_pb2.Message(
        topic=definition_pb2.Resource(name="AGENT_TASK_NS"), body=b"forged", system_properties=props
    )
    with grpc.insecure_channel(endpoint) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        return stub.SendMessage(service_pb2.SendMessageRequest(messages=[message]), metadata=metadata, timeout=10)


def test_a_badly_signed_send_is_refused_and_stores_nothing(tmp_path: Path) -> None:
    """A producer with a wrong secret already fails at QueryRoute; this sends the SendMessage itself."""
    with start_broker(tmp_path / "data", extra_args=["--access-key", "ak", "--secret-key", "sk"]) as broker:
        now = datetime.now(UTC)
        wrong = auth.sign_metadata("ak", "wrong", now)
        for lite_topic, metadata in (("forged", wrong), ("unsigned", ())):
            reply = raw_send(broker.endpoint, lite_topic, (("x-mq-client-id", "raw"), *metadata))
            assert reply.status.code == definition_pb2.UNAUTHORIZED, reply.status
            assert list(reply.entries) == []
        # The same request, rightly signed, is stored: the refusals above were the signature's doing.
        signed = raw_send(broker.endpoint, "signed", (("x-mq-client-id", "raw"), *auth.sign_metadata("ak", "sk", now)))
        assert signed.status.code == definition_pb2.OK, signed.status
        with AdminClient(broker.admin_endpoint, **broker.admin_keys) as admin:
            assert admin.describe_lite_topic("AGENT_TASK_NS", "signed").meta.max_offset == 1
            for lite_topic in ("forged", "unsigned"):
                with pytest.raises(errors.NotFound):
                    admin.describe_lite_topic("AGENT_TASK_NS", lite_topic)
            assert admin.get_parent_topic("AGENT_TASK_NS").lite_topic_count == 1


def test_tls_with_the_official_client(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert),
        ],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    # The client trusts the system roots only; gRPC reads its roots file from the environment once per
    # process, so the client runs in a child interpreter that trusts our certificate.
    script = textwrap.dedent(
        """
        import sys
        from rocketmq import ClientConfiguration, Credentials, Message, Producer
        producer = Producer(ClientConfiguration(sys.argv[1], Credentials()), ("AGENT_TASK_NS",), tls_enable=True)
        producer.startup()
        m = Message()
        m.topic, m.lite_topic, m.body = "AGENT_TASK_NS", "tls", b"encrypted"
        print("sent", producer.send(m).message_id)
        producer.shutdown()
        """
    )
    with start_broker(tmp_path / "data", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)]) as broker:
        result = subprocess.run(
            [sys.executable, "-c", script, f"localhost:{broker.port}"],
            env={**os.environ, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(cert)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("sent ")
