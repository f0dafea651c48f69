"""The access policy evaluator, pure: deny wins, default deny, lite resources by literal/prefix/pattern, source
networks, disabled and super users, and the decision cache following changes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lmq_broker import errors
from lmq_broker.access import control, document, policy
from lmq_broker.access.policy import Action, Decision, Entry, User

PUB, SUB = Action.PUB, Action.SUB


def peer() -> str:
    """A call's address, as ``context.peer`` gives it."""
    return "ipv4:127.0.0.1:1"


def rules(*entries: Entry, users: tuple[User, ...] = ()) -> policy.Rules:
    users = users or (User("alice", "alice-secret"), User("bob", "bob-secret"))
    return policy.compile_rules(users, [policy.checked_entry(e) for e in entries])


def allows(r: policy.Rules, user: str, action: Action, target: policy.Target, source: str = "") -> bool:
    subject = r.subject(user)
    assert subject is not None
    return subject.allows(action, target, policy.source_of(source) if source else None)


def test_default_deny_and_topic_allow_covers_its_lite_topics() -> None:
    r = rules(Entry("alice", "Topic:chat", (PUB,)))
    assert allows(r, "alice", PUB, policy.topic("chat"))
    assert allows(r, "alice", PUB, policy.lite("chat", "anything"))
    assert not allows(r, "alice", SUB, policy.lite("chat", "anything"))  # another action
    assert not allows(r, "alice", PUB, policy.topic("other"))
    assert not allows(r, "bob", PUB, policy.topic("chat"))  # no entry at all


def test_deny_wins_over_allow() -> None:
    r = rules(
        Entry("alice", "Topic:chat", (PUB, SUB)),
        Entry("alice", "Lite:chat/secret-*", (SUB,), Decision.DENY),
    )
    assert allows(r, "alice", SUB, policy.lite("chat", "public-1"))
    assert not allows(r, "alice", SUB, policy.lite("chat", "secret-1"))
    assert allows(r, "alice", PUB, policy.lite("chat", "secret-1"))  # the deny names Sub only
    assert allows(r, "alice", SUB, policy.under("chat"))  # a deny of some lite topics keeps the route


def test_lite_prefix_literal_and_pattern() -> None:
    r = rules(
        Entry("alice", "Lite:chat/a-*", (PUB, SUB)),
        Entry("bob", "Lite:chat/b-session", (PUB,)),
        Entry("bob", "Lite:chat/t?-*-x", (SUB,)),
    )
    assert allows(r, "alice", PUB, policy.lite("chat", "a-1"))
    assert not allows(r, "alice", PUB, policy.lite("chat", "b-1"))
    assert not allows(r, "alice", PUB, policy.lite("other", "a-1"))  # the parent is part of the resource
    assert not allows(r, "alice", PUB, policy.topic("chat"))  # lite rights are not the parent's
    assert allows(r, "alice", PUB, policy.under("chat"))  # but admit its route
    assert allows(r, "bob", PUB, policy.lite("chat", "b-session"))
    assert not allows(r, "bob", PUB, policy.lite("chat", "b-session2"))
    assert allows(r, "bob", SUB, policy.lite("chat", "t1-abc-x"))
    assert not allows(r, "bob", SUB, policy.lite("chat", "t12-abc-x"))


def test_groups_and_wildcards() -> None:
    r = rules(Entry("alice", "Group:a-*", (SUB,)), Entry("bob", "*", (PUB, SUB)))
    assert allows(r, "alice", SUB, policy.group("a-workers"))
    assert not allows(r, "alice", SUB, policy.group("b-workers"))
    assert not allows(r, "alice", SUB, policy.topic("a-workers"))  # a group resource is not a topic
    assert allows(r, "bob", SUB, policy.group("any"))
    assert allows(r, "bob", PUB, policy.lite("x", "y"))


def test_source_networks() -> None:
    r = rules(
        Entry("alice", "Topic:chat", (PUB,), sources=("10.0.0.0/8",)),
        Entry("alice", "Topic:chat", (PUB,), Decision.DENY, sources=("10.9.0.0/16",)),
    )
    assert allows(r, "alice", PUB, policy.topic("chat"), "ipv4:10.1.2.3:5555")
    assert not allows(r, "alice", PUB, policy.topic("chat"), "ipv4:10.9.2.3:5555")  # the deny's network
    assert not allows(r, "alice", PUB, policy.topic("chat"), "ipv4:192.168.1.1:5555")
    assert not allows(r, "alice", PUB, policy.topic("chat"))  # no address known: a networked rule does not apply
    assert policy.source_of("ipv6:%5B::1%5D:40000") == policy.source_of("::1")
    assert policy.source_of("unix:/tmp/x") is None


