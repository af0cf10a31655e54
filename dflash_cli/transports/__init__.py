"""Transports: how commands reach a host (DESIGN.md "Hosts and hops").

`open_transport(host)` returns the one Transport for that host; make one per host per
CLI invocation and close it when done (it is a context manager). Nothing connects
until the first command. Every instance counts `round_trips` (commands run),
`bytes_received` (stdout + stderr) and `bytes_sent` (stdin), for tests and benchmarks.
"""
from __future__ import annotations

from ..inventory import Host
from .base import Completed, Transport
from .common import CommandFailed

__all__ = ["Completed", "CommandFailed", "Transport", "open_transport"]


def open_transport(host: Host, *, accept_new_host_key: bool = False) -> Transport:
    """The transport for `host`. accept_new_host_key records an unknown SSH host key in
    known_hosts instead of refusing it (as `host_key: accept-new` does); a changed key
    is refused either way."""
    # imported here: paramiko costs a noticeable start-up time that
    # commands on the local host should not pay
    if host.transport == "local":
        from .local import LocalTransport
        return LocalTransport(host)
    if host.transport == "ssh":
        from .ssh import SshTransport
        return SshTransport(host, accept_new_host_key=accept_new_host_key)
    from .pct import PctTransport
    return PctTransport(host, accept_new_host_key=accept_new_host_key)
