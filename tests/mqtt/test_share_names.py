"""Shared subscription names and their lite groups (5.0 section 4.8.2), the members' cap, and subscription
identifiers (5.0 sections 3.8.2.1.2, 3.3.2.3.8) in a subscription's options and on the wire: pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmq_broker.dispatch import metadata
from lmq_broker.mqtt import identifiers, mapping, properties, shares, wire


def test_mqtt5_4_8_2_a_share_is_its_name_and_its_filter() -> None:
    share = shares.parse("$share/consumer1/sport/tennis/+")
    assert (share.name, share.filter, share.text) == ("consumer1", "sport/tennis/+", "$share/consumer1/sport/tennis/+")
    assert shares.parse("$share/g/a//b").filter == "a//b"  # the filter is kept as written


@pytest.mark.parametrize("text", ["$share//x", "$share/a+b/x", "$share/+/x", "$share/a#/x", "$share/g", "$share/g/"])
def test_mqtt_4_8_2_1_and_2_an_invalid_share_name_or_a_missing_filter_is_refused(text: str) -> None:
    with pytest.raises(shares.ShareError):
        shares.parse(text)


def test_shares_of_one_name_and_other_filters_are_other_groups_and_never_a_session_group() -> None:
    """Section 4.8.2's example: $share/consumer1/sport/# and $share/consumer1/sport/tennis/+ are two shares."""
    one, other = shares.group_of("consumer1", "sport/#"), shares.group_of("consumer1", "sport/tennis/+")
    assert one != other and one == shares.group_of("consumer1", "sport/#")
    assert shares.group_of("a/b", "c") != shares.group_of("a", "b/c")  # the separator is not a topic character
    assert one.startswith(metadata.MQTT_GROUP_PREFIX + "%share%")  # implicit, like a session's group


# what the codec lets through (MQTT-1.5.4-1, -2): well-formed UTF-8 (no surrogates) without U+0000
MQTT_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1)


@settings(deadline=None)  # timings on a shared machine vary; the property is what counts
@given(MQTT_TEXT, MQTT_TEXT, MQTT_TEXT, MQTT_TEXT)
def test_distinct_shares_get_distinct_groups(name1: str, filter1: str, name2: str, filter2: str) -> None:
    """U+0000 separates name and filter in what is hashed: neither may hold it (the codec refuses it)."""
    if (name1, filter1) != (name2, filter2):
        assert shares.group_of(name1, filter1) != shares.group_of(name2, filter2)


def test_the_members_cap_counts_each_session_once() -> None:
    members = shares.Members(max_members=2)
    assert members.join("g", "a") and members.join("g", "a") and members.join("g", "b")
    assert not members.join("g", "c") and members.count("g") == 2
    members.leave("g", "a")
    assert members.join("g", "c")
    members.leave("g", "b")
    members.leave("g", "c")
    assert members.count("g") == 0 and members.join("g", "d")


@settings(deadline=None)
@given(st.integers(0, 0xFF), st.integers(0, identifiers.MAX_ID))
def test_mqtt5_3_8_2_1_2_the_identifier_rides_above_the_options_byte(options: int, sid: int) -> None:
    stored = identifiers.with_id(options, sid)
    assert stored & identifiers.OPTIONS_MASK == options and identifiers.id_of(stored) == sid


def test_mqtt5_3_3_2_3_8_a_publish_carries_each_matched_identifier_once() -> None:
    matched = [
        identifiers.with_id(1, 7),
        identifiers.with_id(0, 0),
        identifiers.with_id(1, 3),
        identifiers.with_id(1, 7),
    ]
    assert identifiers.ids_of(matched) == [3, 7]
    encoded = mapping.outgoing({"k": "v"}, 0, [3, identifiers.MAX_ID])
    decoded = properties.decode(wire.Reader(encoded), properties.Context.PUBLISH)
    assert decoded.subscription_ids == (3, identifiers.MAX_ID) and decoded.user == (("k", "v"),)