def test_disabled_and_super_users() -> None:
    users = (User("alice", "alice-secret", enabled=False), User("root", "root-secret", super_user=True))
    r = rules(Entry("alice", "*", (PUB,)), users=users)
    assert not allows(r, "alice", PUB, policy.topic("chat"))
    assert r.secret_of("alice") is None  # a disabled user cannot sign in either
    assert allows(r, "root", Action.DELETE, policy.topic("anything"))
    assert r.secret_of("root") == "root-secret"


@pytest.mark.parametrize(
    "entry",
    [
        Entry("alice", "Queue:x", (PUB,)),
        Entry("alice", "Lite:chat", (PUB,)),
        Entry("alice", "Lite:ch*/x", (PUB,)),
        Entry("alice", "Topic:", (PUB,)),
        Entry("alice", "Topic:x", ()),
        Entry("alice", "Topic:x", (PUB,), sources=("10.0.0.300/8",)),
        Entry("bad name!", "Topic:x", (PUB,)),
    ],
)
def test_bad_entries_are_refused(entry: Entry) -> None:
    with pytest.raises(errors.InvalidArgument):
        policy.checked_entry(entry)


def test_control_caches_and_forgets_on_change() -> None:
    access = control.AccessControl(True, ("admin-key", "admin-secret"))
    access.load(document.Document((User("alice", "alice-secret"),), (Entry("alice", "Topic:chat", (PUB,)),)))
    assert access.allows("alice", PUB, policy.topic("chat"))
    assert access.allows("alice", PUB, policy.topic("chat"))  # from the cache
    access.load(document.Document((User("alice", "alice-secret"),), ()))
    assert not access.allows("alice", PUB, policy.topic("chat"))  # the change applies at once
    assert access.allows("admin-key", Action.CREATE, policy.topic("any"))  # the admin pair is super
    assert access.secret_of("admin-key") == "admin-secret"
    with pytest.raises(errors.Forbidden, match="user alice may not Pub on Topic:chat"):
        access.check("alice", PUB, policy.topic("chat"))
    with pytest.raises(errors.Forbidden, match=r"user \(anonymous\)"):
        access.check("mallory", PUB, policy.topic("chat"))
    assert access.refused == {("alice", "Pub"): 1, ("(anonymous)", "Pub"): 1}
    control.AccessControl(False).check("nobody", PUB, policy.topic("chat"))  # off: everything passes


def test_document_round_trip_keeps_everything() -> None:
    doc = document.Document(
        (User("alice", "alice-secret", super_user=False, enabled=False),),
        (Entry("alice", "Lite:chat/a-*", (PUB, SUB), Decision.DENY, ("10.0.0.0/8",)),),
    )
    assert document.decode(document.encode(doc)) == doc
    assert document.decode(None) == document.Document()
    changed = document.with_entries(doc, [Entry("alice", "Lite:chat/a-*", (SUB,), Decision.DENY)])
    assert changed.entries == (Entry("alice", "Lite:chat/a-*", (SUB,), Decision.DENY),)
    assert document.without_user(changed, "alice") == document.Document()
    assert "alice-secret" not in repr(doc.users[0])


def test_the_decision_cache_is_bounded() -> None:
    access = control.AccessControl(True, cache_entries=3)
    access.load(document.Document((User("alice", "alice-secret"),), (Entry("alice", "Lite:chat/a-*", (PUB,)),)))
    for n in range(10):
        assert access.allows("alice", PUB, policy.lite("chat", f"a-{n}"))
        assert access.cached <= 3
    access.load(access.doc)
    assert access.cached == 0  # a change forgets every answer
    off = control.AccessControl(True, cache_entries=0)
    off.load(access.doc)
    assert off.allows("alice", PUB, policy.lite("chat", "a-1")) and off.cached == 0


