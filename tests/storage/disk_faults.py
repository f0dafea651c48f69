"""A broker process with part of its data dir on a small filesystem that fills up while it takes sends, for
test_full_disk.py (run as a script inside a private mount namespace, never collected). Prints one JSON object
of what it saw. ``disk_faults.py DATA_DIR FAULT [broker flags]``, FAULT one of:

- ``index``: ``index/`` is a tmpfs; it fills, so RocksDB's writes fail (ENOSPC), then refuses all writes.
- ``fsync``: ``commitlog/`` is ext4 on a loop device whose backing file lives on a tmpfs; the tmpfs fills, so
  writes still land in the page cache but their writeback fails: fsync fails (a real I/O fault, nothing
  simulated). The loop device is detached at the end, whatever happens.

Raw v2 calls over gRPC (our own stubs): sends one at a time, each with its own message id; the disk fills;
sends fail (and go on failing while the healer's retries fail); space returns; the time to the first good
send is measured. Half of the sends answered with an error are sent again (a client's retry), the rest never;
after a SIGKILL and a restart on the same data dir everything is received, acked and counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Final, NamedTuple

import grpc

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2_grpc as sg
from lmq_broker.testing import BrokerProcess, start_broker

FS_BYTES: Final = 16 * 1024 * 1024
IMAGE_BYTES: Final = 256 * 1024 * 1024  # the ext4 of the fsync fault (its backing file: on FS_BYTES)
PARENT, GROUP, LITE = "FULL", "full-group", "job"
HEADERS = (("x-mq-client-id", "full-disk"), ("x-mq-language", "JAVA"), ("x-mq-client-version", "5.0.8"))
MAX_SENDS_TO_FAIL = 5000
# Each send needs a new file system block: one that landed in a block already written back could be made
# durable even with the backing tmpfs full (a real thin-provisioned disk behaves alike).
BODY_BYTES = 8192
RESUME_DEADLINE_S = 30.0
RECEIVE_DEADLINE_S = 60.0


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(broker: BrokerProcess, name: str) -> float:
    for line in http(broker.metrics_url + "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def send(stub: sg.MessagingServiceAsyncStub, i: int) -> bool:
    props = pb.SystemProperties(message_id=f"m-{i:06d}", message_type=pb.LITE, lite_topic=LITE)
    body = str(i).encode().ljust(BODY_BYTES, b".")
    message = pb.Message(topic=pb.Resource(name=PARENT), body=body, system_properties=props)
    reply = await stub.SendMessage(spb.SendMessageRequest(messages=[message]), metadata=HEADERS, timeout=10)
    return bool(reply.status.code == pb.OK)


async def receive_all(stub: sg.MessagingServiceAsyncStub, expected: int) -> list[str]:
    """Message ids received until ``expected`` came (or a deadline), then two more polls for any extra."""
    sync = spb.SyncLiteSubscriptionRequest(
        action=pb.PARTIAL_ADD, topic=pb.Resource(name=PARENT), group=pb.Resource(name=GROUP), lite_topic_set=[LITE]
    )
    assert (await stub.SyncLiteSubscription(sync, metadata=HEADERS)).status.code == pb.OK
    got: list[str] = []
    deadline = time.monotonic() + RECEIVE_DEADLINE_S
    extra_polls = 2
    while extra_polls > 0 and time.monotonic() < deadline:
        request = spb.ReceiveMessageRequest(
            group=pb.Resource(name=GROUP), message_queue=pb.MessageQueue(topic=pb.Resource(name=PARENT)), batch_size=32
        )
        request.invisible_duration.seconds = 600  # nothing comes back by lease expiry meanwhile (acked at once)
        request.long_polling_timeout.FromMilliseconds(1000)
        frames = [f async for f in stub.ReceiveMessage(request, metadata=HEADERS, timeout=15)]
        props = [f.message.system_properties for f in frames if f.HasField("message")]
        got.extend(sp.message_id for sp in props)
        if props:  # a lite topic hands out its next messages once these are acked
            entries = [
                spb.AckMessageEntry(message_id=sp.message_id, receipt_handle=sp.receipt_handle, lite_topic=LITE)
                for sp in props
            ]
            ack = spb.AckMessageRequest(group=pb.Resource(name=GROUP), topic=pb.Resource(name=PARENT), entries=entries)
            assert (await stub.AckMessage(ack, metadata=HEADERS)).status.code == pb.OK
        if len(set(got)) >= expected:
            extra_polls -= 1
    return got


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == 28, e
    finally:
        os.close(fd)
    return filler


class Fault(NamedTuple):
    directory: str  # under the data dir, on the small filesystem
    loop_device: bool  # ext4 on a loop device backed by the tmpfs (else the tmpfs itself)
    retries_metric: str | None  # counts the healer's tries (None: nothing to heal)
    ready_text: str | None  # what /readyz says meanwhile (None: it stays ready)
    gauge: str  # 0 while the fault stands


FAULTS: Final = {
    "index": Fault("index", False, "lmq_store_index_reopens_total", "index cannot write", "lmq_store_index_writable"),
    "fsync": Fault("commitlog", True, "lmq_store_fsync_failures_total", "cannot be made durable", "lmq_store_durable"),
    # only the log's writes fail (ENOSPC, cut off at once): nothing to heal, each send finds out for itself
    "log": Fault("commitlog", False, None, None, "lmq_store_durable"),
    # the whole data dir on one full disk: log, index and meta meet it in whatever order
    "all": Fault(".", False, None, None, "lmq_store_healthy"),
}


async def sends_while_full(broker: BrokerProcess, space: Path, fault: Fault, out: dict[str, object]) -> dict[int, bool]:
    outcome: dict[int, bool] = {}
    async with grpc.aio.insecure_channel(broker.endpoint) as channel:
        stub = sg.MessagingServiceStub(channel)
        for i in range(20):
            outcome[i] = await send(stub, i)
        filler = fill(space)
        i = 20
        while all(outcome.values()) and i < MAX_SENDS_TO_FAIL:
            outcome[i] = await send(stub, i)
            i += 1
        out["sends_until_failure"] = i - 20
        out["ready_while_full"] = http(broker.metrics_url + "/readyz")
        out["healthz_while_full"] = http(broker.metrics_url + "/healthz")[0]
        out["gauge_while_full"] = metric(broker, fault.gauge)
        # Sends go on failing while the disk stays full and the healer tries (and fails) twice more (in sync
        # mode a send's own fsync may be the one that fails: the healer's succeeds once nothing is unsynced).
        name = fault.retries_metric
        tries, first, deadline = metric(broker, name) if name else 0, i, time.monotonic() + 20
        while (i - first < 10 if name is None else metric(broker, name) < tries + 2) and time.monotonic() < deadline:
            outcome[i] = await send(stub, i)
            i += 1
            await asyncio.sleep(0.05)
        out["retries_while_full"] = metric(broker, name) - tries if name else 0
        out["ok_while_full_after_retries"] = sum(outcome[j] for j in range(first, i))
        out["ready_still_full"] = http(broker.metrics_url + "/readyz")[0]
        filler.unlink()
        freed = time.monotonic()
        while time.monotonic() - freed < RESUME_DEADLINE_S:
            outcome[i] = await send(stub, i)
            i += 1
            if outcome[i - 1]:
                break
            await asyncio.sleep(0.01)
        out["resume_s"] = time.monotonic() - freed
        out["ready_after"] = http(broker.metrics_url + "/readyz")
        out["healthz_after"] = http(broker.metrics_url + "/healthz")[0]
        out["gauge_after"] = metric(broker, fault.gauge)
        for _ in range(20):
            outcome[i] = await send(stub, i)
            i += 1
        failed = sorted(j for j, ok in outcome.items() if not ok)
        retried = failed[::2]  # a client's retry: same id, same body
        for j in retried:
            outcome[j] = await send(stub, j)
        out["retries_ok"] = sum(outcome[j] for j in retried)
        out["errors_never_retried"] = len(failed) - len(retried)
    return outcome


async def received(broker: BrokerProcess, expected: int) -> list[str]:
    async with grpc.aio.insecure_channel(broker.endpoint) as channel:
        return await receive_all(sg.MessagingServiceStub(channel), expected)


@contextlib.contextmanager
def small_filesystem(fault: Fault, data_dir: Path) -> Iterator[Path]:
    """Mount the fault's directory on a small filesystem; yield the directory whose filling makes it fail."""
    target = data_dir / fault.directory
    target.mkdir(parents=True)
    if not fault.loop_device:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(target)], check=True)
        yield target
        return
    backing = data_dir.parent / "backing"
    backing.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(backing)], check=True)
    image = backing / "ext4.img"
    image.touch()
    os.truncate(image, IMAGE_BYTES)  # sparse: blocks take tmpfs space only once written back
    loop = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True)
    device = loop.stdout.strip()
    try:
        subprocess.run(["mkfs.ext4", "-q", "-O", "^has_journal", "-E", "nodiscard", device], check=True)
        subprocess.run(["mount", "-o", "noinit_itable,errors=continue", device, str(target)], check=True)
        try:
            yield backing
        finally:
            subprocess.run(["umount", str(target)], check=False)
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


