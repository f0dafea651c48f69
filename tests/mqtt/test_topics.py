"""MQTT topic <-> (parent, lite topic): a bijection between valid lite names and the MQTT topics that can name
them; filters become wildcards.Filter tuples, and what cannot be served is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker import model
from lmq_broker.mqtt import topics

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