def test_the_verifier_remembers_a_signature_for_its_second_and_forgets_on_change() -> None:
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415 (only this test needs them)

    from lmq_broker.protocol import auth  # noqa: PLC0415

    secrets = {"alice": "alice-secret"}
    version = [0]
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    def clock() -> float:  # reads ``now`` as the test moves it
        return now.timestamp()

    verify = auth.Verifier(secrets.get, 60.0, clock=clock, version=lambda: version[0])
    signed = auth.sign_metadata("alice", "alice-secret", now)
    assert verify(signed) is None and auth.USER.get() == "alice"
    assert verify(auth.sign_metadata("alice", "wrong", now)) == "signature does not match"
    assert auth.USER.get() == ""  # a refused call has no user
    now += timedelta(seconds=120)
    assert "from the broker's UTC clock" in (verify(signed) or "")  # remembered, yet the window still applies
    now -= timedelta(seconds=120)
    secrets["alice"] = "new-secret"
    assert verify(signed) is None  # remembered: the key pairs did not change as far as it knows
    version[0] += 1
    assert verify(signed) == "signature does not match"  # told of the change: checked again


def test_the_gate_remembers_admitted_consumers_until_a_change() -> None:
    from lmq_broker.protocol import auth, authorizing  # noqa: PLC0415 (only these tests need the protocol)

    access = control.AccessControl(True)
    alice = (User("alice", "alice-secret"),)
    allowed = (Entry("alice", "Lite:chat/a-*", (SUB,)), Entry("alice", "Group:g", (SUB,)))
    access.load(document.Document(alice, allowed))
    gate = authorizing.Gate(access)
    auth.USER.set("alice")
    gate.consume(peer, "g", "chat", "a-1")
    gate.consume(peer, "g", "chat", "a-1")  # remembered
    with pytest.raises(errors.Forbidden):
        gate.consume(peer, "other", "chat", "a-1")
    access.load(document.Document(alice, (*allowed, Entry("alice", "Lite:chat/a-1", (SUB,), Decision.DENY))))
    with pytest.raises(errors.Forbidden, match="Sub on Lite:chat/a-1"):
        gate.consume(peer, "g", "chat", "a-1")  # the change applies at once


def test_an_ack_of_one_entry_is_checked_as_one_of_many() -> None:
    """``Gate.ack``'s path for one entry (what the official clients send) answers as its path for several."""
    from lmq_broker.protocol import auth, authorizing  # noqa: PLC0415 (only these tests need the protocol)
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb  # noqa: PLC0415
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb  # noqa: PLC0415

    access = control.AccessControl(True)
    allowed = (Entry("alice", "Lite:chat/a-*", (SUB,)), Entry("alice", "Group:g", (SUB,)))
    access.load(document.Document((User("alice", "alice-secret"),), allowed))
    auth.USER.set("alice")

    def refused(group: str, *lites: str) -> bool:
        entries = [
            spb.AckMessageEntry(message_id=f"m{n}", receipt_handle="r", lite_topic=x) for n, x in enumerate(lites)
        ]
        request = spb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name="chat"), entries=entries)
        try:
            authorizing.Gate(access).ack(peer, request)
        except errors.Forbidden:
            return True
        return False

    for group, lite in (("g", "a-1"), ("g", "b-1"), ("other", "a-1"), ("g", "")):
        assert refused(group, lite) == refused(group, lite, lite), (group, lite)
    assert [refused("g", "a-1"), refused("g", "b-1"), refused("other", "a-1"), refused("g", "")] == [
        False,
        True,
        True,
        False,  # no lite topic named: Sub under the parent, which her lite topics of it give
    ]
    assert refused("g", "a-1", "b-1") and not refused("g", "a-1", "a-2")


def test_the_verifier_answers_as_a_fresh_check_each_time() -> None:
    """``auth.Verifier`` (remembered checks) against ``auth.check_signed`` (its plain twin), called twice per case."""
    from datetime import UTC, datetime, timedelta  # noqa: PLC0415 (only this test needs them)

    from lmq_broker.protocol import auth  # noqa: PLC0415

    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    secrets = {"alice": "alice-secret", "bob": "bob-secret"}
    verify = auth.Verifier(secrets.get, 60.0, clock=now.timestamp)
    good = auth.sign_metadata("alice", "alice-secret", now)
    cases = [
        good,
        auth.sign_metadata("bob", "bob-secret", now),
        auth.sign_metadata("alice", "bob-secret", now),
        auth.sign_metadata("carol", "alice-secret", now),
        auth.sign_metadata("alice", "alice-secret", now - timedelta(seconds=61)),
        auth.sign_metadata("alice", "alice-secret", now + timedelta(seconds=59)),
        ((auth.DATE_TIME, "20260102T030404Z"), good[1]),  # her signature, another date-time
        ((auth.DATE_TIME, "yesterday"), good[1]),
        (good[1],),
        (good[0],),
        ((auth.DATE_TIME, good[0][1]), (auth.AUTHORIZATION, good[1][1].replace("Credential=alice", "Credential=bob"))),
        ((auth.DATE_TIME, good[0][1]), (auth.AUTHORIZATION, good[1][1].replace("MQv2-HMAC-SHA1", "MQv2-HMAC-MD5"))),
    ]
    for metadata in cases * 2:
        expected = auth.check_signed(metadata, secrets.get, now=now, max_skew_s=60.0)
        assert (verify(metadata) is None) == (expected is None), (metadata, expected)


