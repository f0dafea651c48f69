"""Every official client, unchanged, against a real broker: the same scenarios for Python, Java, Go and Node.

Each scenario steers the client through its driver (``tests/clients/<lang>``, contract in README.md) and
checks the broker's side through the admin service. "Lost" means an acknowledged send that no consumer
received; "dead-lettered" means a copy in ``%DLQ%<group>``, read back with the Python client.
"""

from __future__ import annotations

import hashlib
import random
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import pytest
from raw_v2 import metric
from testing_clients import LANGS, Driver, DriverError, b64, unb64
from waiting import eventually

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.protocol import convert
from lmq_broker.testing import BrokerProcess

LITE_MESSAGES: Final = 240
WAIT_S: Final = 90.0
# Where a client has no such call, the driver answers "unsupported": the scenario asserts that the
# client is one we know lacks it, so a client gaining (or losing) it shows up here.
WITHOUT_LITE_SIMPLE: Final[frozenset[str]] = frozenset({"java", "go", "node"})  # java 5.2.0, node 1.0.8
# Clients without a public subscribe-all call still register with a wildcard group: their periodic
# COMPLETE_ADD (Java and Go at start, then every 30 s; Node every 30 s) is what the call sends.
WITHOUT_SUBSCRIBE_ALL: Final = frozenset({"java", "go", "node"})  # 5.2.0, v5.1.4, 1.0.8
# Python 5.1.2 drops NotifyUnsubscribeLiteCommand; Node 1.0.8's telemetry session has no case for it (its
# consumer's handler is never called).
IGNORES_NOTIFY_UNSUBSCRIBE: Final = frozenset({"python", "node"})


# --- bodies ----------------------------------------------------------------------------------------------
SHAPES: Final[dict[str, Callable[[bytes], bool]]] = {
    "md5 hex with a leading zero": lambda b: hashlib.md5(b).hexdigest().startswith("0"),
    "md5 hex with two leading zeros": lambda b: hashlib.md5(b).hexdigest().startswith("00"),
    "crc32 below 2^28 (padded hex)": lambda b: zlib.crc32(b) < 1 << 28,
    "crc32 at or above 2^31 (negative as int32)": lambda b: zlib.crc32(b) >= 1 << 31,
}


def shaped(prefix: bytes, shape: Callable[[bytes], bool]) -> bytes:
    salt = 0
    while not shape(body := prefix + b"#" + str(salt).encode()):
        salt += 1
    return body


def lite_bodies(lites: list[str], count: int) -> list[tuple[str, int, bytes]]:
    """``count`` messages spread over ``lites``: (lite topic, sequence in that topic, body). Bodies start
    with their topic and sequence and cover every digest shape, binary and UTF-8 bytes and a 256 KiB body."""
    out = []
    extras = [b"\x00\xff\x80binary\x00", "übung-量子-🚀".encode(), b"x" * (256 * 1024)]
    shapes = list(SHAPES.values())
    for i in range(count):
        lite = lites[i % len(lites)]
        seq = i // len(lites)
        prefix = f"{lite}|{seq:05d}|".encode()
        if i < len(shapes) * 4:
            body = shaped(prefix, shapes[i % len(shapes)])
        elif i - len(shapes) * 4 < len(extras):
            body = prefix + extras[i - len(shapes) * 4]
        else:
            body = prefix + b"payload-%d" % i
        out.append((lite, seq, body))
    for name, shape in SHAPES.items():
        assert any(shape(b) for _, _, b in out), f"no body of shape {name}"
    return out


# --- helpers ---------------------------------------------------------------------------------------------


def subscriptions_of(admin: AdminClient, group: str) -> int:
    return sum(c.subscription_count for c in admin.list_clients(group))


def committed(admin: AdminClient, topic: str, lite: str, group: str) -> int:
    return admin.describe_lite_topic(topic, lite).group_offsets.get(group, -1)


def dead_letters(python: Driver, group: str) -> list[dict[str, Any]]:
    """What ``%DLQ%<group>`` holds, read with the official Python client."""
    name = f"dlq-{group}-{time.monotonic_ns()}"
    python.call("simple", name=name, group=f"dlq-reader-{group}", topic=f"%DLQ%{group}", await_s=1)
    try:
        return list(python.call("receive", consumer=name, max=32, invisible_s=30)["messages"])
    finally:
        python.call("shutdown", name=name)


