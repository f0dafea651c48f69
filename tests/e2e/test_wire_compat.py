"""Our apache.rocketmq.v2 subset against the official client's own generated descriptors.

The official client (rocketmq-python-client 5.1.2) ships compiled ``definition.proto``/``service.proto``
in ``rocketmq.grpc_protocol``. Our ``proto/`` is compiled here to a descriptor set (no Python module is
loaded, so the two copies never meet in one descriptor pool) and every message, field, enum value and RPC
we declare must exist there with the same number, type and cardinality. The official files may hold more
(we serve a subset); a renumbered field or enum value would make both sides misread each other silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from rocketmq.grpc_protocol import definition_pb2, service_pb2

Message = descriptor_pb2.DescriptorProto
Enum = descriptor_pb2.EnumDescriptorProto


def our_files(repo_root: Path, out: Path) -> list[descriptor_pb2.FileDescriptorProto]:
    well_known = Path(protoc.__file__).parent / "_proto"
    sources = [str(p.relative_to(repo_root / "proto")) for p in sorted((repo_root / "proto/apache").rglob("*.proto"))]
    args = ["protoc", f"-I{repo_root / 'proto'}", f"-I{well_known}", f"--descriptor_set_out={out}", *sources]
    assert protoc.main(args) == 0
    return list(descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file)


def official_files() -> list[descriptor_pb2.FileDescriptorProto]:
    files = []
    for module in (definition_pb2, service_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        files.append(proto)
    return files


def declared(files: list[descriptor_pb2.FileDescriptorProto]) -> tuple[dict[str, Message], dict[str, Enum]]:
    """Every message and enum, nested ones included, by full name."""
    messages: dict[str, Message] = {}
    enums: dict[str, Enum] = {}

    def walk(message: Message, scope: str) -> None:
        name = f"{scope}.{message.name}"
        messages[name] = message
        enums.update({f"{name}.{e.name}": e for e in message.enum_type})
        for nested in message.nested_type:
            walk(nested, name)

    for file in files:
        enums.update({f"{file.package}.{e.name}": e for e in file.enum_type})
        for message in file.message_type:
            walk(message, file.package)
    return messages, enums


def field_shape(field: descriptor_pb2.FieldDescriptorProto, owner: Message) -> tuple[Any, ...]:
    oneof = owner.oneof_decl[field.oneof_index].name if field.HasField("oneof_index") else None
    return (field.number, field.type, field.label, field.type_name, field.proto3_optional, oneof)


def test_our_v2_subset_matches_the_official_client_descriptors(repo_root: Path, tmp_path: Path) -> None:
    ours = our_files(repo_root, tmp_path / "ours.pb")
    theirs = official_files()
    assert {f.package for f in ours} == {f.package for f in theirs} == {"apache.rocketmq.v2"}
    our_messages, our_enums = declared(ours)
    their_messages, their_enums = declared(theirs)

    mismatches: list[str] = []
    fields_compared = 0
    for name, message in our_messages.items():
        official = their_messages.get(name)
        if official is None:
            mismatches.append(f"message {name}: not in the official client")
            continue
        by_name = {f.name: f for f in official.field}
        for field in message.field:
            other = by_name.get(field.name)
            if other is None:
                mismatches.append(f"{name}.{field.name}: not in the official client")
            elif field_shape(field, message) != field_shape(other, official):
                mismatches.append(
                    f"{name}.{field.name}: ours {field_shape(field, message)}, official {field_shape(other, official)}"
                )
            fields_compared += 1
    values_compared = 0
    for name, enum in our_enums.items():
        official_enum = their_enums.get(name)
        if official_enum is None:
            mismatches.append(f"enum {name}: not in the official client")
            continue
        numbers = {v.name: v.number for v in official_enum.value}
        for value in enum.value:
            if numbers.get(value.name) != value.number:
                mismatches.append(f"{name}.{value.name} = {value.number}, official {numbers.get(value.name)}")
            values_compared += 1

    (our_service,) = [s for f in ours for s in f.service]
    (their_service,) = [s for f in theirs for s in f.service]
    assert our_service.name == their_service.name == "MessagingService"
    official_methods = {m.name: m for m in their_service.method}
    for method in our_service.method:
        official_method = official_methods.get(method.name)
        shape = (method.input_type, method.output_type, method.client_streaming, method.server_streaming)
        if official_method is None:
            mismatches.append(f"rpc {method.name}: not in the official client")
        elif shape != (
            official_method.input_type,
            official_method.output_type,
            official_method.client_streaming,
            official_method.server_streaming,
        ):
            mismatches.append(f"rpc {method.name}: ours {shape}")

    assert mismatches == []
    # Not vacuous: the lite additions are among what was compared.
    assert len(our_messages) >= 60 and fields_compared >= 200 and values_compared >= 100, (
        len(our_messages),
        fields_compared,
        values_compared,
    )
    lite = {f.name: f.number for f in our_messages["apache.rocketmq.v2.SystemProperties"].field}
    assert lite["lite_topic"] == 21
    assert {v.name: v.number for v in our_enums["apache.rocketmq.v2.LiteSubscriptionAction"].value}[
        "COMPLETE_REMOVE"
    ] == 3
    assert "SyncLiteSubscription" in {m.name for m in our_service.method}
