"""Send and receive throughput with access control on (``--acl``) ÷ off, in the same run (issue 29: goal >= 0.95).

Three broker processes run side by side: one plain (no auth, no ACL), one with client auth only (every call
signed, no ACL: what authentication alone costs) and one with ``--acl`` and a realistic policy table
(``--users`` tenants, each with Pub/Sub on its own ``Lite:<parent>/<tenant>-*`` prefix and Sub on its group,
plus a deny entry). The load, from one raw-stub client per broker, is interleaved between them in small turns so
that all see the same machine: a turn is 128 sends or one receive with its acks (~50-100 ms), each turn the
brokers in another of their orders, and each broker's rate is its messages over the time of its own turns. The
goal's pair (off, on) is interleaved on its own, and then the client-auth broker with the plain one: when all
three shared the turns, the slower client-auth broker's trailing work fell into the others' turns on the 2
shared cores (the same hour, quiet host: ACL on ÷ off 0.930-0.952 three-way; 0.961-1.001 with the client-auth
broker left out or replaced by a plain one taking the same signed calls). A busy host's load changes over
seconds: when each broker ran its whole round (~5 s) in turn (``--blocks``, the first scheme), single rounds of
one broker varied by 2x and the ratios by ±0.15 from run to run. Sends are single-message SendMessage calls,
``--in-flight`` at once, over ``--lite-topics`` lite topics (one check each, a decision-cache entry each);
receives drain one lite topic as a LiteSimpleConsumer does (ReceiveMessage of 32, then 32 concurrent AckMessage,
each checked). Under ACL every call is signed (``MQv2-HMAC-SHA1``) as the official clients sign; the client
signs once per second (the signature covers only the date-time, to the second), so the client's own HMAC does
not weigh on the figure and what is measured is the broker's cost: the signature check, the user lookup and the
checks. Beside the throughput ratios, the brokers' own CPU time per message (from /proc) and this client's are
printed: on a busy host they move less than throughput does, and they tell the broker's cost from the signing
client's.

    python bench/bench_acl.py           # ~3 min
    python bench/bench_acl.py --blocks  # the first scheme, each broker's round at once
    python bench/bench_acl.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
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
    """The call's headers; signed (once per second, the signature's resolution) when ``keys`` are given. The
    second is told by ``time.time()``: formatting the date-time at every call (``strftime``, ~5-30 µs on this
    host) would put a client's cost on the signed side, which this benchmark does not mean to measure."""
    base = (("x-mq-client-id", "bench-acl"),)
    cached: list[tuple[int, tuple[tuple[str, str], ...]]] = [(-1, base)]

    def headers() -> tuple[tuple[str, str], ...]:
        if keys is None:
            return base
        second = int(time.time())
        if cached[0][0] != second:
            cached[0] = (second, (*base, *auth.sign_metadata(*keys, datetime.fromtimestamp(second, UTC))))
        return cached[0][1]

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


async def sends(
    stub: sg.MessagingServiceAsyncStub, headers: Headers, count: int, topics: int, in_flight: int
) -> AsyncIterator[int]:
    """Single-message sends, ``in_flight`` at once, over ``topics`` lite topics; yields after each ``STEP_SENDS``."""

    async def worker(queue: Iterator[int]) -> None:
        for n in queue:
            request = spb.SendMessageRequest(messages=[message(n, f"{TENANT}-s{n % topics}")])
            reply = await stub.SendMessage(request, metadata=headers())
            assert reply.status.code == pb.OK, reply.status

    for first in range(0, count, STEP_SENDS):
        queue = iter(range(first, min(count, first + STEP_SENDS)))
        await asyncio.gather(*(worker(queue) for _ in range(in_flight)))
        yield min(count, first + STEP_SENDS) - first


async def fill(stub: sg.MessagingServiceAsyncStub, headers: Headers, lite: str, count: int) -> None:
    for start in range(0, count, 500):
        batch = [message(n, lite) for n in range(start, min(count, start + 500))]
        reply = await stub.SendMessage(spb.SendMessageRequest(messages=batch), metadata=headers())
        assert reply.status.code == pb.OK, reply.status