def delivered(driver: Driver, consumer: str) -> list[dict[str, Any]]:
    return driver.messages(consumer)


def ids_received(driver: Driver, consumer: str) -> set[str]:
    return {m["message_id"] for m in driver.messages(consumer)}


def send_lite(driver: Driver, producer: str, topic: str, lite: str, body: bytes) -> str:
    message_id: str = driver.call("send", producer=producer, topic=topic, lite_topic=lite, body=b64(body))["message_id"]
    return message_id


def start_lite_consumer(
    driver: Driver, admin: AdminClient, name: str, topic: str, group: str, *, lites: list[str], **options: Any
) -> None:
    """A LitePushConsumer subscribed to ``lites``, once the broker holds every subscription."""
    before = subscriptions_of(admin, group)
    driver.call("lite_push", name=name, group=group, topic=topic, **options)
    for lite in lites:
        driver.call("subscribe_lite", consumer=name, lite_topic=lite)
    eventually(
        lambda: subscriptions_of(admin, group) >= before + len(lites), f"{len(lites)} subscriptions", timeout_s=45
    )


# --- scenarios -------------------------------------------------------------------------------------------
def test_lite_send_to_lite_push_consumer_loses_nothing(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    """≥ 200 lite messages over 4 lite topics, every digest shape: each received once, in order per lite
    topic, byte for byte; nothing dead-lettered."""
    topic, group = lite_group()
    client = drivers(lang)
    lites = [f"session-{i}" for i in range(4)]
    start_lite_consumer(client, admin, "c", topic, group, lites=lites)
    client.call("producer", name="p", topics=[topic])
    sent = {}
    for lite, seq, body in lite_bodies(lites, LITE_MESSAGES):
        sent[send_lite(client, "p", topic, lite, body)] = (lite, seq, body)

    client.wait_events(lambda _: set(sent) <= ids_received(client, "c"), WAIT_S, f"{len(sent)} messages")
    got = delivered(client, "c")
    assert Counter(m["message_id"] for m in got) == Counter(list(sent)), "duplicates or strangers"
    for m in got:
        lite, _, body = sent[m["message_id"]]
        assert (m["topic"], m["lite_topic"], unb64(m["body"]), m["attempt"]) == (topic, lite, body, 1)
    for lite in lites:
        seqs = [sent[m["message_id"]][1] for m in got if m["lite_topic"] == lite]
        assert seqs == sorted(seqs), f"{lite} out of order"
    eventually(
        lambda: all(committed(admin, topic, lite, group) == LITE_MESSAGES // len(lites) for lite in lites),
        "every ack committed",
        timeout_s=30,
        interval_s=0.1,
    )
    assert dead_letters(drivers("python") if lang != "python" else client, group) == []


def test_subscribe_unsubscribe_and_resubscribe_keeps_offsets(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    client = drivers(lang)
    start_lite_consumer(client, admin, "c", topic, group, lites=["a", "b"])
    client.call("producer", name="p", topics=[topic])
    first = {send_lite(client, "p", topic, lite, f"{lite}-{i}".encode()) for lite in "ab" for i in range(5)}
    client.wait_events(lambda _: first <= ids_received(client, "c"), WAIT_S, "the first 10")

    client.call("unsubscribe_lite", consumer="c", lite_topic="a")
    assert client.call("lite_topics", consumer="c")["lite_topics"] == ["b"]
    eventually(
        lambda: subscriptions_of(admin, group) == 1,
        "the broker dropping the subscription to a",
        timeout_s=30,
        interval_s=0.1,
    )
    eventually(lambda: committed(admin, topic, "a", group) == 5, "a's first five acks committed", interval_s=0.1)
    while_away = {send_lite(client, "p", topic, "a", f"a-late-{i}".encode()) for i in range(5)}
    still = {send_lite(client, "p", topic, "b", f"b-late-{i}".encode()) for i in range(5)}
    client.wait_events(lambda _: still <= ids_received(client, "c"), WAIT_S, "b's later messages")
    # b's later messages are the barrier: sent after a's, to the same client and receive loop, so a's would have
    # come with them; nothing of a's was acked either (its committed offset stays after the first five)
    assert not while_away & ids_received(client, "c"), "delivered after unsubscribe"
    assert committed(admin, topic, "a", group) == 5

    client.call("subscribe_lite", consumer="c", lite_topic="a")
    client.wait_events(lambda _: while_away <= ids_received(client, "c"), WAIT_S, "a's messages on resubscribe")
    assert Counter(m["message_id"] for m in delivered(client, "c")) == Counter(first | while_away | still)


def test_consumer_restart_resumes_where_it_stopped(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    """An agent process stops after its acks were committed; a new process of the same group gets the
    rest and nothing it had acknowledged."""
    topic, group = lite_group()
    first_process = drivers(lang)
    start_lite_consumer(first_process, admin, "c", topic, group, lites=["agent"])
    first_process.call("producer", name="p", topics=[topic])
    before = {send_lite(first_process, "p", topic, "agent", f"before-{i}".encode()) for i in range(30)}
    first_process.wait_events(lambda _: before <= ids_received(first_process, "c"), WAIT_S, "30 messages")
    eventually(lambda: committed(admin, topic, "agent", group) == 30, "30 acks committed", timeout_s=30, interval_s=0.1)
    assert first_process.close() == 0

    sender = drivers("python")
    sender.call("producer", name="p", topics=[topic])
    after = {send_lite(sender, "p", topic, "agent", f"after-{i}".encode()) for i in range(30)}
    second_process = drivers(lang)
    start_lite_consumer(second_process, admin, "c", topic, group, lites=["agent"])
    second_process.wait_events(lambda _: after <= ids_received(second_process, "c"), WAIT_S, "the 30 later ones")
    assert not before & ids_received(second_process, "c"), "acknowledged messages delivered again"
    assert Counter(m["message_id"] for m in delivered(second_process, "c")) == Counter(after)


def test_failed_consumption_is_redelivered_not_dead_lettered(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    client = drivers(lang)
    start_lite_consumer(client, admin, "c", topic, group, lites=["retry"], fail_times=1)
    client.call("producer", name="p", topics=[topic])
    sent = {send_lite(client, "p", topic, "retry", f"r-{i}".encode()) for i in range(5)}
    client.wait_events(
        lambda _: (
            all(n >= 2 for n in Counter(m["message_id"] for m in delivered(client, "c")).values())
            and sent <= ids_received(client, "c")
        ),
        WAIT_S,
        "every message consumed a second time",
    )
    eventually(lambda: committed(admin, topic, "retry", group) == 5, "5 acks committed", timeout_s=30, interval_s=0.1)
    assert dead_letters(drivers("python") if lang != "python" else client, group) == []


def test_normal_topic_push_and_simple_consumers(
    lang: str,
    drivers: Callable[[str], Driver],
    normal_topic: Callable[[], str],
    unique: Callable[[str], str],
) -> None:
    """Producer → PushConsumer and → SimpleConsumer (two groups) on a 4-queue NORMAL topic."""
    topic = normal_topic()
    client = drivers(lang)
    push_group, simple_group = unique("push"), unique("simple")
    client.call("push", name="push", group=push_group, topic=topic)
    client.call("simple", name="simple", group=simple_group, topic=topic, await_s=2)
    client.call("producer", name="p", topics=[topic])
    sent = {}
    for i in range(40):
        body = f"normal-{i}".encode()
        reply = client.call(
            "send", producer="p", topic=topic, body=b64(body), tag=f"tag{i % 2}", keys=[f"k{i}"],
            properties={"n": str(i)},
        )  # fmt: skip
        sent[reply["message_id"]] = (body, f"tag{i % 2}", f"k{i}", str(i))

    client.wait_events(lambda _: set(sent) <= ids_received(client, "push"), WAIT_S, "40 pushed messages")
    pushed = delivered(client, "push")
    assert Counter(m["message_id"] for m in pushed) == Counter(list(sent))
    for m in pushed:
        assert (unb64(m["body"]), m["tag"], m["keys"], m["properties"].get("n")) == (
            sent[m["message_id"]][0], sent[m["message_id"]][1], [sent[m["message_id"]][2]], sent[m["message_id"]][3]
        )  # fmt: skip
        assert m["lite_topic"] is None

    received: Counter[str] = Counter()
    deadline = time.monotonic() + WAIT_S
    while set(received) < set(sent) and time.monotonic() < deadline:
        for m in client.call("receive", consumer="simple", max=16, invisible_s=30)["messages"]:
            received[m["message_id"]] += 1
            client.call("ack", consumer="simple", handle=m["handle"])
    assert received == Counter(list(sent))
    assert client.call("receive", consumer="simple", max=16, invisible_s=30)["messages"] == []


def test_lite_simple_consumer(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    topic, group = lite_group()
    client = drivers(lang)
    started = client.call("lite_simple", name="ls", group=group, topic=topic, await_s=2)
    if started.get("unsupported"):
        assert lang in WITHOUT_LITE_SIMPLE, f"{lang} driver says it has no LiteSimpleConsumer"
        return
    assert lang not in WITHOUT_LITE_SIMPLE, f"{lang} has a LiteSimpleConsumer now: update WITHOUT_LITE_SIMPLE"
    client.call("lite_simple_subscribe", consumer="ls", lite_topic="simple-lite")
    eventually(
        lambda: subscriptions_of(admin, group) == 1, "the lite simple subscription", timeout_s=45, interval_s=0.1
    )
    client.call("producer", name="p", topics=[topic])
    sent = {send_lite(client, "p", topic, "simple-lite", f"s-{i}".encode()) for i in range(10)}
    received: Counter[str] = Counter()
    deadline = time.monotonic() + WAIT_S
    while set(received) < sent and time.monotonic() < deadline:
        for m in client.call("receive", consumer="ls", max=4, invisible_s=30)["messages"]:
            assert m["lite_topic"] == "simple-lite"
            received[m["message_id"]] += 1
            client.call("ack", consumer="ls", handle=m["handle"])
    assert received == Counter(sent)
    eventually(
        lambda: committed(admin, topic, "simple-lite", group) == 10, "10 acks committed", timeout_s=30, interval_s=0.1
    )


def test_exclusive_group_notifies_the_evicted_client(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    """In an Exclusive group the newest subscriber takes the lite topic; the broker tells the previous
    one (NotifyUnsubscribeLiteCommand), which drops it from its local set where the client handles it."""
    topic, group = lite_group(model=model.SubscriptionModel.EXCLUSIVE)
    first, second = drivers(lang), drivers(lang)
    start_lite_consumer(first, admin, "c", topic, group, lites=["owned"])
    second.call("lite_push", name="c", group=group, topic=topic)
    second.call("subscribe_lite", consumer="c", lite_topic="owned")
    eventually(
        lambda: sorted(c.subscription_count for c in admin.list_clients(group)) == [0, 1],
        "the first client evicted",
        timeout_s=45,
        interval_s=0.1,
    )
    if lang in IGNORES_NOTIFY_UNSUBSCRIBE:
        assert first.call("lite_topics", consumer="c")["lite_topics"] == ["owned"]
        # It keeps the topic in its set, so its next COMPLETE_ADD (every 30 s) would take it back (the hand-back
        # docs/protocol.md describes for such clients): it stops here, having received nothing of the topic.
        first.call("shutdown", name="c")
    else:
        eventually(
            lambda: first.call("lite_topics", consumer="c")["lite_topics"] == [], "the notice applied", timeout_s=30
        )
    second.call("producer", name="p", topics=[topic])
    sent = {send_lite(second, "p", topic, "owned", f"x-{i}".encode()) for i in range(5)}
    second.wait_events(lambda _: sent <= ids_received(second, "c"), WAIT_S, "the new owner's messages")
    assert not ids_received(first, "c")


def test_unknown_lite_group_is_reported(
    lang: str, drivers: Callable[[str], Driver], lite_group: Callable[..., tuple[str, str]]
) -> None:
    """A LitePushConsumer of a group the broker does not know is told so with the broker's reason
    (CONSUMER_GROUP_NOT_FOUND): at startup where the client can report a failed start, else at its first
    subscription (docs/clients.md) — never a hang or an unrelated error."""
    topic, _ = lite_group()
    client = drivers(lang)
    started = time.monotonic()
    with pytest.raises(DriverError) as failure:
        client.call("lite_push", name="c", group="no-such-group", topic=topic, timeout=40)
        client.call("subscribe_lite", consumer="c", lite_topic="x", timeout=40)
    assert time.monotonic() - started < 30
    text = str(failure.value)
    print(f"{lang} reports: {text}")
    assert "40403" in text or "CONSUMER_GROUP_NOT_FOUND" in text, text


def test_normal_push_consumer_gets_what_was_sent_before_it_started(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, unique: Callable[[str], str]
) -> None:
    """A one-queue NORMAL topic, five sends, then a new PushConsumer group: all five arrive. Issue 13 saw
    Go receive 1 of 5: with the CRC32 digest the broker used to send, Go discards ("Message is corrupted for
    standard consumption") every body whose CRC32 hex has a leading zero. Four of these five do."""
    topic = unique("N1")
    admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.NORMAL))
    client = drivers(lang)
    client.call("producer", name="p", topics=[topic])
    bodies = [shaped(b"m-%d" % i, SHAPES["crc32 below 2^28 (padded hex)"]) for i in range(4)] + [b"plain"]
    sent = {client.call("send", producer="p", topic=topic, body=b64(body))["message_id"] for body in bodies}
    client.call("push", name="c", group=unique("late"), topic=topic)
    client.wait_events(lambda _: sent <= ids_received(client, "c"), WAIT_S, "the five earlier messages")
    assert Counter(m["message_id"] for m in delivered(client, "c")) == Counter(sent)


def test_patterns_take_the_matching_lite_topics(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    """``subscribeLite("job-*")``, ``("dev/+/cmd")``, ``("all/#")``: every client checks only blankness and
    length, so the pattern reaches the broker as written; it takes matching new lite topics and no others,
    and unsubscribing it stops them."""
    topic, group = lite_group()
    client = drivers(lang)
    start_lite_consumer(client, admin, "c", topic, group, lites=["job-*", "dev/+/cmd", "all/#"])
    client.call("producer", name="p", topics=[topic])
    unwanted = {send_lite(client, "p", topic, lite, b"no") for lite in ("jo", "dev_2_cmd_x", "alls", "other")}
    sent = {send_lite(client, "p", topic, lite, lite.encode()) for lite in ("job-1", "dev_2_cmd", "all", "all_x")}
    client.wait_events(lambda _: sent <= ids_received(client, "c"), WAIT_S, "4 messages on 4 matching lite topics")
    client.call("unsubscribe_lite", consumer="c", lite_topic="job-*")
    dropped = send_lite(client, "p", topic, "job-2", b"unsubscribed")
    last = send_lite(client, "p", topic, "all_y", b"still subscribed")
    # The barrier: a stray delivery of job-2, sent before all_y, would have come with it or before it.
    client.wait_events(lambda _: last in ids_received(client, "c"), WAIT_S, "a message after the unsubscribe")
    assert Counter(m["message_id"] for m in delivered(client, "c")) == Counter(sent | {last})
    assert dropped not in ids_received(client, "c") and not unwanted & ids_received(client, "c")


def test_subscribe_lite_all_receives_every_lite_topic_of_a_wildcard_group(
    lang: str, drivers: Callable[[str], Driver], admin: AdminClient, lite_group: Callable[..., tuple[str, str]]
) -> None:
    """A wildcard lite group (RocketMQ lite.sub.wildcard) gets every lite topic of its parent once the client
    registers (``subscribe_lite_all`` or the client's own periodic full sync); a per-topic subscription to
    it is refused with ILLEGAL_CONSUMER_GROUP."""
    topic, group = lite_group(wildcard=True)
    client = drivers(lang)
    client.call("lite_push", name="c", group=group, topic=topic)
    answer = client.call("subscribe_lite_all", consumer="c")
    assert bool(answer.get("unsupported")) == (lang in WITHOUT_SUBSCRIBE_ALL), answer
    eventually(
        lambda: any(c.group == group for c in admin.list_clients(group)),
        "the client registered",
        timeout_s=45,
        interval_s=0.1,
    )
    client.call("producer", name="p", topics=[topic])
    sent = {send_lite(client, "p", topic, f"any-{i % 3}", f"w-{i}".encode()) for i in range(15)}
    client.wait_events(lambda _: sent <= ids_received(client, "c"), WAIT_S, "15 messages on 3 new lite topics")
    assert Counter(m["message_id"] for m in delivered(client, "c")) == Counter(sent)
    with pytest.raises(DriverError) as refused:
        client.call("subscribe_lite", consumer="c", lite_topic="one")
    assert "40003" in str(refused.value) or "ILLEGAL_CONSUMER_GROUP" in str(refused.value), refused.value


@pytest.mark.parametrize("fifo", [True, False], ids=["fifo", "concurrent"])
def test_a_message_that_always_fails_is_dead_lettered_after_max_attempts(
    lang: str,
    fifo: bool,
    drivers: Callable[[str], Driver],
    admin: AdminClient,
    lite_group: Callable[..., tuple[str, str]],
) -> None:
    """A listener that always returns FAILURE: the message is consumed ``max_attempts`` times, then its copy is
    in ``%DLQ%<group>`` (same id and body, its origin in properties) and the lite topic's offset moves past it.
    A fifo group's client retries locally, then calls ForwardMessageToDeadLetterQueue; a concurrent group's
    client nacks (ChangeInvisibleDuration by its backoff) and the broker counts the attempts and dead-letters it.
    """
    attempts = 3
    topic, group = lite_group(fifo=fifo, retry=model.RetryPolicy(max_attempts=attempts, backoff_ms=(200, 200)))
    client = drivers(lang)
    start_lite_consumer(client, admin, "c", topic, group, lites=["poison"], fail_times=1000)
    client.call("producer", name="p", topics=[topic])
    body = "poison-ü-🚀".encode() * 3
    sent = send_lite(client, "p", topic, "poison", body)
    eventually(lambda: committed(admin, topic, "poison", group) == 1, "the dead letter settled", timeout_s=WAIT_S)
    got = delivered(client, "c")
    assert [m["message_id"] for m in got] == [sent] * attempts
    if not fifo:  # the broker's own count, one per hand-out (a fifo client counts its local retries itself)
        assert [m["attempt"] for m in got] == list(range(1, attempts + 1))
    (dead,) = dead_letters(drivers("python") if lang != "python" else client, group)
    assert (dead["topic"], dead["message_id"], unb64(dead["body"])) == (f"%DLQ%{group}", sent, body)
    assert (dead["properties"]["__ORIGIN_TOPIC"], dead["properties"]["__ORIGIN_LITE_TOPIC"]) == (topic, "poison")


def test_every_client_reads_what_every_client_sent(
    drivers: Callable[[str], Driver], normal_topic: Callable[[], str], unique: Callable[[str], str]
) -> None:
    """Each client sends to one NORMAL topic and each reads it all (a SimpleConsumer per client, own group):
    tag, several keys (Go's driver used to send only the last: ``SetKeys`` replaces), unicode property values
    (the clients refuse blank ones) and bodies the Java client gzips (above 4 KiB) arrive as sent, whichever
    client sent them."""
    topic = normal_topic()
    clients = {lang: drivers(lang) for lang in LANGS}
    sent: dict[str, tuple[str, bytes, list[str], dict[str, str]]] = {}
    for lang, client in clients.items():
        client.call("producer", name="p", topics=[topic])
        client.call("simple", name="s", group=unique(f"all-{lang}"), topic=topic, await_s=1)
        bodies = [
            f"small from {lang} ü".encode(),
            b"compressible " * 5000,  # 65 KB: gzipped by the Java client
            hashlib.sha512(lang.encode()).digest() * 80,  # 5 KiB, above Java's 4 KiB threshold, hardly compressible
        ]
        for i, body in enumerate(bodies):
            keys = [f"{lang}-k{i}", "shared key", "ключ"]
            properties = {"sender": lang, "unicode": "übung-量子-🚀", "spaced": " a b ", "n": str(i)}
            reply = client.call(
                "send", producer="p", topic=topic, body=b64(body), tag=f"t-{lang}", keys=keys, properties=properties
            )
            sent[reply["message_id"]] = (f"t-{lang}", body, sorted(keys), properties)
    assert len(sent) == 3 * len(LANGS), "message ids not unique"

    for lang, client in clients.items():
        received: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + WAIT_S
        while set(received) < set(sent) and time.monotonic() < deadline:
            for m in client.call("receive", consumer="s", max=16, invisible_s=30)["messages"]:
                assert m["message_id"] not in received, f"{lang} got {m['message_id']} twice"
                received[m["message_id"]] = m
                client.call("ack", consumer="s", handle=m["handle"])
        assert set(received) == set(sent), f"{lang} missed {set(sent) - set(received)}"
        for message_id, m in received.items():
            tag, body, keys, properties = sent[message_id]
            assert (m["topic"], m["tag"], sorted(m["keys"]), unb64(m["body"])) == (topic, tag, keys, body), lang
            assert {k: m["properties"].get(k) for k in properties} == properties, (lang, m["properties"])
            assert m["attempt"] == 1


def test_simple_consumer_gets_an_unacknowledged_message_again_with_the_next_attempt(
    lang: str, drivers: Callable[[str], Driver], normal_topic: Callable[[], str], unique: Callable[[str], str]
) -> None:
    """A SimpleConsumer lets the invisible time of two of three messages pass: those two come again, same id
    and body, ``delivery_attempt`` 2; the acknowledged one does not. An ack with the superseded receipt handle
    of the first delivery is refused with INVALID_RECEIPT_HANDLE and settles nothing, as RocketMQ's proxy
    answers an expired handle (docs/protocol.md, *Receipt handles*): that message comes a third time."""
    topic = normal_topic()
    client = drivers(lang)
    client.call("producer", name="p", topics=[topic])
    client.call("simple", name="s", group=unique("redeliver"), topic=topic, await_s=1)
    bodies = {
        client.call("send", producer="p", topic=topic, body=b64(b"m%d" % i))["message_id"]: b"m%d" % i for i in range(3)
    }

    def receive_all(ids: set[str], invisible_s: int) -> dict[str, dict[str, Any]]:
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + WAIT_S
        while set(got) < ids and time.monotonic() < deadline:
            for m in client.call("receive", consumer="s", max=16, invisible_s=invisible_s)["messages"]:
                assert m["message_id"] not in got, f"{m['message_id']} twice in one visibility window"
                got[m["message_id"]] = m
        assert set(got) == ids
        return got

    invisible_s = 4  # each ack below comes well within it, on a loaded host too (an expired handle is refused)
    first = receive_all(set(bodies), invisible_s=invisible_s)
    assert {i: m["attempt"] for i, m in first.items()} == dict.fromkeys(bodies, 1)
    acked, *pending = sorted(bodies)
    client.call("ack", consumer="s", handle=first[acked]["handle"])
    again = receive_all(set(pending), invisible_s=invisible_s)
    assert {i: (m["attempt"], unb64(m["body"])) for i, m in again.items()} == {i: (2, bodies[i]) for i in pending}
    client.call("ack", consumer="s", handle=again[pending[0]]["handle"])
    try:
        client.call("ack", consumer="s", handle=first[pending[1]]["handle"])  # the superseded handle
        text = "no error"
    except DriverError as refused:
        text = f"{refused} {refused.code}"
    # Go's SimpleConsumer.Ack (v5.1.4) returns nil whatever the status; the third delivery shows the refusal
    assert lang == "go" or "40013" in text or "INVALID_RECEIPT_HANDLE" in text, text
    third = receive_all({pending[1]}, invisible_s=30)  # not settled: once its second invisible time ran out
    assert third[pending[1]]["attempt"] == 3
    client.call("ack", consumer="s", handle=third[pending[1]]["handle"])
    assert client.call("receive", consumer="s", max=16, invisible_s=30)["messages"] == []  # past every 4 s one


def test_bodies_up_to_the_size_limit_reach_every_client(
    lang: str, drivers: Callable[[str], Driver], normal_topic: Callable[[], str], unique: Callable[[str], str]
) -> None:
    """A body of ``--max-body-bytes`` (4 MiB, what every client lets a producer send) and one that does not
    compress, just under the size the broker gzips above: each arrives byte for byte. Node's client takes frames
    of at most 4 MiB (grpc-js's default); the broker sends the first gzipped, where it used to fail every
    receive of the queue's consumer with RESOURCE_EXHAUSTED."""
    topic = normal_topic()
    client = sender = drivers(lang)
    sender.call("producer", name="big", topics=[topic])
    limit = 4 * 1024 * 1024
    bodies = [
        (b"0123456789abcdef" * (limit // 16))[:limit],
        random.Random(7).randbytes(convert.WIRE_GZIP_ABOVE_BYTES),
    ]
    sent = {sender.call("send", producer="big", topic=topic, body=b64(body))["message_id"]: body for body in bodies}
    client.call("simple", name="s", group=unique("big"), topic=topic, await_s=1)
    received: dict[str, bytes] = {}
    deadline = time.monotonic() + WAIT_S
    while set(received) < set(sent) and time.monotonic() < deadline:
        for m in client.call("receive", consumer="s", max=2, invisible_s=30)["messages"]:
            received[m["message_id"]] = unb64(m["body"])
            client.call("ack", consumer="s", handle=m["handle"])
    assert received == sent


def test_normal_push_consumer_restart_resumes_where_its_group_stopped(
    lang: str,
    broker: BrokerProcess,
    drivers: Callable[[str], Driver],
    normal_topic: Callable[[], str],
    unique: Callable[[str], str],
) -> None:
    """A PushConsumer of a 4-queue NORMAL topic consumes, its process stops once its acks are in; a new process
    of the same group gets what was sent meanwhile and nothing acknowledged before."""
    topic, group = normal_topic(), unique("resume")
    first_process = drivers(lang)
    acks = metric(broker, "lmq_acks_total")  # the module's tests run one at a time: these are this test's
    first_process.call("push", name="c", group=group, topic=topic)
    first_process.call("producer", name="p", topics=[topic])
    before = {
        first_process.call("send", producer="p", topic=topic, body=b64(b"b%d" % i))["message_id"] for i in range(20)
    }
    first_process.wait_events(lambda _: before <= ids_received(first_process, "c"), WAIT_S, "20 messages")
    eventually(lambda: metric(broker, "lmq_acks_total") >= acks + 20, "20 acks", timeout_s=30, interval_s=0.1)
    assert first_process.close() == 0
    sender = drivers("python")
    sender.call("producer", name="p", topics=[topic])
    after = {sender.call("send", producer="p", topic=topic, body=b64(b"a%d" % i))["message_id"] for i in range(20)}
    second_process = drivers(lang)
    second_process.call("push", name="c", group=group, topic=topic)
    second_process.wait_events(lambda _: after <= ids_received(second_process, "c"), WAIT_S, "the 20 later ones")
    assert not before & ids_received(second_process, "c"), "acknowledged messages delivered again"
    assert Counter(m["message_id"] for m in delivered(second_process, "c")) == Counter(after)


def test_tag_expressions_select_what_push_and_simple_consumers_get(
    lang: str, drivers: Callable[[str], Driver], normal_topic: Callable[[], str], unique: Callable[[str], str]
) -> None:
    """A PushConsumer subscribed with ``a || c`` and a SimpleConsumer with ``b`` (own groups) on one NORMAL topic:
    each gets the messages of its tags and none of the others (untagged ones included)."""
    topic = normal_topic()
    client = drivers(lang)
    client.call("push", name="push", group=unique("tags-push"), topic=topic, expression="a || c")
    client.call("simple", name="simple", group=unique("tags-simple"), topic=topic, expression="b", await_s=1)
    client.call("producer", name="p", topics=[topic])
    by_tag: dict[str | None, set[str]] = {}
    for i in range(24):
        tag = ("a", "b", "c", None)[i % 4]
        args: dict[str, Any] = {"tag": tag} if tag else {}
        message_id = client.call("send", producer="p", topic=topic, body=b64(b"t%d" % i), **args)["message_id"]
        by_tag.setdefault(tag, set()).add(message_id)
    client.wait_events(lambda _: by_tag["a"] | by_tag["c"] <= ids_received(client, "push"), WAIT_S, "a and c")
    simple: Counter[str] = Counter()
    deadline = time.monotonic() + WAIT_S
    while set(simple) < by_tag["b"] and time.monotonic() < deadline:
        for m in client.call("receive", consumer="simple", max=16, invisible_s=30)["messages"]:
            assert m["tag"] == "b", m
            simple[m["message_id"]] += 1
            client.call("ack", consumer="simple", handle=m["handle"])
    assert simple == Counter(by_tag["b"])
    # The barrier: b and untagged messages were sent between the a and c ones, which all came: a stray would too.
    assert Counter(m["message_id"] for m in delivered(client, "push")) == Counter(by_tag["a"] | by_tag["c"])
