"""Where clients outside the Kubernetes cluster reach each ring slot: the addresses routes give them.

Routes name every broker by an address; inside the cluster that is the pod's stable DNS name, which a client
behind a LoadBalancer, a NodePort or ``kubectl port-forward`` cannot resolve or reach. So a broker can serve a
second, external listener whose routes name every slot by the address its external Service gives it instead.
The listener (the port a client connected to) chooses the addresses, so every official client works unchanged.

Every broker must answer the same routes, so each one computes every slot's external address the same way: an
explicit list (``--external-addresses``, one per slot, as ``--peers``) and, for the slots past it, a per-pod
template (``--external-address-template "lmq-{ordinal}.example.com:9094"``) that also covers pods a scale-up
adds later. The template names a pod; with N processes per pod (``--processes``) slot ``ordinal * N + i`` is
process ``i`` of pod ``ordinal`` and listens on the pod's external port + 1 + i, the rule ``--peers`` follows.
``{ordinal}`` may carry a factor and an offset (``{ordinal*3+31000}``) so that one template also numbers
NodePorts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from lmq_broker import errors
from lmq_broker.cluster import ring

SEPARATOR: Final = ","
_PLACEHOLDER: Final = re.compile(r"\{ordinal(?:\*(\d+))?(?:\+(\d+))?\}")
MAX_PORT: Final = 65535


def split(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) into its parts; InvalidArgument when it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT or "{" in host or "}" in host:
        raise errors.InvalidArgument(f"external address {address!r} is not host:port")
    return host, int(port)


def expand(template: str, ordinal: int) -> str:
    """The pod ``ordinal``'s address by ``template``: each ``{ordinal}``, ``{ordinal*K}``, ``{ordinal+N}`` or
    ``{ordinal*K+N}`` replaced by the number it gives."""
    if ordinal < 0:
        raise errors.InvalidArgument(f"ordinal {ordinal} is negative")

    def value(match: re.Match[str]) -> str:
        factor, offset = match.group(1), match.group(2)
        return str(ordinal * int(factor or 1) + int(offset or 0))

    address = _PLACEHOLDER.sub(value, template)
    if "{" in address or "}" in address:
        raise errors.InvalidArgument(
            f"external address template {template!r}: only {{ordinal}}, {{ordinal*K}}, {{ordinal+N}} and "
            "{ordinal*K+N} are replaced"
        )
    split(address)
    return address


def per_slot(pods: tuple[str, ...], processes: int) -> tuple[str, ...]:
    """Addresses of pods (``host:port``) as the addresses of their slots: with several processes per pod,
    process ``i`` at the pod's port + 1 + i."""
    out: list[str] = []
    for pod in pods:
        split(pod)
        out += ring.slot_endpoints(pod, processes)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ExternalAddresses:
    listed: tuple[str, ...] = ()  # slot -> address, for the first slots
    template: str = ""  # per pod, for the slots past ``listed``
    processes: int = 1  # slots per pod

    def __post_init__(self) -> None:
        for address in self.listed:
            split(address)
        if self.processes < 1:
            raise errors.InvalidArgument(f"{self.processes} processes per pod")
        if self.template:
            expand(self.template, 0)

    @staticmethod
    def parse(listed: str, template: str = "", processes: int = 1) -> ExternalAddresses:
        """From ``--external-addresses a:1,b:2`` (per slot) and ``--external-address-template``."""
        return ExternalAddresses(
            tuple(a.strip() for a in listed.split(SEPARATOR) if a.strip()), template.strip(), processes
        )

    @property
    def configured(self) -> bool:
        return bool(self.listed or self.template)

    def of(self, slot: int) -> str:
        """Slot ``slot``'s external address; InvalidArgument when neither the list nor a template gives one."""
        if 0 <= slot < len(self.listed):
            return self.listed[slot]
        if slot < 0 or not self.template:
            raise errors.InvalidArgument(
                f"no external address for ring slot {slot}: {len(self.listed)} listed and no template"
            )
        ordinal, process = divmod(slot, self.processes)
        return per_slot((expand(self.template, ordinal),), self.processes)[process]

    def of_slots(self, count: int) -> tuple[str, ...]:
        """The addresses of slots ``0..count-1``; InvalidArgument when one has none."""
        return tuple(self.of(slot) for slot in range(count))
