"""MQTT topic <-> (parent, lite topic): a bijection between valid lite names and the MQTT topics that can name
them; filters become wildcards.Filter tuples, and what cannot be served is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker import model
from lmq_broker.mqtt import held, topics

LITE = st.text("abcXYZ019_-", min_size=1, max_size=model.MAX_LITE_TOPIC_BYTES)


@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(LITE)
def test_every_lite_topic_has_an_mqtt_topic_that_maps_back(lite: str) -> None:
    assert model.is_valid_lite_topic(lite)
    topic = topics.topic_of("chat", lite)
    assert topics.lite_of(topic) == ("chat", lite)


def test_levels_become_underscores() -> None:
    assert topics.lite_of("chat/room-1/alice") == ("chat", "room-1_alice")
    assert topics.topic_of("chat", "session_1") == "chat/session/1"
    assert topics.lite_of("chat/a//b/") == ("chat", "a__b_")  # empty levels are levels too


@pytest.mark.parametrize(
    "topic",
    ["chat", "chat/", "chat/a_b", "chat/é", "chat/a b", "bad$parent/x", "/x", "chat/" + "a" * 65],
)
def test_topics_without_a_valid_lite_topic_are_refused(topic: str) -> None:
    with pytest.raises(topics.TopicError):
        topics.lite_of(topic)


def test_filters() -> None:
    assert topics.subscription_of("chat/#") == ("chat", ("#",))
    assert topics.subscription_of("chat/room-1/+") == ("chat", ("room-1", "+"))
    assert topics.subscription_of("chat/+/x/#") == ("chat", ("+", "x", "#"))
    assert topics.filter_text("chat", ("+", "x", "#")) == "chat/+/x/#"


@pytest.mark.parametrize("topic_filter", ["#", "+/x", "chat", "chat/#/x", "chat/a+", "chat/a#", "chat/a_b", "a$b/#"])
def test_filters_this_broker_cannot_serve_are_refused(topic_filter: str) -> None:
    with pytest.raises(topics.TopicError):
        topics.subscription_of(topic_filter)


# --- every MQTT topic: the default parent (issue 27 item 1, MQTT 3.1.1 / 5.0 section 4.7) --------------------------
SPACE = topics.Space("mqtt-default", frozenset({"chat", "sensors-named"}))
TOPIC = st.text(
    st.characters(exclude_characters="+#\x00", categories=["L", "M", "N", "P", "S", "Z", "Cc", "Cf", "Co"]),
    min_size=1,
    max_size=90,
)


def _round_trip(topic: str, space: topics.Space = SPACE) -> topics.Topic:
    """``topic``'s lite topic, checked valid and mapped back (with the properties a stored message gets)."""
    where = space.lite_of(topic)
    assert model.is_valid_lite_topic(where.lite), where
    props = {topics.TOPIC_PROPERTY: topic} if topics.is_hashed(where.lite) else {}
    assert space.topic_of(where.parent, where.lite, props) == topic
    return where


@settings(deadline=None, max_examples=500)
@given(TOPIC)
def test_mqtt_4_7_every_topic_has_a_lite_topic_that_maps_back(topic: str) -> None:
    _round_trip(topic)


@settings(deadline=None, max_examples=500)
@given(TOPIC, TOPIC)
def test_two_topics_never_share_a_lite_topic(a: str, b: str) -> None:
    if a != b:
        assert SPACE.lite_of(a) != SPACE.lite_of(b)


@pytest.mark.parametrize(
    ("topic", "lite"),
    [
        ("sensors/room1/temp", "sensors_room1_temp"),
        ("TopicA", "TopicA"),
        ("TopicA/B", "TopicA_B"),
        ("/TopicA", "_TopicA"),
        ("/", "_"),
        ("a//b/", "a__b_"),
        ("$SYS/x", "-24SYS_x"),
        ("room-1/a_b", "room-2D1_a-5Fb"),
        ("a b/é", "a-20b_-C3-A9"),
        ("a-2D", "a-2D2D"),  # looks escaped: escaped again
        ("-H0123", "-2DH0123"),  # looks hashed: never starts with -H once escaped
        ("chat", "chat"),  # a parent's name alone: no lite topic there
        ("chat/a b", "chat_a-20b"),  # not [A-Za-z0-9-] after the parent
        ("chat/a_b", "chat_a-5Fb"),
        ("mqtt-default/x", "mqtt-2Ddefault_x"),  # the default parent's name is no parent level
        ("sensors-named/" + "a" * 65, topics.hashed("sensors-named/" + "a" * 65)),  # over 64 after the parent
    ],
)
def test_topics_of_no_parent_live_escaped_in_the_default_parent(topic: str, lite: str) -> None:
    assert _round_trip(topic) == ("mqtt-default", lite)


def test_named_parents_keep_their_mapping() -> None:
    assert _round_trip("chat/room-1/alice") == ("chat", "room-1_alice")
    assert _round_trip("chat//x") == ("chat", "_x")
    assert SPACE.topic_of("chat", "session_1") == "chat/session/1"  # a RocketMQ producer's lite topic


def test_names_over_the_limit_are_hashed_and_carry_their_topic() -> None:
    topic = "devices/" + "é" * 40 + "/telemetry"
    where = _round_trip(topic)
    assert where.lite == topics.hashed(topic) and len(where.lite) == 34 and where.lite.startswith(topics.HASH_MARK)
    assert _round_trip("x" * 65).lite != _round_trip("x" * 66).lite
    assert _round_trip("x" * 64).lite == "x" * 64  # at the limit: still escaped, not hashed
    small = topics.Space("d", frozenset(), max_lite_bytes=40)
    assert _round_trip("a" * 41, small).lite == topics.hashed("a" * 41)
    with pytest.raises(topics.TopicError):
        topics.Space("d", frozenset(), max_lite_bytes=20).lite_of("a" * 21)


