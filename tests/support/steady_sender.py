"""A client process that keeps sending LITE messages, one at a time, and writes down every answer: for tests that
run it somewhere the test itself is not (inside a network namespace: ``ip netns exec ns python steady_sender.py``).

    python steady_sender.py --out sends.jsonl --lite t3 --prefix ns 127.0.0.1:8081 [more endpoints ...]

Message ids are ``<prefix>-<n>`` (a new one each attempt); attempt n goes to the n-th endpoint, round the list.
One JSON line per attempt, flushed: ``{"id", "start", "end", "ok", "why"}`` with ``start``/``end`` on
``time.monotonic()`` (one clock for every process of the host), ``ok`` true only for a send answered OK. Runs
until SIGTERM or SIGINT; ``read(path)`` parses the lines; a test starts one with ``Sender``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PARENT: Final = "AGENT_TASK_NS"  # the bootstrap parent (LITE)
HEADERS: Final = (("x-mq-client-id", "steady-sender"), ("x-mq-language", "PYTHON"), ("x-mq-client-version", "5.1.2"))
PAUSE_S: Final = 0.02  # after a failed attempt: a client's retry backoff, so a fast refusal does not spin


@dataclass(frozen=True)
class Attempt:
    id: str
    start: float
    end: float
    ok: bool
    why: str  # the status or error of a failed attempt


def read(path: Path) -> list[Attempt]:
    """The attempts written so far (a last line being written is left out)."""
    if not path.exists():
        return []
    out: list[Attempt] = []
    for line in path.read_text().splitlines():
        try:
            out.append(Attempt(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


class Sender:
    """This program run by a test (inside a network namespace with ``wrapper``), stopped by ``stop``. A short
    ``timeout_s`` keeps a call forwarded to an unreachable owner from blurring a failover time much; a long one
    lets a send wait for a follower that rejoins on a loaded host."""

    def __init__(
        self,
        out: Path,
        lite: str,
        prefix: str,
        endpoints: list[str],
        *,
        wrapper: tuple[str, ...] = (),
        timeout_s: float = 3.0,
    ) -> None:
        from lmq_broker import testing  # noqa: PLC0415 (the program itself runs without it)

        self.out = out
        paths = [str(Path(testing.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        command = [*wrapper, sys.executable, __file__, "--out", str(out), "--lite", lite, "--prefix", prefix]
        command += ["--timeout-s", str(timeout_s), *endpoints]
        self._errors = out.with_suffix(".err").open("w")
        self.process = subprocess.Popen(command, env=env, stderr=self._errors)

    def attempts(self) -> list[Attempt]:
        if self.process.poll() is not None:
            raise AssertionError(f"the sender exited: {self.out.with_suffix('.err').read_text()[-2000:]}")
        return read(self.out)

    def acked(self) -> list[Attempt]:
        return [a for a in self.attempts() if a.ok]

    def stop(self) -> list[Attempt]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(10)
        self._errors.close()
        return read(self.out)


def ids(attempts: list[Attempt]) -> list[str]:
    """The ids of the attempts answered OK, in order."""
    return [a.id for a in attempts if a.ok]


def _attempts(endpoints: list[str], lite: str, prefix: str, timeout_s: float) -> Iterator[Attempt]:
    import grpc  # noqa: PLC0415 (imported where it runs: ``read`` is used by tests without the stubs' cost)

    from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb  # noqa: PLC0415
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb  # noqa: PLC0415
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc  # noqa: PLC0415

    options = [("grpc.enable_http_proxy", 0)]
    stubs = [service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(e, options=options)) for e in endpoints]
    n = 0
    while True:
        message_id = f"{prefix}-{n}"
        props = pb.SystemProperties(message_id=message_id, message_type=pb.LITE, lite_topic=lite)
        msg = pb.Message(topic=pb.Resource(name=PARENT), body=str(n).encode(), system_properties=props)
        start = time.monotonic()
        try:
            reply = stubs[n % len(stubs)].SendMessage(
                spb.SendMessageRequest(messages=[msg]), metadata=HEADERS, timeout=timeout_s
            )
            ok, why = reply.status.code == pb.OK, f"{pb.Code.Name(reply.status.code)}: {reply.status.message}"
        except grpc.RpcError as exc:
            ok, why = False, str(exc)[:300]
        yield Attempt(message_id, start, time.monotonic(), ok, "" if ok else why)
        n += 1
        if not ok:
            time.sleep(PAUSE_S)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("endpoints", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lite", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    with args.out.open("a") as out:
        for attempt in _attempts(args.endpoints, args.lite, args.prefix, args.timeout_s):
            out.write(json.dumps(dataclasses.asdict(attempt)) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
