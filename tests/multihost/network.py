"""Hosts made of network namespaces: one private bridge, one veth pair per host.

The bridge lives in the root namespace with address ``.1`` of a private /24
(``10.231.<random>.0/24``, one not routed here already), so the test process
itself is the load generator and reaches every host only at its own address.
Every name carries a random suffix (``cl-<6 hex>-<host>``, ``clb<6 hex>``), so
parallel runs never meet. :meth:`Network.close` removes all of it and is safe
to call on a half-built network.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import subprocess
from dataclasses import dataclass, field


class NetworkUnavailable(Exception):
    """Namespaces, veths or a bridge cannot be made here; the message says why."""


def ip(*args: str) -> None:
    """Run one ``ip`` command.

    :raises subprocess.CalledProcessError: if it fails (its stderr is kept).
    """
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the bridge and its link's bridge-side end."""

    name: str
    namespace: str
    address: str
    link: str

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]


@dataclass
class Network:
    """A bridge and the hosts plugged into it; built by :meth:`add`, removed by :meth:`close`."""

    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network = field(default_factory=lambda: free_subnet())
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge_made: bool = False

    @property
    def bridge(self) -> str:
        return f"clb{self.suffix}"

    @property
    def gateway_address(self) -> str:
        return str(self.subnet.network_address + 1)

    def open(self) -> None:
        """Make the bridge and give it the subnet's first address.

        :raises NetworkUnavailable: not root, or the kernel refuses a namespace or a bridge.
        """
        if os.geteuid() != 0:
            raise NetworkUnavailable("network namespaces need root")
        probe = f"cl-{self.suffix}-probe"
        try:
            ip("netns", "add", probe)
            ip("netns", "delete", probe)
            ip("link", "add", self.bridge, "type", "bridge")
        except (OSError, subprocess.CalledProcessError) as error:
            raise NetworkUnavailable(
                f"cannot make namespaces or a bridge: {reason(error)}"
            ) from None
        self.bridge_made = True
        ip("addr", "add", f"{self.gateway_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        """A new namespace ``name`` on the bridge, with the next free address, its links up."""
        host = Host(
            name=name,
            namespace=f"cl-{self.suffix}-{name}",
            address=str(self.subnet.network_address + 10 + len(self.hosts)),
            link=f"cl{self.suffix}{name}"[:15],
        )
        ip("netns", "add", host.namespace)
        self.hosts[name] = host
        ip(
            "link",
            "add",
            host.link,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.namespace,
        )
        ip("link", "set", host.link, "master", self.bridge, "up")
        inside = ["-n", host.namespace]
        ip(*inside, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        ip(*inside, "link", "set", "lo", "up")
        return host

    def set_link(self, host: Host, up: bool) -> None:
        """Plug ``host``'s cable in or pull it out, at the bridge's end."""
        ip("link", "set", host.link, "up" if up else "down")

    def close(self) -> list[str]:
        """Delete every namespace (and so its veth pair) and the bridge; what failed, if any."""
        failures = []
        for host in self.hosts.values():
            failures += attempt("link", "delete", host.link)
            failures += attempt("netns", "delete", host.namespace)
        self.hosts.clear()
        if self.bridge_made:
            failures += attempt("link", "delete", self.bridge)
            self.bridge_made = False
        return failures


def attempt(*args: str) -> list[str]:
    """Run ``ip args``; a failure is returned, not raised, except for a name already gone."""
    try:
        ip(*args)
    except subprocess.CalledProcessError as error:
        if "Cannot find device" in error.stderr or "No such file" in error.stderr:
            return []
        return [f"ip {' '.join(args)}: {reason(error)}"]
    return []


def reason(error: OSError | subprocess.CalledProcessError) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        return (error.stderr or "").strip() or f"exit status {error.returncode}"
    return str(error)


def free_subnet() -> ipaddress.IPv4Network:
    """A ``10.231.x.0/24`` that no address or route of this host overlaps."""
    taken = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, timeout=30
    ).stdout
    choices = list(range(256))
    random.shuffle(choices)
    for third in choices:
        subnet = ipaddress.IPv4Network(f"10.231.{third}.0/24")
        if f"10.231.{third}." not in taken:
            return subnet
    raise NetworkUnavailable("every 10.231.x.0/24 is in use here")
