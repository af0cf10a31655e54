"""Transports: how commands reach a host (docs/hosts.md).

`open_transport(host)` returns the one Transport for that host; make one per host per
CLI invocation and close it when done (it is a context manager). Nothing connects
until the first command. Every instance counts `round_trips` (commands run),
`bytes_received` (stdout + stderr) and `bytes_sent` (stdin), for tests and benchmarks.
"""
from __future__ import annotations

import shutil

from ..errors import DflashError, ExitCode
from ..inventory import Host
from .base import Completed, Transport
from .common import CommandFailed
from .local import LocalTransport
from .openssh import OpenSshPctTransport, OpenSshTransport

__all__ = ["Completed", "CommandFailed", "Transport", "open_transport", "ssh_client"]


def ssh_client(host: Host) -> str:
    """"openssh" or "paramiko": the client that reaches `host` (an ssh or pct host)."""
    if host.ssh_client != "auto":
        if host.ssh_client == "openssh" and not shutil.which("ssh"):
            raise DflashError(f"host {host.name}: ssh_client is openssh, but no `ssh` is on PATH",
                              ExitCode.USAGE)
        return host.ssh_client
    return "openssh" if shutil.which("ssh") else "paramiko"


def open_transport(host: Host, *, accept_new_host_key: bool = False) -> Transport:
    """The transport for `host`. accept_new_host_key records an unknown SSH host key in
    known_hosts instead of refusing it (as `host_key: accept-new` does); a changed key
    is refused either way."""
    if host.transport == "local":
        return LocalTransport(host)
    if ssh_client(host) == "openssh":
        openssh = OpenSshTransport if host.transport == "ssh" else OpenSshPctTransport
        return openssh(host, accept_new_host_key=accept_new_host_key)
    # imported here: paramiko's import costs every command a noticeable start-up time that
    # only a host it reaches should pay
    from .ssh import PctTransport, SshTransport
    paramiko = SshTransport if host.transport == "ssh" else PctTransport
    return paramiko(host, accept_new_host_key=accept_new_host_key)