async def drain(stub: sg.MessagingServiceAsyncStub, headers: Headers, lite: str, count: int) -> AsyncIterator[int]:
    """Receives and acks ``count`` messages of one lite topic; yields after each receive and its acks."""
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
        yield len(messages)


def cpu_s(broker: BrokerProcess) -> float:
    """CPU seconds (user + system) the broker process has used so far."""
    fields = Path(f"/proc/{broker.process.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SIDES = ("off", "auth", "on")  # no auth; client auth (signed, no ACL); --acl
GOAL_SIDES, AUTH_SIDES = ("off", "on"), ("off", "auth")  # the goal's pair, then what client auth alone costs
STEP_SENDS = 128  # sends per turn of a side when interleaved (a receive's turn: one receive and its acks)


Measured = dict[str, tuple[float, float, list[float], float]]


async def turns(steps: dict[str, AsyncIterator[int]], brokers: dict[str, BrokerProcess], *, blocks: bool) -> Measured:
    """Runs every side's steps, interleaved (each turn one step of each side, in each of the sides' orders in
    turn) or, with ``blocks``, each side's all at once; (messages per second, broker CPU µs per message, the rate
    of each step, this client's CPU µs per message) of each side, over the time spent in its own steps only."""
    steps_rates: dict[str, list[float]] = {name: [] for name in steps}
    spent = dict.fromkeys(steps, 0.0)
    cpu = dict.fromkeys(steps, 0.0)
    client = dict.fromkeys(steps, 0.0)
    done = dict.fromkeys(steps, 0)
    active = list(steps)
    turn = 0
    while active:
        orders = list(itertools.permutations(active))
        for name in [active[0]] if blocks else orders[turn % len(orders)]:
            cpu_before, client_before, started = cpu_s(brokers[name]), time.process_time(), time.perf_counter()
            try:
                count = await anext(steps[name])
            except StopAsyncIteration:
                active.remove(name)
                continue
            took = time.perf_counter() - started
            spent[name] += took
            steps_rates[name].append(count / took)
            client[name] += time.process_time() - client_before
            cpu[name] += cpu_s(brokers[name]) - cpu_before
            done[name] += count
        turn += 1
    return {
        name: (
            done[name] / spent[name],
            cpu[name] / done[name] * 1e6,
            steps_rates[name],
            client[name] / done[name] * 1e6,
        )
        for name in steps
    }


Results = tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]


