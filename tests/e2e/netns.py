"""Several "nodes" on one machine: network namespaces joined through a bridge, with rate limits.

``Fabric(prefix)`` makes a hub namespace holding a bridge, and ``add(name)`` makes a node
namespace with one veth pair to the bridge (``eth0`` inside, address ``10.251.<net>.<n>/24``).
Nothing is added to the namespace the tests run in: only these namespaces, their links and the
project's own addresses inside them. ``limit(name, rate)`` puts a ``tbf`` on both ends of a node's
link (its egress and the bridge's egress towards it), so a node's link moves at most ``rate``
each way. ``run_in(name, argv)`` is the prefix that runs a command inside a node.

Needs root and a kernel with network namespaces, veth, bridge and tbf: ``available()`` says why
not (tests skip with that reason). ``close`` deletes every namespace it made (their links go
with them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

__all__ = ["Fabric", "available"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def available() -> str:
    """"" when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"hwrprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "b0", "type", "bridge")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot make a network namespace with a bridge here: {exc}"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            _ip("netns", "del", probe)
    return ""


class Fabric:
    def __init__(self, prefix: str, net: int = 77) -> None:
        self.prefix = prefix
        self.net = net
        self.hub = f"{prefix}hub"
        self.nodes: dict[str, tuple[str, str, str]] = {}  # name -> (netns, address, hub-side link)
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "set", "lo", "up")

    def add(self, name: str) -> str:
        """A node namespace on the bridge; its address."""
        index = len(self.nodes) + 1
        ns, hub_link = f"{self.prefix}{name}", f"v{index}"
        address = f"10.251.{self.net}.{index}"
        _ip("netns", "add", ns)
        _ip("-n", self.hub, "link", "add", hub_link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.hub, "link", "set", hub_link, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.nodes[name] = (ns, address, hub_link)
        return address

    def limit(self, name: str, rate: str, burst: str = "256kb") -> None:
        """At most ``rate`` (tc syntax: ``1gbit``, ``40mbit``) each way on ``name``'s link."""
        ns, _address, hub_link = self.nodes[name]
        for where, dev in ((ns, "eth0"), (self.hub, hub_link)):
            subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", burst, "latency", "100ms"], check=True, capture_output=True,
                           timeout=30)

    def run_in(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[name][0]]

    def address(self, name: str) -> str:
        return self.nodes[name][1]

    def close(self) -> None:
        for ns, _a, _l in self.nodes.values():
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", ns)
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            _ip("netns", "del", self.hub)
