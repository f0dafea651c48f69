"""``python -m lmq_broker.roundtrip``: one message through a running broker and back, the chart's ``helm test``.

A deployment is only proven by a message that goes in and comes out: the test declares a NORMAL topic of its
own through the admin service, sends one message on the client port, receives it as a SimpleConsumer would,
acks it, and deletes the topic again (also when a step fails), so it leaves nothing behind and needs none of the
bootstrap demo objects that production brokers run without (``--no-bootstrap``). It goes the way the cluster's
callers go: the client port for the message, the admin port (``--admin-endpoint``) with the admin pair
(``LMQ_ADMIN_ACCESS_KEY``/``_SECRET_KEY``) for the topic, and TLS with ``LMQ_TLS_CA``/``LMQ_TLS_SERVER_NAME``
when set. Exit 0 with one line on stdout when the message came back; 1 and the reason on stderr otherwise.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Final

import grpc

from lmq_broker import errors, model
from lmq_broker.admin import credentials
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.tls import ClientTls, client_tls
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc

NAME_PREFIX: Final = "lmq-roundtrip-"
POLL_S: Final = 5


class RoundTripFailed(Exception):
    pass


def _channel(endpoint: str, tls: ClientTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(endpoint)
    return grpc.secure_channel(endpoint, tls.credentials(), options=tls.options())


def _check(status: pb.Status, step: str) -> None:
    if status.code != pb.OK:
        raise RoundTripFailed(f"{step}: {pb.Code.Name(status.code)} {status.message}")


def exchange(endpoint: str, topic: str, tls: ClientTls | None, timeout_s: float) -> float:
    """Send one message to ``topic`` and receive, check and ack it; returns the seconds it took."""
    body = secrets.token_bytes(32)
    headers = (("x-mq-client-id", f"{topic}@roundtrip"),)
    resource = pb.Resource(name=topic)
    started = time.monotonic()
    with _channel(endpoint, tls) as channel:
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        props = pb.SystemProperties(message_id=secrets.token_hex(16), message_type=pb.NORMAL)
        sent = stub.SendMessage(
            spb.SendMessageRequest(messages=[pb.Message(topic=resource, body=body, system_properties=props)]),
            timeout=timeout_s,
            metadata=headers,
        )
        _check(sent.status, "send")
        receive = spb.ReceiveMessageRequest(
            group=pb.Resource(name=topic), message_queue=pb.MessageQueue(topic=resource), batch_size=1
        )
        receive.invisible_duration.seconds = 30
        receive.long_polling_timeout.seconds = POLL_S
        while time.monotonic() - started < timeout_s:
            frames = list(stub.ReceiveMessage(receive, timeout=POLL_S + 10, metadata=headers))
            got = [f.message for f in frames if f.HasField("message")]
            if not got:
                continue
            (message,) = got
            if message.body != body or message.system_properties.message_id != props.message_id:
                raise RoundTripFailed(f"received {message.system_properties.message_id}, not what was sent")
            entry = spb.AckMessageEntry(
                message_id=props.message_id, receipt_handle=message.system_properties.receipt_handle
            )
            acked = stub.AckMessage(
                spb.AckMessageRequest(group=receive.group, topic=resource, entries=[entry]),
                timeout=timeout_s,
                metadata=headers,
            )
            _check(acked.status, "ack")
            return time.monotonic() - started
    raise RoundTripFailed(f"the message sent to {topic} did not come back within {timeout_s:.0f} s")


def run(
    endpoint: str, admin_endpoint: str, keys: credentials.KeyPair | None, tls: ClientTls | None, timeout_s: float
) -> str:
    """The round trip on a topic of its own, deleted again whatever happens; returns the line to print."""
    topic = NAME_PREFIX + secrets.token_hex(6)
    with AdminClient(admin_endpoint, timeout_s, keys=keys, tls=tls) as admin:
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.NORMAL))
        try:
            took = exchange(endpoint, topic, tls, timeout_s)
        except grpc.RpcError as exc:
            raise RoundTripFailed(f"{endpoint}: {exc}") from None
        finally:
            try:
                admin.delete_parent_topic(topic)
            except errors.LmqError as exc:  # reported, without hiding why the exchange failed
                print(f"topic {topic} left behind: {exc.message}", file=sys.stderr)
    return f"one message sent to {endpoint} and received back in {took * 1000:.0f} ms (topic {topic}, deleted)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmq_broker.roundtrip", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True, help="the broker's client port, host:port")
    parser.add_argument("--admin-endpoint", default="", help="its admin port, host:port (default: --endpoint)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole exchange (default 60)")
    args = parser.parse_args(argv)
    try:
        keys = credentials.resolve(data_dir=None, environ=os.environ)
        tls = client_tls()
        print(run(args.endpoint, args.admin_endpoint or args.endpoint, keys, tls, args.timeout), flush=True)
    except (errors.LmqError, RoundTripFailed) as exc:
        print(f"lmq round trip failed: {type(exc).__name__}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
