"""External addresses (``cluster.external``): the per-slot list, the per-pod template, processes per pod, and what
``serve --processes`` tells each process."""

from __future__ import annotations

import pytest

from lmq_broker import errors, supervisor
from lmq_broker.cluster import links
from lmq_broker.cluster.external import ExternalAddresses, expand, per_slot, split
from lmq_broker.config import BrokerConfig


def test_the_template_numbers_pods() -> None:
    assert expand("lmq-{ordinal}.example.com:9094", 0) == "lmq-0.example.com:9094"
    assert expand("lmq-{ordinal}.example.com:9094", 12) == "lmq-12.example.com:9094"
    assert expand("nodes.example.com:{ordinal+31000}", 3) == "nodes.example.com:31003"
    assert expand("nodes.example.com:{ordinal*4+31000}", 2) == "nodes.example.com:31008"
    assert expand("10.0.{ordinal}.7:{ordinal*2}", 5) == "10.0.5.7:10"
    assert expand("[fd00::{ordinal}]:9094", 1) == "[fd00::1]:9094"
    assert expand("lb.example.com:9094", 7) == "lb.example.com:9094"  # no placeholder: one address for all


@pytest.mark.parametrize(
    "template",
    ["lmq-{pod}.example.com:9094", "lmq-{ordinal-1}.x:1", "lmq.example.com", "lmq:{ordinal}", "lmq:70000", ":9094"],
)
def test_a_bad_template_is_refused(template: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        ExternalAddresses.parse("", template)


def test_split_reads_host_and_port() -> None:
    assert split("a.example.com:443") == ("a.example.com", 443)
    assert split("[::1]:9094") == ("[::1]", 9094)
    for bad in ("a.example.com", "a:0", "a:x", ":1"):
        with pytest.raises(errors.InvalidArgument):
            split(bad)


def test_listed_addresses_first_then_the_template() -> None:
    addresses = ExternalAddresses.parse("a.example.com:1, b.example.com:2", "lmq-{ordinal}.example.com:9094")
    assert addresses.of_slots(4) == (
        "a.example.com:1",
        "b.example.com:2",
        "lmq-2.example.com:9094",
        "lmq-3.example.com:9094",
    )
    assert addresses.configured


def test_without_a_template_only_the_listed_slots_have_an_address() -> None:
    addresses = ExternalAddresses.parse("a.example.com:1,b.example.com:2")
    assert addresses.of_slots(2) == ("a.example.com:1", "b.example.com:2")
    with pytest.raises(errors.InvalidArgument, match="slot 2"):
        addresses.of_slots(3)
    assert not ExternalAddresses.parse("").configured


def test_processes_of_a_pod_follow_the_pods_port() -> None:
    """Slots are pod-major (ordinal * processes + i); process i of a pod is at the pod's port + 1 + i."""
    addresses = ExternalAddresses.parse("", "lmq-{ordinal}.example.com:9094", processes=2)
    assert addresses.of_slots(4) == (
        "lmq-0.example.com:9095",
        "lmq-0.example.com:9096",
        "lmq-1.example.com:9095",
        "lmq-1.example.com:9096",
    )
    assert per_slot(("a:100", "b:200"), 3) == ("a:101", "a:102", "a:103", "b:201", "b:202", "b:203")
    assert per_slot(("a:100",), 1) == ("a:100",)


def test_processes_of_a_pod_get_their_external_ports_and_every_slots_address() -> None:
    """``serve --processes 2`` in pod 1 of 2: process i listens on the external port + 1 + i and shares the
    external port; the per-pod list given becomes one address per slot; the template goes on as it is, with
    the number of processes per pod."""
    config = BrokerConfig(
        port=8081,
        processes=2,
        peers="lmq-0.internal:8081,lmq-1.internal:8081",
        ordinal=1,
        external_port=9094,
        external_addresses="a.example.com:9094,b.example.com:9094",
        external_address_template="lmq-{ordinal}.example.com:9094",
    )
    p = supervisor.plan(config)
    assert (p.external_access_port, p.external_ports) == (9094, (9095, 9096))
    assert p.external_members == (
        "a.example.com:9095", "a.example.com:9096", "b.example.com:9095", "b.example.com:9096"
    )  # fmt: skip
    command = supervisor.child_command(["serve", "--external-port", "9094"], config, p, 1)
    assert "--pod-processes=2" in command
    assert command[-3:] == [
        "--external-port=9096",
        "--external-access-port=9094",
        "--external-addresses=a.example.com:9095,a.example.com:9096,b.example.com:9095,b.example.com:9096",
    ]
    child = BrokerConfig(
        peers=",".join(p.members), ordinal=3, external_port=9096, external_addresses=",".join(p.external_members),
        external_address_template=config.external_address_template, pod_processes=2,
    )  # fmt: skip
    addresses = links.external_of(child)
    assert (
        addresses is not None
        and addresses.of(3) == "b.example.com:9096"
        and addresses.of(5) == "lmq-2.example.com:9096"
    )


def test_an_external_listener_needs_an_address_for_every_peer() -> None:
    config = BrokerConfig(peers="a:1,b:2,c:3", ordinal=0, external_port=9094, external_addresses="x:1,y:2")
    with pytest.raises(errors.InvalidArgument, match="ring slot 2"):
        links.external_of(config)
    assert links.external_of(config.model_copy(update={"external_port": -1})) is None
    assert links.external_of(config.model_copy(update={"external_address_template": "z-{ordinal}:9"})) is not None
