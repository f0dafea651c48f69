"""What each step of a signed send costs the broker under ``--acl``, in-process (issue 29's send ratio).

A grpc aio server on a loopback port answers signed single-message SendMessage calls (the bench_acl client's
headers: client id, date-time, authorization); inside each call the handler times each step ``--repeat`` times
on that call's own context and request, and the medians over ``--calls`` calls are printed in µs per step:

* ``invocation_metadata()``: grpc's headers built anew (what a second read of them costs; grpc built them once
  already to find the handler, ``HandlerCallDetails``), and ``peer()``;
* ``auth.Verifier`` on the headers (a remembered signature: the date-time window, the user into ``auth.USER``);
* ``Gate.send`` (a remembered admission by user, topic and lite topic) and ``Gate.send_plain`` (its plain twin:
  the target built and decided by ``AccessControl``'s own cache, the peer read);
* the handler finders: grpc's ``method_handlers_generic_handler`` and ``guard.Messaging`` without and with a
  Verifier (what the off and the ACL broker run per call to find the handler).

    python bench/bench_acl_steps.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import grpc

from lmq_broker.access import control, document
from lmq_broker.access.policy import Action, Entry, User
from lmq_broker.protocol import auth, authorizing, guard
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

METHOD = "/apache.rocketmq.v2.MessagingService/SendMessage"


def access_control(users: int) -> control.AccessControl:
    access = control.AccessControl(True)
    people = tuple(User(f"t{n}", f"t{n}-secret-key") for n in range(users))
    entries = [Entry(f"t{n}", f"Lite:shared/t{n}-*", (Action.PUB, Action.SUB)) for n in range(users)]
    access.load(document.Document(people, tuple(entries)))
    return access


class _Details:
    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = METHOD
        self.invocation_metadata = metadata


def timed(step: Callable[[], object], repeat: int) -> float:
    """µs per call of ``step``, over ``repeat`` calls."""
    started = time.perf_counter_ns()
    for _ in range(repeat):
        step()
    return (time.perf_counter_ns() - started) / repeat / 1000


def steps(
    request: spb.SendMessageRequest, context: Any, access: control.AccessControl
) -> dict[str, Callable[[], object]]:
    verifier = auth.Verifier(access.secret_of)
    metadata = context.invocation_metadata()
    gate = authorizing.Gate(access)
    details = _Details(metadata)
    plain_finder = grpc.method_handlers_generic_handler(
        guard.SERVICE, {"SendMessage": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}
    )
    handlers = {METHOD: grpc.unary_unary_rpc_method_handler(lambda r, c: r)}
    finder, checking = guard.Messaging(handlers), guard.Messaging(handlers, verifier)
    verifier(metadata)  # the user into auth.USER, the signature remembered
    return {
        "invocation_metadata()": context.invocation_metadata,
        "peer()": context.peer,
        "Verifier (remembered)": lambda: verifier(metadata),
        "Gate.send (remembered)": lambda: gate.send(context.peer, request),
        "Gate.send_plain": lambda: gate.send_plain(context.peer, request),
        "finder: grpc's generic handler": lambda: plain_finder.service(details),  # type: ignore[arg-type]
        "finder: guard.Messaging": lambda: finder.service(details),  # type: ignore[arg-type]
        "finder: guard.Messaging + Verifier": lambda: checking.service(details),  # type: ignore[arg-type]
    }


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    access = access_control(args.users)
    results: dict[str, list[float]] = {}

    async def send(request: spb.SendMessageRequest, context: Any) -> spb.SendMessageResponse:
        for name, step in steps(request, context, access).items():
            results.setdefault(name, []).append(timed(step, args.repeat))
        return spb.SendMessageResponse(status=pb.Status(code=pb.OK))

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        send,
        request_deserializer=spb.SendMessageRequest.FromString,
        response_serializer=spb.SendMessageResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(guard.SERVICE, {"SendMessage": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    headers = (("x-mq-client-id", "bench-acl"), *auth.sign_metadata("t0", "t0-secret-key", datetime.now(UTC)))
    props = pb.SystemProperties(message_id="m", message_type=pb.LITE, lite_topic="t0-s1")
    message = pb.Message(topic=pb.Resource(name="shared"), body=b"x" * 128, system_properties=props)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                METHOD,
                request_serializer=spb.SendMessageRequest.SerializeToString,
                response_deserializer=spb.SendMessageResponse.FromString,
            )
            for _ in range(args.calls):
                await call(spb.SendMessageRequest(messages=[message]), metadata=headers)
    finally:
        await server.stop(None)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=200, help="times each step is timed within a call")
    parser.add_argument("--users", type=int, default=100)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print(f"{args.calls} signed SendMessage calls, each step timed {args.repeat} times per call; median µs per step")
    for name, each in results.items():
        print(f"  {name}: {statistics.median(each):.2f} µs")


if __name__ == "__main__":
    main()
