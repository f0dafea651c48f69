"""Official Java, Go and Node clients against two brokers with ``--peers`` (docs/scale-out.md), all dialling the
second: Go sends SyncLiteSubscription to every route endpoint itself (each copy is applied where it lands),
Java 5.2.0 and Node 1.0.8 to their configured endpoint only (split there by owner, patterns to every broker).
Either way every broker takes its own matching lite topics once. The Python client: tests/e2e/test_scale_out.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from testing_clients import Driver, DriverMissing, b64, driver_argv, start_driver
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.supervisor import free_ports
from lmq_broker.testing import SHARED_ADMIN_ENV, SHARED_ADMIN_KEYS, BrokerProcess, start_broker

POINTERS = Path(__file__).resolve().parents[2] / "build" / "clients"
TOPIC, GROUP = "ACROSS_NS", "across-group"
WAIT_S = 90.0


@pytest.fixture(scope="module")
def brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[BrokerProcess]]:
    ports = free_ports("127.0.0.1", 2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    root = tmp_path_factory.mktemp("across")
    started: list[BrokerProcess] = []
    try:
        for i, port in enumerate(ports):
            args = ["--peers", peers, "--ordinal", str(i), "--no-bootstrap", "--long-polling-timeout-ms", "5000"]
            started.append(start_broker(root / f"b{i}", port=port, extra_args=args, env=SHARED_ADMIN_ENV))
        yield started
    finally:
        for broker in started:
            broker.stop()


def admin_of(broker: BrokerProcess) -> AdminClient:
    return AdminClient(broker.endpoint, timeout_s=10, **SHARED_ADMIN_KEYS)


def subscriptions(broker: BrokerProcess, group: str) -> int:
    with admin_of(broker) as admin:
        return sum(c.subscription_count for c in admin.list_clients(group))


def counted(brokers: list[BrokerProcess], group: str, patterns: int, named: int) -> bool:
    """Every broker counts each pattern, and the named topics it owns: ``named`` of them in all."""
    counts = [subscriptions(b, group) for b in brokers]
    return min(counts) >= patterns and sum(counts) == patterns * len(brokers) + named


def held(broker: BrokerProcess) -> set[str]:
    """The lite topics of TOPIC this broker's store holds (a few: one page)."""
    with admin_of(broker) as admin:
        return {info.meta.lite for info in admin.list_lite_topics(TOPIC, limit=1000).topics}


@pytest.mark.parametrize("lang", ["java", "go", "node"])
def test_patterns_take_each_brokers_topics_once(lang: str, brokers: list[BrokerProcess], tmp_path: Path) -> None:
    group = f"{GROUP}-{lang}"
    for broker in brokers:
        with admin_of(broker) as admin:
            admin.put_parent_topic(model.ParentTopic(TOPIC, model.MessageType.LITE))
            admin.put_group(model.LiteGroup(group, TOPIC))
    try:
        argv = driver_argv(POINTERS, lang)
    except DriverMissing as missing:
        pytest.fail(str(missing))
    client: Driver = start_driver(argv, lang, brokers[1].endpoint, tmp_path)
    try:
        client.call("lite_push", name="c", group=group, topic=TOPIC)
        named = [f"{lang}-named-{i}" for i in range(6)]  # each on its owner only
        for name in (f"{lang}-job-*", f"{lang}/+/cmd", *named):
            client.call("subscribe_lite", consumer="c", lite_topic=name)
        eventually(lambda: counted(brokers, group, 2, len(named)), "the subscriptions on both brokers", WAIT_S, 0.1)
        client.call("producer", name="p", topics=[TOPIC])

        def send(lite: str, n: int) -> str:
            body = b64(f"{lite}/{n}".encode())
            message_id: str = client.call("send", producer="p", topic=TOPIC, lite_topic=lite, body=body)["message_id"]
            return message_id

        jobs, devs = [f"{lang}-job-{i}" for i in range(8)], [f"{lang}_{i}_cmd" for i in range(4)]
        unwanted = {send(lite, 0) for lite in (f"{lang}-jo", f"{lang}_1_cmd_x", "other")}
        sent = {send(lite, n) for n in (0, 1) for lite in jobs + devs + named}

        def received() -> set[str]:
            return {m["message_id"] for m in client.messages("c")}

        client.wait_events(lambda _: sent <= received(), WAIT_S, "every message on a matching lite topic")
        # Barrier: one more on every lite topic; a duplicate or an unwanted message would come before them.
        sent |= {send(lite, 9) for lite in jobs + devs + named}
        client.wait_events(lambda _: sent <= received(), WAIT_S, "the barrier on every lite topic")
        assert Counter(m["message_id"] for m in client.messages("c")) == Counter(sent)  # once each, nothing else
        assert not unwanted & received()
        for lite in jobs + devs + named:  # in order per lite topic
            assert [m["body"] for m in client.messages("c") if m["lite_topic"] == lite] == [
                b64(f"{lite}/{n}".encode()) for n in (0, 1, 9)
            ]
        first, second = held(brokers[0]), held(brokers[1])
        assert not first & second and first & set(named) and second & set(named)  # on both brokers (no copy)
        assert first & set(jobs + devs) and second & set(jobs + devs)
        client.call("unsubscribe_lite", consumer="c", lite_topic=f"{lang}-job-*")
        eventually(lambda: counted(brokers, group, 1, len(named)), "the pattern gone from both", WAIT_S, 0.1)
        dropped = {send(lite, 2) for lite in jobs}
        last = {send(lite, 2) for lite in devs + named}  # the barrier: named topics live on both brokers
        client.wait_events(lambda _: last <= received(), WAIT_S, "the messages after the unsubscribe")
        assert not dropped & received()
    finally:
        assert client.close() == 0
