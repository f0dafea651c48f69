"""MessageReader turns wire messages into NewMessage values. ``read_all`` is the fast twin the send path runs (one
loop, values built positionally): it must equal ``read`` (the plain one) message by message, values and first error."""

from __future__ import annotations

import gzip
import hashlib
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import timestamp_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmq_broker import errors, model
from lmq_broker.dispatch import dispatcher, metadata
from lmq_broker.dispatch.testing import config_for
from lmq_broker.protocol import convert
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb

NOW_MS = 1_700_000_000_123


def reader(tmp_path: Path, **overrides: object) -> convert.MessageReader:
    config = config_for(tmp_path, **overrides)
    parents = {
        "LITE_P": model.ParentTopic("LITE_P", model.MessageType.LITE),
        "NORMAL_P": model.ParentTopic("NORMAL_P", model.MessageType.NORMAL, queue_count=1),
    }
    return convert.MessageReader(metadata.Metadata(config, parents), config, NOW_MS, 0)


def test_a_lite_message_reads_as_the_dataclass_would_build_it(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"payload",
        user_properties={"k": "v"},
        system_properties=pb.SystemProperties(
            message_id="ID1",
            message_type=pb.LITE,
            lite_topic="chat-1",
            tag="TagA",
            keys=["a", "b"],
            born_host="10.0.0.1",
            born_timestamp=convert.timestamp_of(1_690_000_000_005),
        ),
    )
    read = reader(tmp_path).read(msg)
    expected = model.NewMessage(
        message_id="ID1",
        topic="LITE_P",
        body=b"payload",
        queues=(model.QueueId.lmq("LITE_P", "chat-1"),),
        lite_topic="chat-1",
        message_type=model.MessageType.LITE,
        born_timestamp_ms=1_690_000_000_005,
        born_host="10.0.0.1",
        tag="TagA",
        keys=("a", "b"),
        message_group=None,
        user_properties={"k": "v"},
    )
    assert read == expected
    assert hash(read.queues) == hash(expected.queues)
    read.body = b"changed"  # type: ignore[misc]  # frozen to mypy: strict mode reports this ignore if it were not
    assert read.body == b"changed"  # (plain slots at run time; only the type checker guards them)


def test_a_bare_normal_message_takes_defaults_and_now(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="NORMAL_P"), body=b"x", system_properties=pb.SystemProperties(message_id="ID2")
    )
    read = reader(tmp_path).read(msg)
    assert read == model.NewMessage(
        message_id="ID2",
        topic="NORMAL_P",
        body=b"x",
        queues=(model.QueueId("NORMAL_P", 0),),
        message_type=model.MessageType.NORMAL,
        born_timestamp_ms=NOW_MS,
    )


def test_the_parent_queue_is_indexed_when_configured(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"x",
        system_properties=pb.SystemProperties(message_id="ID3", lite_topic="t"),
    )
    read = reader(tmp_path, index_parent_queue=True).read(msg)
    assert read.queues == (model.QueueId("LITE_P", 0), model.QueueId.lmq("LITE_P", "t"))


def test_the_body_limit_is_the_configured_one(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"x" * 11,
        system_properties=pb.SystemProperties(message_id="ID4", lite_topic="t"),
    )
    with pytest.raises(errors.BodyTooLarge):
        reader(tmp_path, max_body_bytes=10).read(msg)


# --- a whole request at once: read_all must equal read on each message, values and first error alike -------
def outcome(read: Callable[[], object]) -> object:
    try:
        return read()
    except errors.LmqError as exc:
        return (type(exc), exc.message)


def _set(field: str, value: Any) -> Callable[[pb.Message], None]:
    def bend(msg: pb.Message) -> None:
        sp = msg.system_properties
        if field == "topic":
            msg.topic.name = value
        elif field == "body":
            msg.body = value
        elif field == "keys":
            sp.keys.extend(value)
        elif field in ("born_timestamp", "delivery_timestamp"):
            getattr(sp, field).CopyFrom(convert.timestamp_of(value))
        else:
            setattr(sp, field, value)

    bend.__name__ = f"{field}={value!r}"[:40]
    return bend


def _drop_lite(msg: pb.Message) -> None:
    msg.system_properties.ClearField("lite_topic")


def _add_property(key: str, value: str) -> Callable[[pb.Message], None]:
    def bend(msg: pb.Message) -> None:
        msg.user_properties[key] = value

    bend.__name__ = f"property {key!r}"
    return bend


