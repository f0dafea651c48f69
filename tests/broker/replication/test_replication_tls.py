"""Copy calls with TLS and client auth (docs/replication.md, *Leadership and fencing*): a replicated pair (R = 2,
--min-insync-replicas 2) started with the cluster's TLS flags (--tls-cert, --tls-key, --tls-ca) and client auth
(--access-key, --secret-key), on a real kube-apiserver + etcd. The copies travel the cluster's TLS channels
with the peer header, which client auth does not stand in the way of: sends signed by a client are
acknowledged, so stored on the follower too. A replica call from outside without a valid peer header, over the
same TLS port, is refused PERMISSION_DENIED whatever else it carries (a client's valid signature, a forged peer
header) and counted in ``lmq_replication_copies_refused_total{reason="not_peer"}``; an unsigned client send
gets the v2 status UNAUTHORIZED."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from partitions import held
from raw_v2 import metric
from waiting import eventually

from lmq_broker import model, testing
from lmq_broker.cluster import membership as mb
from lmq_broker.cluster import trust
from lmq_broker.protocol import auth
from lmq_broker.protocol import testing as protocol_testing
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as service_grpc
from lmq_broker.replication import kube as kube_api
from lmq_broker.replication import setup as replication_setup
from lmq_broker.supervisor import free_ports
from lmq_operator import testing as kube_testing

PARENT = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
ACCESS, SECRET = "client-ak", "client-sk"
SENDS = 30
REFUSED = "lmq_replication_copies_refused_total"


def start(
    tmp_path: Path, kube: kube_testing.KubeAPI, cert: testing.Certificate, members: list[str], slot: int
) -> testing.BrokerProcess:
    token = tmp_path / "token"
    token.write_text(kube.token)
    flags = ["--peers", ",".join(members), "--ordinal", str(slot), "--advertised-address", members[slot]]
    flags += ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key), "--tls-ca", str(cert.ca)]
    flags += ["--access-key", ACCESS, "--secret-key", SECRET, "--admin-access-key", "ak", "--admin-secret-key", "sk"]
    flags += ["--flush-mode", "sync", "--replicas", "2", "--lease-namespace", "default", "--lease-prefix", "tls"]
    flags += ["--lease-duration-ms", "1500", "--kube-api-server", kube.server]
    flags += ["--kube-token-file", str(token), "--kube-ca-file", str(kube.ca_file)]
    return testing.start_broker(tmp_path / f"b{slot}", int(members[slot].rsplit(":", 1)[1]), flags)


def channel(cert: testing.Certificate, endpoint: str) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(endpoint, grpc.ssl_channel_credentials(cert.ca.read_bytes()))


def client_headers(*, signed: bool) -> tuple[tuple[str, str], ...]:
    plain = protocol_testing.Client.headers("client-1", "PYTHON", "5.1.2")
    return (*plain, *auth.sign_metadata(ACCESS, SECRET, auth.utc_now())) if signed else plain


async def send_all(cert: testing.Certificate, endpoint: str, lite: str, *, signed: bool = True) -> list[int]:
    """Each send's v2 status code, one by one."""
    codes: list[int] = []
    async with channel(cert, endpoint) as ch:
        stub = service_grpc.MessagingServiceStub(ch)
        for n in range(SENDS):
            props = pb.SystemProperties(message_id=f"{lite}-{n}", message_type=pb.LITE, lite_topic=lite)
            msg = pb.Message(topic=pb.Resource(name=PARENT), body=f"{n}".encode(), system_properties=props)
            request = spb.SendMessageRequest(messages=[msg])
            reply = await stub.SendMessage(request, metadata=client_headers(signed=signed), timeout=10)
            codes.append(reply.status.code)
    return codes


async def outsiders(cert: testing.Certificate, endpoint: str) -> list[grpc.StatusCode]:
    """Replica calls from outside the cluster over TLS, none with a valid peer header: their gRPC codes."""
    forged = trust.header(b"not the cluster's secret", replication_setup.METHOD, 1, int(time.time() * 1000))
    calls = [
        (replication_setup.METHOD, client_headers(signed=False)),
        (replication_setup.METHOD, client_headers(signed=True)),  # a client's signature is no peer's
        (replication_setup.METHOD, (forged,)),
        (replication_setup.ENDS, client_headers(signed=True)),
        (replication_setup.FETCH, client_headers(signed=True)),
        (replication_setup.COPY_SOCKET, client_headers(signed=True)),
    ]
    codes: list[grpc.StatusCode] = []
    async with channel(cert, endpoint) as ch:
        for method, metadata in calls:
            try:
                await ch.unary_unary(method, None, None)(b"{}", metadata=metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            else:
                codes.append(grpc.StatusCode.OK)
        stream = ch.stream_stream(replication_setup.STREAM, None, None)(None, metadata=client_headers(signed=True))
        try:
            await stream.write(b"{}")
            await stream.read()
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
        else:
            codes.append(grpc.StatusCode.OK)
    return codes


async def copy_socket_of(cert: testing.Certificate, endpoint: str) -> bytes:
    """The answer of ``CopySocket`` to a peer (the cluster secret is derived from the admin secret key)."""
    secret = trust.secret_of("", "sk")
    header = trust.header(secret, replication_setup.COPY_SOCKET, 0, int(time.time() * 1000))
    async with channel(cert, endpoint) as ch:
        answer: bytes = await ch.unary_unary(replication_setup.COPY_SOCKET, None, None)(
            b"", metadata=(header,), timeout=10
        )
    return answer


def test_copies_flow_over_tls_with_client_auth_and_a_call_from_outside_is_refused_and_counted(
    tmp_path: Path, kube: kube_testing.KubeAPI
) -> None:
    cert = testing.issue_certificate(tmp_path / "tls", "127.0.0.1")
    members = [f"127.0.0.1:{p}" for p in free_ports("127.0.0.1", 2)]
    brokers = [start(tmp_path, kube, cert, members, slot) for slot in (0, 1)]
    api = kube_api.ApiServer(kube.server, kube.token, kube.ca_file, "default")
    membership = mb.Membership.parse(",".join(members))
    lite = next(f"t{i}" for i in range(1000) if mb.owner(membership, model.QueueId.lmq(PARENT, f"t{i}").topic) == 0)
    try:
        eventually(lambda: (got := api.get("tls-slot-0")) is not None and got.in_sync == (0, 1), "follower in sync")
        # Through the follower: the send is forwarded to the owner over TLS, and copied back over TLS.
        codes = asyncio.run(send_all(cert, members[1], lite))
        assert codes == [pb.OK] * SENDS
        assert metric(brokers[1], "lmq_replication_copied_total") >= SENDS
        refused = asyncio.run(send_all(cert, members[0], lite, signed=False))
        assert set(refused) == {pb.UNAUTHORIZED}
        before = metric(brokers[1], REFUSED, reason="not_peer")
        got = asyncio.run(outsiders(cert, members[1]))
        print(f"\nreplica calls from outside: {[c.name for c in got]}")
        assert got == [grpc.StatusCode.PERMISSION_DENIED] * 7
        assert metric(brokers[1], REFUSED, reason="not_peer") == before + 7
        # With TLS no copy socket is opened (it carries no TLS): a peer asking for it is told there is none
        assert asyncio.run(copy_socket_of(cert, members[1])) == b""
        assert before == 0  # the owner's own copies all verified
    finally:
        for b in brokers:
            b.stop()
    for slot in (0, 1):
        assert held(tmp_path / f"b{slot}", lite) == [f"{lite}-{n}" for n in range(SENDS)], slot
