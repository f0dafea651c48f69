"""``lmq-admin lite ...`` (a client's lite set, group lag with latency and top K, offset resets, dispatch)
against the admin service on a real port over a real RocksDB store; the live view is the in-memory twin here,
the real dispatcher in test_with_broker.py."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest

from lmq_broker import model
from lmq_broker.admin import cli
from lmq_broker.admin.testing import Broker
from lmq_broker.storage.memory import ManualClock


def run(broker: Broker, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["--endpoint", broker.endpoint, *args], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def run_json(broker: Broker, *args: str) -> Any:
    code, out, err = run(broker, *args, "-o", "json")  # -o at the end: accepted in any position
    assert (code, err) == (0, "")
    return json.loads(out)


def _setup(broker: Broker) -> None:
    admin = broker.client()
    admin.put_parent_topic(model.ParentTopic("orders"))
    admin.put_group(model.LiteGroup("g", bind_topic="orders"))


def test_lite_client_shows_a_clients_lite_topic_set(broker: Broker) -> None:
    broker.connect("c1", "g", "orders", subscriptions=2)
    broker.live.lite_sets["c1"] = ["s2", "s1"]

    got = run_json(broker, "lite", "client", "c1")
    assert got["lite_topics"] == ["s1", "s2"]
    assert (got["client"]["client_id"], got["client"]["group"], got["client"]["subscription_count"]) == ("c1", "g", 2)

    code, out, _ = run(broker, "lite", "client", "c1")
    header, row = out.splitlines()
    table = dict(zip(header.split(), row.split(), strict=True))
    assert (code, table["CLIENT_ID"], table["LITE_TOPICS"]) == (0, "c1", "s1,s2")

    code, _, err = run(broker, "lite", "client", "nobody")
    assert code == cli.EXIT_FAILED
    assert err.startswith("error: NotFound: client 'nobody' is not connected")


def test_lite_lag_gives_total_latency_and_the_top_lagging_topics(clocked_broker: Broker, clock: ManualClock) -> None:
    broker = clocked_broker
    _setup(broker)
    clock.now_ms = int(time.time() * 1000) - 60_000
    broker.send("orders", "s2", count=5)  # stored a minute ago: nothing consumed, a subscriber of g
    clock.advance(10_000)
    broker.send("orders", "s1", count=3)  # offset 0 consumed: the oldest unconsumed is offset 1
    broker.send("orders", "s3", count=4)  # neither consumed nor subscribed by g: not g's topic
    broker.send("orders", "s4", count=2)
    broker.consume("orders", "s1", "g", 1)
    broker.consume("orders", "s4", "g", 2)  # all consumed: no lag, not listed
    broker.connect("c1", "g", "orders")
    broker.subscribe("orders", "s2", "c1")

    lag = run_json(broker, "lite", "lag", "g")
    assert (lag["group"], lag["bind_topic"], lag["lag"], lag["lagging_topics"]) == ("g", "orders", 7, 2)
    assert (lag["unclaimed_messages"], lag["unclaimed_topics"]) == (4, 1)  # s3: waiting, but no member wants it
    top = lag["top"]
    assert [(t["lite"], t["lag"], t["committed_offset"], t["max_offset"]) for t in top] == [
        ("s2", 5, -1, 5),
        ("s1", 2, 1, 3),
    ]
    assert top[0]["latency_ms"] - top[1]["latency_ms"] == 10_000  # both from one "now"
    assert 60_000 <= top[0]["latency_ms"] < 120_000
    assert lag["latency_ms"] == top[0]["latency_ms"]
    assert broker.client().get_group("g").lag == lag["lag"]  # the same walk as group get

    assert [t["lite"] for t in run_json(broker, "lite", "lag", "g", "--top", "1")["top"]] == ["s2"]

    code, out, _ = run(broker, "lite", "lag", "g")
    summary, totals, blank, header, *rows = out.splitlines()
    assert code == 0
    assert summary.split() == [
        "GROUP",
        "BIND_TOPIC",
        "LAG",
        "LATENCY_MS",
        "LAGGING_TOPICS",
        "UNCLAIMED_MESSAGES",
        "UNCLAIMED_TOPICS",
    ]
    assert totals.split()[:3] == ["g", "orders", "7"]
    assert (blank, header.split()[:2]) == ("", ["LITE", "LAG"])
    assert [r.split()[0] for r in rows] == ["s2", "s1"]

    code, _, err = run(broker, "lite", "lag", "g", "--top", "1001")
    assert (code, err.split(":")[1].strip()) == (cli.EXIT_FAILED, "InvalidArgument")


def test_lite_lag_top_k_breaks_ties_by_name(broker: Broker) -> None:
    _setup(broker)
    for lite in ("d", "b", "a", "c"):
        broker.send("orders", lite, count=2)
        broker.consume("orders", lite, "g", 0)
    broker.send("orders", "e", count=3)
    broker.consume("orders", "e", "g", 0)
    lag = run_json(broker, "lite", "lag", "g", "--top", "3")
    assert [(t["lite"], t["lag"]) for t in lag["top"]] == [("e", 3), ("a", 2), ("b", 2)]
    assert (lag["lag"], lag["lagging_topics"]) == (11, 5)


def test_lite_reset_offset_per_group_and_lite_topic(broker: Broker) -> None:
    _setup(broker)
    broker.send("orders", "s1", count=5)
    broker.send("orders", "s2", count=3)
    broker.consume("orders", "s1", "g", 2)

    assert run_json(broker, "lite", "reset-offset", "g", "s1", "s2", "--to", "max") == [
        {"lite": "s1", "offset": 5},
        {"lite": "s2", "offset": 3},
    ]
    assert run_json(broker, "lite", "reset-offset", "g", "s1", "--to", "offset", "--value", "1") == [
        {"lite": "s1", "offset": 1}
    ]
    assert run_json(broker, "lite", "reset-offset", "g", "s1", "--to", "offset", "--value", "99") == [
        {"lite": "s1", "offset": 5}  # clamped to what the queue holds
    ]
    assert run_json(broker, "lite", "reset-offset", "g", "s2", "--to", "tail-n", "--value", "2") == [
        {"lite": "s2", "offset": 1}
    ]
    assert run_json(broker, "lite", "reset-offset", "g", "s1", "--to", "min") == [{"lite": "s1", "offset": 0}]
    assert broker.client().describe_lite_topic("orders", "s1").group_offsets == {"g": 0}

    broker.send("orders", "s3", count=4)
    assert run_json(broker, "lite", "reset-offset", "g", "s3", "--to", "tail-n", "--value", "1") == [
        {"lite": "s3", "offset": None}  # tail-n only moves an offset the group has (RocketMQ)
    ]
    code, out, _ = run(broker, "lite", "reset-offset", "g", "s1", "--to", "max")
    assert (code, out.split()) == (0, ["LITE", "OFFSET", "s1", "5"])

    code, _, err = run(broker, "lite", "reset-offset", "nogroup", "s1", "--to", "max")
    assert (code, err.split(":")[1].strip()) == (cli.EXIT_FAILED, "GroupNotFound")
    code, _, err = run(broker, "lite", "reset-offset", "g", "bad topic", "--to", "max")
    assert (code, err.split(":")[1].strip()) == (cli.EXIT_FAILED, "InvalidLiteTopic")
    assert run(broker, "lite", "reset-offset", "g", "s1")[0] == cli.EXIT_USAGE  # --to is required


def test_lite_dispatch_offers_to_the_group(broker: Broker) -> None:
    _setup(broker)
    broker.subscribe("orders", "s1", "c1")
    assert run_json(broker, "lite", "dispatch", "g", "s1", "s2") == [{"offered": "s1"}]
    assert run_json(broker, "lite", "dispatch", "g") == []
    assert broker.live.triggered == [("g", "orders", ("s1", "s2")), ("g", "orders", ())]
    code, _, err = run(broker, "lite", "dispatch", "nogroup")
    assert (code, err.split(":")[1].strip()) == (cli.EXIT_FAILED, "GroupNotFound")


@pytest.mark.parametrize("position", range(6))
def test_output_option_in_any_position_of_a_lite_command(broker: Broker, position: int) -> None:
    _setup(broker)
    args = ["lite", "lag", "g", "--top", "2"]
    args[position:position] = ["-o", "json"]
    code, out, err = run(broker, *args)
    assert (code, err) == (0, "")
    assert json.loads(out)["group"] == "g"


def test_lite_lag_of_a_group_that_never_subscribed_shows_what_waits(broker: Broker) -> None:
    """Lag is 0 (no member wants anything yet), but the 18 waiting messages are not hidden."""
    _setup(broker)
    for lite, count in (("a", 10), ("b", 8)):
        broker.send("orders", lite, count=count)
    lag = run_json(broker, "lite", "lag", "g")
    assert (lag["lag"], lag["unclaimed_messages"], lag["unclaimed_topics"]) == (0, 18, 2)


def test_a_reset_or_dispatch_naming_too_many_lite_topics_is_refused(broker: Broker) -> None:
    """At most 10,000 lite topics per ResetLiteOffsets or TriggerLiteDispatch: a request may be 64 MiB, some
    millions of names, each reset on the broker's event loop and answered in one reply. Refused before anything
    is reset."""
    _setup(broker)
    broker.send("orders", "l0", count=3)
    too_many = [f"l{i}" for i in range(10_001)]
    for args in (["lite", "reset-offset", "g", *too_many, "--to", "max"], ["lite", "dispatch", "g", *too_many]):
        code, _, err = run(broker, *args)
        assert code == cli.EXIT_FAILED
        assert "error: InvalidArgument: lites: at most 10000 lite topics per call, got 10001" in err
    assert broker.store.get_offset(model.QueueId.lmq("orders", "l0"), "g") is None  # nothing was reset
    reset = run_json(broker, "lite", "reset-offset", "g", *too_many[:10_000], "--to", "max")
    assert len(reset) == 10_000 and reset[0] == {"lite": "l0", "offset": 3}