# One odd thing each (some still valid: ``read_all`` must hand exactly those on and refuse the rest).
BENDS = [
    *(_set("message_id", v) for v in ("", "z" * 129, "a\u2028b", "\u00e9")),
    *(_set("message_type", v) for v in (pb.NORMAL, pb.MESSAGE_TYPE_UNSPECIFIED, 42)),
    _set("body_encoding", pb.GZIP),
    *(_set("lite_topic", v) for v in ("", "a b", "y" * 65, "x" * 9)),
    _drop_lite,
    *(_set("tag", v) for v in ("a|b", "  ", "")),
    *(_set("keys", v) for v in ([" "], ["k"] * 65)),
    *(_set("message_group", v) for v in ("g", "")),
    _set("priority", 0),
    _set("delivery_timestamp", 0),
    *(_set("body", v) for v in (b"", b"x" * 11)),
    _add_property(" ", "v"),
    _add_property("big", "v" * 20_000),
    *(_set("topic", v) for v in ("NORMAL_P", "NOPE", "a$b", "%DLQ%G")),
]


@st.composite
def lite_requests(draw: st.DrawFn) -> list[pb.Message]:
    """Plain LITE requests in all their valid variety, some with one to three messages bent out of shape."""
    out = []
    size = draw(st.one_of(st.integers(1, 3), st.integers(16, 24)))
    for i in range(size):
        sp = pb.SystemProperties(
            message_id=f"ID{i}",
            message_type=pb.LITE,
            lite_topic=draw(st.sampled_from(["t0", "t1", "x" * 8, "chat-9"])),
            body_encoding=draw(st.sampled_from([pb.IDENTITY, pb.ENCODING_UNSPECIFIED])),
            born_host=draw(st.sampled_from(["", "10.0.0.1", "h" * 300])),
            keys=draw(st.sampled_from([[], ["k1", "k2"]])),
        )
        tag = draw(st.sampled_from([None, "TagA"]))
        if tag is not None:
            sp.tag = tag
        born = draw(st.sampled_from([None, 0, 1_690_000_000_005]))
        if born is not None:
            sp.born_timestamp.CopyFrom(convert.timestamp_of(born))
        props = draw(st.sampled_from([{}, {"k": "v"}]))
        out.append(
            pb.Message(topic=pb.Resource(name="LITE_P"), body=b"payload", system_properties=sp, user_properties=props)
        )
    for index, bend in draw(st.lists(st.tuples(st.integers(0, len(out) - 1), st.sampled_from(BENDS)), max_size=3)):
        bend(out[index])
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=lite_requests(), index_parent=st.booleans(), max_lite=st.sampled_from([64, 8]))
def test_read_all_equals_read_message_by_message(
    tmp_path: Path, request: list[pb.Message], index_parent: bool, max_lite: int
) -> None:
    overrides = {"index_parent_queue": index_parent, "max_lite_topic_size": max_lite, "max_body_bytes": 10}
    one_by_one = reader(tmp_path, **overrides)
    expected = outcome(lambda: [one_by_one.read(m) for m in request])
    assert outcome(lambda: reader(tmp_path, **overrides).read_all(request)) == expected


@pytest.mark.parametrize("bend", BENDS, ids=lambda bend: bend.__name__)
def test_each_odd_value_reads_as_message_by_message(tmp_path: Path, bend: Callable[[pb.Message], None]) -> None:
    request = [
        pb.Message(
            topic=pb.Resource(name="LITE_P"),
            body=b"payload",
            system_properties=pb.SystemProperties(message_id=f"ID{i}", message_type=pb.LITE, lite_topic=f"t{i}"),
        )
        for i in range(16)
    ]
    bend(request[1])
    overrides = {"max_lite_topic_size": 8, "max_body_bytes": 10}
    one_by_one = reader(tmp_path, **overrides)
    expected = outcome(lambda: [one_by_one.read(m) for m in request])
    assert outcome(lambda: reader(tmp_path, **overrides).read_all(request)) == expected


def test_a_plain_lite_request_reads_as_message_by_message(tmp_path: Path) -> None:
    request = [
        pb.Message(
            topic=pb.Resource(name="LITE_P"),
            body=b"b",
            user_properties={"k": "v"} if i == 1 else {},
            system_properties=pb.SystemProperties(
                message_id=f"ID{i}",
                message_type=pb.LITE,
                lite_topic=f"t{i % 2}",
                tag="T" if i == 2 else None,
                body_encoding=pb.IDENTITY if i else pb.ENCODING_UNSPECIFIED,
            ),
        )
        for i in range(4)
    ]
    whole = reader(tmp_path).read_all(request)
    assert whole == [reader(tmp_path).read(m) for m in request]
    assert whole[0].queues is whole[2].queues  # one tuple per lite topic, shared
    assert whole[0].user_properties is not whole[2].user_properties  # never one dict shared by all


