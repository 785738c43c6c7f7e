"""Hosts made of network namespaces, joined by a bridge.

Each host is a namespace with its loopback and one veth, whose peer is
plugged into a bridge that lives in a namespace of its own (the *switch*):
nothing is attached to the machine's own network, so traffic between hosts
never leaves these namespaces.  ``tc netem`` adds a one-way delay on every
host's veth when the kernel has it; when it does not, the hosts run
without the delay and ``Hosts.netem`` says why.

Every name carries this process's pid, so runs of several people on one
machine do not meet; ``Hosts.close`` (also run at exit and on SIGTERM)
deletes every namespace it made, which takes their veths and the bridge
with them.  Needs root.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

SUBNET = "10.201"        # hosts are 10.201.0.1, 10.201.0.2, ...


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def can_make_namespaces() -> str | None:
    """None if this process can make hosts, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs and a bridge)"
    if not any(os.access(os.path.join(directory, "ip"), os.X_OK)
               for directory in os.environ.get("PATH", "/usr/sbin:/sbin").split(":")
               + ["/usr/sbin", "/sbin"]):
        return "needs the ip command (Debian's iproute2)"
    return None


@dataclass
class Host:
    name: str             # the namespace
    address: str          # its IPv4 address on the switch
    port: str             # the switch side of its veth (in the switch namespace)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class Hosts:
    count: int
    delay_us: float = 50.0
    tag: str = field(default_factory=lambda: f"d{os.getpid()}")
    hosts: list[Host] = field(default_factory=list)
    netem: str = ""       # what the delay is: "50 us one way" or why there is none
    _made: list[str] = field(default_factory=list)

    def open(self) -> Hosts:
        atexit.register(self.close)
        switch = f"{self.tag}-sw"
        _ip("netns", "add", switch)
        self._made.append(switch)
        _ip("-n", switch, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        delays = []
        for index in range(self.count):
            name = f"{self.tag}-h{index}"
            _ip("netns", "add", name)
            self._made.append(name)
            port = f"p{index}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", name)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            address = f"{SUBNET}.{index // 250}.{index % 250 + 1}"
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{address}/16", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            self.hosts.append(Host(name, address, port))
            if self.delay_us > 0:
                delays.append(subprocess.run(
                    ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root",
                     "netem", "delay", f"{self.delay_us:g}us"], capture_output=True, text=True))
        if self.delay_us <= 0:
            self.netem = "no delay (asked for none)"
        elif all(done.returncode == 0 for done in delays):
            self.netem = f"{self.delay_us:g} us one way (tc netem on each host's interface)"
        else:
            why = next(done.stderr.strip() for done in delays if done.returncode)
            self.netem = (f"NO DELAY: this kernel lacks tc netem ({why}); hops cost what "
                          f"a veth costs, less than on a cluster's network")
        return self

    def traffic(self) -> dict[str, tuple[int, int]]:
        """Bytes (received, sent) by each host so far, read on the switch."""
        listing = json.loads(_ip("-n", f"{self.tag}-sw", "-s", "-j", "link", "show").stdout)
        by_port = {entry["ifname"]: entry.get("stats64", entry.get("stats", {}))
                   for entry in listing}
        counts = {}
        for host in self.hosts:
            stats: Any = by_port.get(host.port, {})
            # the switch side's tx is what the host received, and its rx what it sent
            counts[host.name] = (stats.get("tx", {}).get("bytes", 0),
                                 stats.get("rx", {}).get("bytes", 0))
        return counts

    def close(self) -> None:
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> Hosts:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftover_namespaces(tag: str) -> list[str]:
    """Namespaces of run ``tag`` that still exist (the test checks none)."""
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listing if line.startswith(f"{tag}-")]
