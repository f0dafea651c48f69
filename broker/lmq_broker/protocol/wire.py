"""A SendMessageRequest kept with its wire bytes, so that what a broker forwards is cut out of the bytes the
client sent rather than encoded again (``--send-path raw``, the default; ``decoded`` is the plain twin).

The request is still decoded once, whole, by protobuf's C parser: that is the validation (a request that does
not decode is refused with the same status and text as before, nothing stored) and what this broker stores of
it. Measured on 500-message requests (issue 28 item 1, bench/RESULTS.md): the C decode costs 0.22 µs per
message, reading the two routing fields off it 1.3 µs, a wire scanner written in Python 6.3 µs, and a protobuf
"view" declaring only the routing fields 0.25 µs plus the same reads (it keeps every other field as unknown
bytes). So of what Python can do, decoding is the cheapest; what the raw path saves is the encoding: a
forwarded part was ``SendMessageRequest(messages=part)`` serialized (1.7 µs per message), it is now its
messages' original bytes joined (0.12 µs), and a request forwarded whole is passed on as it came.

What routing reads (each message's parent and lite topic) is read from the bytes by the native edge's module
when it is built (``routes``, ``lmq_edge.send_routes``, Rust), where a send arrives and where its forwarded copy
is checked: 0.05 µs per message in 500-message requests and 0.18 µs for a single message, against 0.46 and 0.86
µs to read them off protobuf's decoded messages (one process; 2.6 % fewer instructions per message in
``bench_send_path.py --mode access``, issue 28 item 1). Without the module, or on bytes the scanner does not
follow, routing reads the decoded messages as before (the plain twin, tested against it).

Wire format: a SendMessageRequest is field 1 (``messages``, length-delimited) once per message. ``RawRequest``
declares that field as ``repeated bytes``: parsing a request with it yields each message's encoding in order,
untouched, and serializing it frames such encodings back into a SendMessageRequest.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb

MESSAGES_FIELD: Final = 1  # SendMessageRequest.messages

_native: Any
try:  # a Rust extension (``make native``): no stubs, Any; a module built before ``send_routes`` reads nothing
    _native = getattr(importlib.import_module("lmq_edge"), "send_routes", None)
except ImportError:
    _native = None


def _raw_request_class() -> Any:
    """``message RawRequest { repeated bytes messages = 1; }``, in a pool of its own."""
    field = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="lmq/wire/raw_request.proto", package="lmq.wire", syntax="proto3")
    declared = file.message_type.add(name="RawRequest")
    declared.field.add(name="messages", number=MESSAGES_FIELD, type=field.TYPE_BYTES, label=field.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("lmq.wire.RawRequest"))


_RawRequest: Final = _raw_request_class()


class Sent:
    """A SendMessageRequest as decoded and the bytes it was decoded from."""

    __slots__ = ("data", "request")

    def __init__(self, request: spb.SendMessageRequest, data: bytes) -> None:
        self.request = request
        self.data = data


def sent(data: bytes) -> Sent:
    """``data`` decoded, kept with it; protobuf's DecodeError as ``SendMessageRequest.FromString`` raises it."""
    return Sent(spb.SendMessageRequest.FromString(data), data)


def messages_of(data: bytes) -> Sequence[bytes]:
    """Each message's encoding in a SendMessageRequest's bytes, in order (the request must have decoded)."""
    messages: Sequence[bytes] = _RawRequest.FromString(data).messages
    return messages


def request_of(messages: Iterable[bytes]) -> bytes:
    """A SendMessageRequest of these message encodings (from ``messages_of``), each as it is."""
    encoded: bytes = _RawRequest(messages=messages).SerializeToString()
    return encoded


def routes(data: bytes) -> tuple[str, list[str]] | None:
    """``(parent, [each message's lite topic])`` read from a SendMessageRequest's bytes (which must have decoded)
    when every message is a lite message of one parent; None otherwise, or without the native module: the
    caller then reads the decoded messages (``forwarding.Forwarder``'s plain reading)."""
    if _native is None:
        return None
    found: tuple[str, list[str]] | None = _native(data)
    return found
