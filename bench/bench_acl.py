"""Send and receive throughput with access control on (``--acl``) ÷ off, in the same run (issue 29: goal >= 0.95).

Three broker processes run side by side: one plain (no auth, no ACL), one with client auth only (every call
signed, no ACL: what authentication alone costs) and one with ``--acl`` and a realistic policy
table (``--users`` tenants, each with Pub/Sub on its own ``Lite:<parent>/<tenant>-*`` prefix and Sub on its
group, plus a deny entry). The load, from one raw-stub client per broker, alternates between them in
rounds so that both see the same machine: sends are single-message SendMessage calls, ``--in-flight`` at once,
over ``--lite-topics`` lite topics (one check each, a decision-cache entry each); receives drain one lite
topic as a LiteSimpleConsumer does (ReceiveMessage of 32, then 32 concurrent AckMessage, each checked). Under
ACL every call is signed (``MQv2-HMAC-SHA1``) as the official clients sign; the client signs once per second
(the signature covers only the date-time, to the second), so the client's own HMAC does not weigh on the
figure and what is measured is the broker's cost: the signature check, the user lookup and the checks.
Beside the throughput ratios, the brokers' own CPU time per message (from /proc) is printed: on a busy host it
moves less than throughput does.

    python bench/bench_acl.py           # ~1 min
    python bench/bench_acl.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import grpc

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry
from lmq_broker.protocol import auth
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess, start_broker

PARENT, BATCH, TENANT = "shared", 32, "t0"
GROUP = f"{TENANT}-group"
CLIENT_KEYS = ("bench-ak", "bench-secret-key")
Headers = Callable[[], tuple[tuple[str, str], ...]]


def signer(keys: tuple[str, str] | None) -> Headers:
    """The call's headers; signed (once per second, the signature's resolution) when ``keys`` are given."""
    base = (("x-mq-client-id", "bench-acl"),)
    cached: dict[str, tuple[tuple[str, str], ...]] = {}

    def headers() -> tuple[tuple[str, str], ...]:
        if keys is None:
            return base
        now = datetime.now(UTC)
        second = now.strftime(auth.DATE_TIME_FORMAT)
        if second not in cached:
            cached.clear()
            cached[second] = (*base, *auth.sign_metadata(*keys, now))
        return cached[second]

    return headers


def prepare(broker: BrokerProcess, users: int) -> None:
    with AdminClient(broker.admin_endpoint, timeout_s=30, **broker.admin_keys) as admin:
        admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
        for n in range(users):
            tenant = f"t{n}"
            admin.put_group(model.LiteGroup(f"{tenant}-group", PARENT))
            admin.put_user(tenant, f"{tenant}-secret-key")
            admin.put_acl(
                [
                    AclEntry(tenant, f"Lite:{PARENT}/{tenant}-*", ("Pub", "Sub")),
                    AclEntry(tenant, f"Group:{tenant}-group", ("Sub",)),
                    AclEntry(tenant, f"Lite:{PARENT}/{tenant}-private-*", ("Sub",), "Deny"),
                ]
            )


def message(n: int, lite: str) -> pb.Message:
    props = pb.SystemProperties(message_id=f"m{n}-{time.monotonic_ns()}", message_type=pb.LITE, lite_topic=lite)
    return pb.Message(topic=pb.Resource(name=PARENT), body=b"x" * 128, system_properties=props)


async def sends(stub: sg.MessagingServiceAsyncStub, headers: Headers, count: int, topics: int, in_flight: int) -> float:
    """Single-message sends per second, ``in_flight`` at once, over ``topics`` lite topics."""
    queue = iter(range(count))

    async def worker() -> None:
        for n in queue:
            request = spb.SendMessageRequest(messages=[message(n, f"{TENANT}-s{n % topics}")])
            reply = await stub.SendMessage(request, metadata=headers())
            assert reply.status.code == pb.OK, reply.status

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return count / (time.perf_counter() - started)


async def fill(stub: sg.MessagingServiceAsyncStub, headers: Headers, lite: str, count: int) -> None:
    for start in range(0, count, 500):
        batch = [message(n, lite) for n in range(start, min(count, start + 500))]
        reply = await stub.SendMessage(spb.SendMessageRequest(messages=batch), metadata=headers())
        assert reply.status.code == pb.OK, reply.status


async def drain(stub: sg.MessagingServiceAsyncStub, headers: Headers, lite: str, count: int) -> float:
    """Messages received and acked per second from one lite topic."""
    subscribe = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[lite]
    )
    assert (await stub.SyncLiteSubscription(subscribe, metadata=headers())).status.code == pb.OK
    receive = spb.ReceiveMessageRequest(
        group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=BATCH
    )
    receive.invisible_duration.seconds = 30
    receive.long_polling_timeout.seconds = 5

    async def ack(m: pb.Message) -> None:
        entry = spb.AckMessageEntry(
            message_id=m.system_properties.message_id, receipt_handle=m.system_properties.receipt_handle
        )
        request = spb.AckMessageRequest(group=pb.Resource(name=GROUP), topic=pb.Resource(name=PARENT), entries=[entry])
        reply = await stub.AckMessage(request, metadata=headers())
        assert reply.status.code == pb.OK, reply.status

    got = 0
    started = time.perf_counter()
    while got < count:
        frames = [f async for f in stub.ReceiveMessage(receive, metadata=headers())]
        for frame in frames:
            if frame.HasField("status") and frame.status.code not in (pb.OK, pb.MESSAGE_NOT_FOUND):
                raise RuntimeError(f"receive refused: {frame.status}")
        messages = [f.message for f in frames if f.HasField("message")]
        if not messages:
            raise RuntimeError(f"a receive came back empty after {got} of {count}")
        await asyncio.gather(*(ack(m) for m in messages))
        got += len(messages)
    return count / (time.perf_counter() - started)


def cpu_s(broker: BrokerProcess) -> float:
    """CPU seconds (user + system) the broker process has used so far."""
    fields = Path(f"/proc/{broker.process.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SIDES = ("off", "auth", "on")  # no auth; client auth (signed, no ACL); --acl


async def measure(
    args: argparse.Namespace, brokers: dict[str, BrokerProcess]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(messages per second, broker CPU µs per message), by "send off", "receive on" and so on."""
    rates: dict[str, list[float]] = {f"{kind} {side}": [] for kind in ("send", "receive") for side in SIDES}
    cpu: dict[str, list[float]] = {k: [] for k in rates}
    keys = {"off": None, "auth": CLIENT_KEYS, "on": (TENANT, f"{TENANT}-secret-key")}
    channels = {side: grpc.aio.insecure_channel(brokers[side].endpoint) for side in SIDES}
    try:
        sides = [(side, sg.MessagingServiceStub(channels[side]), signer(keys[side])) for side in SIDES]
        for _, stub, headers in sides:  # warm-up: connections, caches, first-write costs
            await sends(stub, headers, args.in_flight * 4, args.lite_topics, args.in_flight)
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]  # each side first in turn
            for name, stub, headers in order:
                before = cpu_s(brokers[name])
                rates[f"send {name}"].append(await sends(stub, headers, args.sends, args.lite_topics, args.in_flight))
                cpu[f"send {name}"].append((cpu_s(brokers[name]) - before) / args.sends * 1e6)
            for name, stub, headers in order:
                lite = f"{TENANT}-drain-{r}"
                await fill(stub, headers, lite, args.receives)
                before = cpu_s(brokers[name])
                rates[f"receive {name}"].append(await drain(stub, headers, lite, args.receives))
                cpu[f"receive {name}"].append((cpu_s(brokers[name]) - before) / args.receives * 1e6)
    finally:
        for channel in channels.values():
            await channel.close(None)
    return rates, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sends", type=int, default=4000, help="single-message sends per round")
    parser.add_argument("--receives", type=int, default=3200, help="messages drained per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds; each runs every broker once, in turn")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--lite-topics", type=int, default=500)
    parser.add_argument("--users", type=int, default=100, help="tenants in the policy table")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.sends, args.receives, args.rounds, args.users = 400, 320, 1, 5
    flags = ["--flush-mode", "async"]  # no fsync per call: the CPU cost of the checks is what shows
    extra = {"off": [], "auth": ["--access-key", CLIENT_KEYS[0], "--secret-key", CLIENT_KEYS[1]], "on": ["--acl"]}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        brokers = {
            side: stack.enter_context(start_broker(Path(tmp) / side, extra_args=[*flags, *extra[side]]))
            for side in SIDES
        }
        for broker in brokers.values():
            prepare(broker, args.users)  # the same topics and groups everywhere; users count only under --acl
        load_before = os.getloadavg()[0]
        rates, cpu = asyncio.run(measure(args, brokers))
        load_after = os.getloadavg()[0]
    median = {k: statistics.median(v) for k, v in rates.items()}
    cpu_median = {k: statistics.median(v) for k, v in cpu.items()}
    print(
        f"{args.rounds} rounds, the three brokers in turn; sends: {args.sends:,} single-message calls, "
        f"{args.in_flight} in flight, {args.lite_topics} lite topics; receives: {args.receives:,} messages, {BATCH} "
        f"per receive + {BATCH} acks; ACL: {args.users} users x 3 entries; host load average (1 min) "
        f"{load_before:.1f} before, {load_after:.1f} after"
    )
    for kind in ("send", "receive"):
        for side in SIDES:
            key = f"{kind} {side}"
            each = ", ".join(f"{x:,.0f}" for x in rates[key])
            print(f"  {key}: {median[key]:,.0f} msg/s (rounds {each}); broker CPU {cpu_median[key]:.0f} µs/msg")
    for kind in ("send", "receive"):
        ratio = median[f"{kind} on"] / median[f"{kind} off"]
        print(f"FIGURE {kind} throughput ACL on ÷ off: {ratio:.3f} (goal >= 0.95)", flush=True)
    for kind in ("send", "receive"):
        ratio = median[f"{kind} on"] / median[f"{kind} auth"]
        cpu_ratio = cpu_median[f"{kind} on"] / cpu_median[f"{kind} off"]
        print(f"  {kind}: ACL on ÷ client auth {ratio:.3f}; broker CPU per message ACL on ÷ off {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
