"""A network namespace joined to the node's by one link (a veth pair), for a container of
the fake node whose network a test can cut (FakePve.add_netns_container): the node's
end of the link taken down drops every packet both ways, as a partition does, without
closing a connection or telling either side. Needs root and iproute2's `ip`."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import subprocess
from typing import Iterator

_COUNTER = itertools.count()
SUBNETS = "10.251"  # /30s are taken from 10.251.0.0/16, one per link


@dataclasses.dataclass(frozen=True)
class Link:
    namespace: str  # its file: /run/netns/<namespace>
    node_side: str  # the interface on the node's side
    inside: str  # the interface in the namespace
    node_address: str
    address: str  # inside

    @property
    def path(self) -> str:
        return f"/run/netns/{self.namespace}"

    def down(self) -> None:
        """Cut the link: its node side down (the inside loses its carrier)."""
        ip("link", "set", self.node_side, "down")

    def up(self) -> None:
        ip("link", "set", self.node_side, "up")


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _free_subnet() -> int:
    """A third octet of SUBNETS that no address of the node's uses (a /30 at .0 of it)."""
    used = ip("-4", "-o", "addr", "show")
    start = os.getpid() % 250
    for third in ((start + i) % 250 for i in range(250)):
        if f" {SUBNETS}.{third}." not in used:
            return third
    raise RuntimeError(f"no free /30 left in {SUBNETS}.0.0/16")


@contextlib.contextmanager
def linked_namespace() -> Iterator[Link]:
    """A namespace with its loopback up and one link to the node's namespace, removed
    (with the link) on exit."""
    if shutil.which("ip") is None:
        raise RuntimeError("the network namespace tests need iproute2's `ip`")
    tag = f"{os.getpid() % 100000}{next(_COUNTER)}"
    third = _free_subnet()
    link = Link(f"dflash-{tag}", f"dfl{tag}n", f"dfl{tag}c", f"{SUBNETS}.{third}.1", f"{SUBNETS}.{third}.2")
    ip("netns", "add", link.namespace)
    try:
        ip("link", "add", link.node_side, "type", "veth", "peer", "name", link.inside)
        ip("link", "set", link.inside, "netns", link.namespace)
        ip("addr", "add", f"{link.node_address}/30", "dev", link.node_side)
        ip("link", "set", link.node_side, "up")
        ip("-n", link.namespace, "addr", "add", f"{link.address}/30", "dev", link.inside)
        ip("-n", link.namespace, "link", "set", link.inside, "up")
        ip("-n", link.namespace, "link", "set", "lo", "up")
        yield link
    finally:
        subprocess.run(["ip", "link", "del", link.node_side], capture_output=True)  # both ends go
        ip("netns", "del", link.namespace)