def test_lite_names_a_rocketmq_producer_made_up_read_back_leniently() -> None:
    assert SPACE.topic_of("mqtt-default", "order-1_x") == "order-1/x"
    assert SPACE.topic_of("mqtt-default", "a-2d") == "a-2d"  # lower-case hex is no escape
    assert SPACE.topic_of("mqtt-default", "-Hdeadbeef") == "-Hdeadbeef"  # a hashed name without its topic


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#", [("mqtt-default", ("#",)), ("chat", ("#",)), ("sensors-named", ("#",))]),
        ("+/+", [("mqtt-default", ("+", "+")), ("chat", ("+",)), ("sensors-named", ("+",))]),
        ("+", [("mqtt-default", ("+",))]),
        ("chat/#", [("mqtt-default", ("chat", "#")), ("chat", ("#",))]),
        ("chat/a b", [("mqtt-default", ("chat", "a-20b"))]),
        ("chat/room-1", [("chat", ("room-1",))]),  # always kept in chat: nothing in the default parent
        ("chat/" + "a" * 65, [("mqtt-default", ("chat", "a" * 65)), ("chat", ("a" * 65,))]),  # hashed: default
        ("sensors/+/temp", [("mqtt-default", ("sensors", "+", "temp"))]),
        ("$SYS/#", [("mqtt-default", ("-24SYS", "#"))]),
        ("/+", [("mqtt-default", ("", "+"))]),
    ],
)
def test_a_filter_subscribes_in_every_parent_it_can_match(
    text: str, expected: list[tuple[str, tuple[str, ...]]]
) -> None:
    assert SPACE.subscriptions_of(text) == expected
    assert topics.filter_in("mqtt-default", *SPACE.subscriptions_of(text)[0]) == text


@pytest.mark.parametrize("text", ["", "a/#/b", "a+", "a/b#", "+a/b"])
def test_mqtt_4_7_1_invalid_filters_are_refused(text: str) -> None:
    with pytest.raises(topics.TopicError):
        SPACE.subscriptions_of(text)


@pytest.mark.parametrize(
    ("text", "topic", "taken"),
    [
        ("#", "$SYS/x", False),  # MQTT-4.7.2-1
        ("+/x", "$SYS/x", False),
        ("+/+", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("$SYS/+", "$SYS/x", True),
        ("#", "a/$x", True),  # only the first level is reserved
        ("+/+", "/TopicA", True),
        ("+", "/TopicA", False),
        ("#", "/TopicA", True),
        ("sensors/+/temp", "sensors/room1/temp", True),
        ("sensors/#", "sensors", True),  # '#' includes the parent level (MQTT-4.7.1-2)
        ("#", "x" * 70, True),  # hashed: matched on its topic
        ("x/#", "x" * 70, False),
        ("#", "$" + "x" * 70, False),
        ("chat/#", "chat/a b", True),
    ],
)
def test_what_a_filter_takes_in_the_default_parent(text: str, topic: str, taken: bool) -> None:
    parent, lite = SPACE.lite_of(topic)
    assert parent == "mqtt-default"
    props = {topics.TOPIC_PROPERTY: topic} if topics.is_hashed(lite) else {}
    ((_, levels), *_) = SPACE.subscriptions_of(text)
    assert topics.takes("mqtt-default", parent, levels, lite, props) is taken
    assert topics.matches(text, topic) is taken


def test_a_wildcard_and_a_named_filter_that_share_a_subscription_end_one_at_a_time() -> None:
    subs: held.Subs = {}
    held.add(subs, SPACE.subscriptions_of("+/x"), 1)
    held.add(subs, SPACE.subscriptions_of("chat/x"), 0)
    assert subs["chat"] == {("x",): 0}  # asked for by name: not the wildcard's
    ended = held.remove(subs, SPACE, SPACE.subscriptions_of("+/x"))
    assert ended == {"mqtt-default": [("+", "x")], "sensors-named": [("x",)]}
    assert subs["chat"] == {("x",): 0}
    assert held.remove(subs, SPACE, SPACE.subscriptions_of("chat/x")) == {"chat": [("x",)]}
    held.add(subs, SPACE.subscriptions_of("#"), 1)
    held.add(subs, SPACE.subscriptions_of("+/#"), 1)
    ended = held.remove(subs, SPACE, SPACE.subscriptions_of("#"))
    assert ended == {"mqtt-default": [("#",)]}  # "+/#" still holds ("#",) in the named parents
    assert subs["chat"] == {("#",): 1 | held.EXPANDED}
    assert held.texts(subs, "mqtt-default") == {"+/#": 1}  # what a session saves: its MQTT filters
    assert held.remove(subs, SPACE, SPACE.subscriptions_of("chat/#")) == {}  # never held
    assert not held.holds(subs, SPACE.subscriptions_of("chat/#"))  # made by "+/#", not asked for by name
    held.add(subs, SPACE.subscriptions_of("chat/room-1"), 0)
    assert held.texts(subs, "mqtt-default") == {"+/#": 1, "chat/room-1": 0}
    assert held.count(subs, "mqtt-default") == 2