def test_a_topic_deleted_since_an_earlier_request_is_not_found(tmp_path: Path) -> None:
    msg = pb.Message(
        topic=pb.Resource(name="LITE_P"),
        body=b"b",
        system_properties=pb.SystemProperties(message_id="ID1", message_type=pb.LITE, lite_topic="t"),
    )
    config = config_for(tmp_path)
    before = metadata.Metadata(config, {"LITE_P": model.ParentTopic("LITE_P", model.MessageType.LITE)})
    assert convert.MessageReader(before, config, NOW_MS, 0).read(msg).topic == "LITE_P"
    after = metadata.Metadata(config, {})  # metadata changed: the parent topic is gone
    with pytest.raises(errors.TopicNotFound):
        convert.MessageReader(after, config, NOW_MS, 0).read(msg)


def lite(body: bytes = b"x", **sp: Any) -> pb.Message:
    props = pb.SystemProperties(message_id="ID", message_type=pb.LITE, lite_topic="t", **sp)
    return pb.Message(topic=pb.Resource(name="LITE_P"), body=body, system_properties=props)


@pytest.mark.parametrize("seconds", [-1, -(10**9), 253_402_300_800, 2**62])
def test_a_born_timestamp_outside_1970_to_9999_is_invalid(tmp_path: Path, seconds: int) -> None:
    bad = lite(born_timestamp=timestamp_pb2.Timestamp(seconds=seconds))
    r = reader(tmp_path)
    with pytest.raises(errors.InvalidArgument, match="born_timestamp"):
        r.read(bad)
    with pytest.raises(errors.InvalidArgument, match="born_timestamp"):  # last of a request: all of it refused
        r.read_all([lite()] * 16 + [bad])


def test_property_limits_count_utf8_bytes(tmp_path: Path) -> None:
    r = reader(tmp_path)
    limit = convert.MAX_PROPERTIES_BYTES
    fits = pb.Message(topic=pb.Resource(name="LITE_P"), body=b"x", user_properties={"k": "é" * ((limit - 1) // 2)})
    fits.system_properties.CopyFrom(lite().system_properties)
    assert r.read(fits).user_properties["k"] == "é" * ((limit - 1) // 2)
    for text in ("é" * (limit // 2 + 1), "🚀" * (limit // 4 + 1)):  # under the limit in characters, over in bytes
        msg = pb.Message(topic=pb.Resource(name="LITE_P"), body=b"x", user_properties={text[:1]: text})
        msg.system_properties.CopyFrom(lite().system_properties)
        with pytest.raises(errors.InvalidArgument, match="exceed"):
            r.read(msg)
    huge_key = pb.Message(topic=pb.Resource(name="LITE_P"), body=b"x", user_properties={"🚀" * 16_384: "v"})
    huge_key.system_properties.CopyFrom(lite().system_properties)  # 65,536 bytes of key, 16,384 characters
    with pytest.raises(errors.InvalidArgument):
        r.read(huge_key)


def test_a_truncated_gzip_body_is_refused(tmp_path: Path) -> None:
    packed = gzip.compress(b"hello gzip " * 100)
    r = reader(tmp_path)
    assert r.read(lite(packed, body_encoding=pb.GZIP)).body == b"hello gzip " * 100
    for cut in (len(packed) - 1, len(packed) // 2, 12):
        with pytest.raises(errors.InvalidArgument, match="gzip"):
            r.read(lite(packed[:cut], body_encoding=pb.GZIP))


def delivery_of(body: bytes) -> dispatcher.Delivery:
    stored = model.StoredMessage(model.QueueId("NORMAL_P", 0), 7, "id-1", "NORMAL_P", body, NOW_MS, NOW_MS)
    return dispatcher.Delivery(stored, attempt=1, receipt_handle="r2 x NORMAL_P 0 7 1 tag", invisible_ms=30_000)


@pytest.mark.parametrize(
    ("size", "compressible", "encoding"),
    [
        (convert.WIRE_GZIP_ABOVE_BYTES, True, pb.IDENTITY),  # fits a 4 MiB frame as it is
        (convert.WIRE_GZIP_ABOVE_BYTES + 1, True, pb.GZIP),
        (4 * 1024 * 1024, True, pb.GZIP),  # --max-body-bytes' default: the largest body a client may send
        (4 * 1024 * 1024, False, pb.IDENTITY),  # gzip would not make it smaller: sent as it is
    ],
)
def test_a_body_too_large_for_a_4_mib_frame_goes_out_gzipped(size: int, compressible: bool, encoding: int) -> None:
    """Node's client receives frames of at most 4 MiB (grpc-js's default); every client inflates a GZIP body
    after checking the digest over the bytes sent."""
    body = (b"0123456789abcdef" * (size // 16 + 1))[:size] if compressible else random.Random(size).randbytes(size)
    message = convert.message_to_pb(delivery_of(body), "127.0.0.1:1")
    sp = message.system_properties
    assert sp.body_encoding == encoding
    assert sp.body_digest.checksum == hashlib.md5(message.body).hexdigest().upper()
    assert convert.body_of(message) == body
    if compressible:
        assert message.ByteSize() < 4 * 1024 * 1024
