"""A Linux network namespace joined to this host by a veth pair, for tests that partition processes for real.

``Namespace.make()`` creates ``lmqp<hex>`` with the pair ``<name>h`` (host side, ``host_ip``) and ``<name>n``
(inside, ``inner_ip``) on a /30 of 10.213.0.0/16 no interface of this host uses yet; processes started with
``namespace.wrapper`` (``ip netns exec <name>``) run inside it, where ``lo`` is up too. ``cut()`` sets the inner
end down: inside, only the namespace's own addresses and ``lo`` answer (the inner address's routes go with the
link, so processes inside call each other on 127.0.0.1); on the host, the pair's peer address stays local and
packets to ``inner_ip`` are dropped. ``heal()`` sets it up again (addresses and routes come back). ``close()``
deletes the namespace, which deletes the pair; it kills nothing: stop the processes inside first.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; ``NamespaceUnavailable`` says what failed.
"""

from __future__ import annotations

import ipaddress
import secrets
import subprocess
from dataclasses import dataclass
from typing import Final

SUBNETS: Final = ipaddress.IPv4Network("10.213.0.0/16")
IP_TIMEOUT_S: Final = 10.0


class NamespaceUnavailable(RuntimeError):
    """The namespace or its veth pair could not be made (no root, no iproute2, a kernel without them)."""


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NamespaceUnavailable(f"`ip {' '.join(args)}` could not run: {exc}") from exc
    if done.returncode != 0:
        raise NamespaceUnavailable(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("-4", "-o", "addr", "show")
    subnets = list(SUBNETS.subnets(new_prefix=30))
    for _ in range(100):
        subnet = subnets[secrets.randbelow(len(subnets))]
        if not any(f" {host}/" in used for host in subnet):
            return subnet
    raise NamespaceUnavailable(f"no free /30 in {SUBNETS}")


@dataclass(frozen=True)
class Namespace:
    name: str
    host_ip: str  # this host's end of the pair: what processes inside call to reach the host
    inner_ip: str  # the namespace's end: what the host calls to reach processes inside

    @classmethod
    def make(cls) -> Namespace:
        name = f"lmqp{secrets.token_hex(4)}"  # interface names: at most 15 characters
        subnet = _free_subnet()
        host_ip, inner_ip = (str(a) for a in list(subnet.hosts())[:2])
        _ip("netns", "add", name)
        made = cls(name, host_ip, inner_ip)
        try:
            _ip("link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}n", "netns", name)
            _ip("addr", "add", f"{host_ip}/30", "dev", f"{name}h")
            _ip("link", "set", f"{name}h", "up")
            made.run("ip", "addr", "add", f"{inner_ip}/30", "dev", f"{name}n")
            made.run("ip", "link", "set", f"{name}n", "up")
            made.run("ip", "link", "set", "lo", "up")
        except NamespaceUnavailable:
            made.close()
            raise
        return made

    @property
    def wrapper(self) -> tuple[str, ...]:
        """The command prefix that runs a program inside (``ip netns exec`` execs it: same pid)."""
        return ("ip", "netns", "exec", self.name)

    def run(self, *command: str) -> str:
        """Run an ``ip`` command inside (``command`` starts with "ip")."""
        return _ip("netns", "exec", self.name, *command)

    def cut(self) -> None:
        self.run("ip", "link", "set", f"{self.name}n", "down")

    def heal(self) -> None:
        self.run("ip", "link", "set", f"{self.name}n", "up")

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=IP_TIMEOUT_S, check=False)