async def measure(
    args: argparse.Namespace, brokers: dict[str, BrokerProcess], sides: tuple[str, ...], rounds: int
) -> Results:
    """(messages per second of each round, broker CPU µs per message of each round, the rate of every step, this
    client's CPU µs per message of each round), by "send off", "receive on" and so on, for ``sides``' brokers."""
    rates: dict[str, list[float]] = {f"{kind} {side}": [] for kind in ("send", "receive") for side in sides}
    cpu: dict[str, list[float]] = {k: [] for k in rates}
    step_rates: dict[str, list[float]] = {k: [] for k in rates}
    client_cpu: dict[str, list[float]] = {k: [] for k in rates}
    keys = {"off": None, "auth": CLIENT_KEYS, "on": (TENANT, f"{TENANT}-secret-key")}
    channels = {side: grpc.aio.insecure_channel(brokers[side].endpoint) for side in sides}
    stubs = {side: sg.MessagingServiceStub(channels[side]) for side in sides}
    headers = {side: signer(keys[side]) for side in sides}

    def record(kind: str, measured: Measured) -> None:
        for side, (rate, cpu_us, each, client_us) in measured.items():
            client_cpu[f"{kind} {side}"].append(client_us)
            rates[f"{kind} {side}"].append(rate)
            cpu[f"{kind} {side}"].append(cpu_us)
            step_rates[f"{kind} {side}"].extend(each)

    try:
        warm = {s: sends(stubs[s], headers[s], args.in_flight * 4, args.lite_topics, args.in_flight) for s in sides}
        await turns(warm, brokers, blocks=True)  # connections, caches, first-write costs
        for r in range(rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]  # with --blocks: each side first in turn
            sending = {s: sends(stubs[s], headers[s], args.sends, args.lite_topics, args.in_flight) for s in order}
            record("send", await turns(sending, brokers, blocks=args.blocks))
            lite = f"{TENANT}-drain-{r}"
            for side in order:
                await fill(stubs[side], headers[side], lite, args.receives)
            draining = {s: drain(stubs[s], headers[s], lite, args.receives) for s in order}
            record("receive", await turns(draining, brokers, blocks=args.blocks))
    finally:
        for channel in channels.values():
            await channel.close(None)
    return rates, cpu, step_rates, client_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sends", type=int, default=4000, help="single-message sends per round")
    parser.add_argument("--receives", type=int, default=3200, help="messages drained per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds; each runs every broker once, in turn")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--lite-topics", type=int, default=500)
    parser.add_argument("--users", type=int, default=100, help="tenants in the policy table")
    parser.add_argument(
        "--blocks", action="store_true", help="each broker's round all at once (the first scheme), not interleaved"
    )
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
        goal = asyncio.run(measure(args, brokers, GOAL_SIDES, args.rounds))
        load_mid = os.getloadavg()[0]
        alone = asyncio.run(measure(args, brokers, AUTH_SIDES, max(1, args.rounds // 2)))
        load_after = os.getloadavg()[0]
    scheme = "in turn, each its whole round" if args.blocks else "interleaved (turns of 128 sends or 1 receive + acks)"
    print(
        f"{args.rounds} rounds of ACL off and on, then {max(1, args.rounds // 2)} of off and client auth, the two "
        f"brokers of each {scheme}; sends: {args.sends:,} single-message calls, "
        f"{args.in_flight} in flight, {args.lite_topics} lite topics; receives: {args.receives:,} messages, {BATCH} "
        f"per receive + {BATCH} acks; ACL: {args.users} users x 3 entries; host load average (1 min) "
        f"{load_before:.1f} before, {load_mid:.1f} between, {load_after:.1f} after"
    )
    median, cpu_median = report(goal, GOAL_SIDES, "")
    median_alone, cpu_alone = report(alone, AUTH_SIDES, " (second phase)")
    for kind in ("send", "receive"):
        ratio = median[f"{kind} on"] / median[f"{kind} off"]
        print(f"FIGURE {kind} throughput ACL on ÷ off: {ratio:.3f} (goal >= 0.95)", flush=True)
    for kind in ("send", "receive"):
        cpu_ratio = cpu_median[f"{kind} on"] / cpu_median[f"{kind} off"]
        typical = statistics.median(goal[2][f"{kind} on"]) / statistics.median(goal[2][f"{kind} off"])
        auth = median_alone[f"{kind} auth"] / median_alone[f"{kind} off"]
        auth_cpu = cpu_alone[f"{kind} auth"] / cpu_alone[f"{kind} off"]
        print(
            f"  {kind}: broker CPU per message ACL on ÷ off {cpu_ratio:.3f}; median turn's rate ACL on ÷ off "
            f"{typical:.3f} (a host's stalls left out); client auth alone ÷ off {auth:.3f}, "
            f"its broker CPU {auth_cpu:.3f}"
        )


def report(results: Results, sides: tuple[str, ...], phase: str) -> tuple[dict[str, float], dict[str, float]]:
    """Prints each side's rate and CPU; (median rate, median broker CPU µs per message) by "send off" and so on."""
    rates, cpu, _, client_cpu = results
    median = {k: statistics.median(v) for k, v in rates.items()}
    cpu_median = {k: statistics.median(v) for k, v in cpu.items()}
    for kind in ("send", "receive"):
        for side in sides:
            key = f"{kind} {side}"
            each = ", ".join(f"{x:,.0f}" for x in rates[key])
            mine = statistics.median(client_cpu[key])
            print(
                f"  {key}{phase}: {median[key]:,.0f} msg/s (rounds {each}); broker CPU {cpu_median[key]:.0f} µs/msg, "
                f"client CPU {mine:.0f} µs/msg"
            )
    return median, cpu_median


if __name__ == "__main__":
    main()