def main(data_dir: Path, fault: Fault, flags: list[str]) -> dict[str, object]:
    with small_filesystem(fault, data_dir) as space:
        broker = start_broker(data_dir, extra_args=["--no-bootstrap", *flags])
        try:
            with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as admin:
                admin.put_parent_topic(model.ParentTopic(PARENT, model.MessageType.LITE))
                admin.put_group(model.LiteGroup(GROUP, PARENT))
            out: dict[str, object] = {}
            outcome = asyncio.run(sends_while_full(broker, space, fault, out))
            broker.kill()  # recovery replays what the log holds beyond the index: nothing answered "error" is there
            # on a port of its own again: its old one may be taken meanwhile (another test's, under xdist)
            broker = start_broker(data_dir, extra_args=["--no-bootstrap", *flags])
            acked = {f"m-{i:06d}" for i, ok in outcome.items() if ok}
            refused = {f"m-{i:06d}" for i, ok in outcome.items() if not ok}
            delivered = Counter(asyncio.run(received(broker, len(acked))))
            out["acked"] = len(acked)
            out["refused"] = len(refused)
            out["acked_lost"] = sorted(acked - set(delivered))
            out["delivered_twice"] = sorted(m for m, n in delivered.items() if n > 1)
            out["refused_delivered"] = sorted(refused & set(delivered))
            out["unknown_delivered"] = sorted(set(delivered) - acked - refused)
            return out
        finally:
            broker.stop()


if __name__ == "__main__":
    result = main(Path(sys.argv[1]), FAULTS[sys.argv[2]], sys.argv[3:])
    print(json.dumps(result), flush=True)
    os._exit(0)