def test_a_remembered_send_answers_as_the_plain_check_through_changes() -> None:
    """``Gate.send`` (admissions remembered by user, topic and lite topic) against ``Gate.send_plain`` (its plain
    twin), each case asked twice, under rules that change between rounds: a remembered admission never outlives
    the rules that gave it, and a user whose rules name networks is decided by the caller's address each time."""
    from lmq_broker.protocol import auth, authorizing  # noqa: PLC0415 (only these tests need the protocol)
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb  # noqa: PLC0415
    from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb  # noqa: PLC0415

    def send(topic: str, *lites: str | None) -> spb.SendMessageRequest:
        messages = []
        for lite in lites:
            props = pb.SystemProperties(message_id="m", message_type=pb.NORMAL if lite is None else pb.LITE)
            if lite is not None:
                props.lite_topic = lite
            messages.append(pb.Message(topic=pb.Resource(name=topic), body=b"x", system_properties=props))
        return spb.SendMessageRequest(messages=messages)

    def refused(
        check: Callable[[authorizing.Peer, spb.SendMessageRequest], None], address: str, request: spb.SendMessageRequest
    ) -> bool:
        try:
            check(lambda: address, request)
        except errors.Forbidden:
            return True
        return False

    users = (User("alice", "alice-secret"), User("bob", "bob-secret"), User("carol", "carol-secret"))
    rounds = [
        (Entry("alice", "Lite:chat/a-*", (PUB,)), Entry("bob", "Topic:plain", (PUB,))),
        (Entry("alice", "Lite:chat/a-*", (PUB,)), Entry("alice", "Lite:chat/a-secret", (PUB,), Decision.DENY)),
        (Entry("alice", "Topic:chat", (PUB,), sources=("10.0.0.0/8",)), Entry("bob", "Lite:chat/*", (SUB,))),
        (),
    ]
    requests = [send("chat", "a-1"), send("chat", "a-secret"), send("chat", "b-1"), send("chat", ""), send("plain")]
    requests += [send("chat", "a-1", "a-2"), send("chat", "a-1", "b-1")]
    access = control.AccessControl(True)
    gate, plain = authorizing.Gate(access), authorizing.Gate(control.AccessControl(True))
    seen = []
    for entries in rounds:
        access.load(document.Document(users, entries))
        plain.access.load(access.doc)
        for user in ("alice", "bob", "carol", "nobody"):
            auth.USER.set(user)
            for address in ("ipv4:10.1.2.3:5", "ipv4:192.168.0.1:5", "ipv4:10.1.2.3:5"):
                for request in requests:
                    expected = refused(plain.send_plain, address, request)
                    for _ in range(2):
                        assert refused(gate.send, address, request) == expected, (entries, user, address, request)
                    seen.append(expected)
    assert True in seen and False in seen


def test_no_rule_grants_an_mqtt_sessions_group_a_super_user_has_them() -> None:
    """``%MQTT%…`` groups are the broker's own (a session's, a share's): not even ``*`` grants them."""
    access = control.AccessControl(True, ("admin-key", "admin-secret"))
    users = (User("bob", "bob-secret"), User("root", "root-secret", super_user=True))
    access.load(
        document.Document(users, (Entry("bob", "*", (SUB, Action.CREATE)), Entry("bob", "Group:%MQTT%*", (SUB,))))
    )
    for name in ("%MQTT%am", "%MQTT%%share%0123"):
        assert not access.allows("bob", SUB, policy.group(name))
        assert not access.allows("bob", Action.CREATE, policy.group(name))
        assert access.allows("root", SUB, policy.group(name)) and access.allows("admin-key", SUB, policy.group(name))
    assert access.allows("bob", SUB, policy.group("b-group"))
