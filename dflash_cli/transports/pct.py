"""The `pct` hop: SSH to the Proxmox node, then `pct exec <vmid> -- argv` there, over
either SSH client (`ContainerHop` is mixed into both: openssh.py and ssh.py).

The argv is quoted once, for the node's login shell; `pct exec` passes everything
after `--` to the container without another shell. pct exits 255 with its own
message when the container does not exist or is stopped: those two become
UnreachableError; every other exit code is the command's own.
"""
from __future__ import annotations

import re
from typing import Callable

from ..errors import UnreachableError
from ..inventory import Host

#: pct's exit code for its own errors
_PCT_ERROR = 255
#: the node's shell's exit code for a program it cannot find
_NOT_FOUND = 127


class ContainerHop:
    """Wraps each argv in `pct exec VMID --` and tells pct's own failures from the command's."""

    host: Host
    _name: Callable[[], str]  # ResolvedTarget's: the inventory name

    def _enter_container(self, host: Host) -> None:
        assert host.container is not None, "Host validation guarantees `container` for pct hosts"
        self.vmid = host.container
        self.describe = f"{host.ssh} -> pct {self.vmid}"
        vmid = re.escape(str(self.vmid))
        self._no_config = re.compile(rf"Configuration file 'nodes/[^/']+/lxc/{vmid}\.conf' does not exist")
        self._not_running = re.compile(rf"\bCT {vmid} not running\b")

    def _wrap(self, argv: list[str]) -> list[str]:
        return [self.host.pct, "exec", str(self.vmid), "--", *argv]

    def _check_reachable(self, argv: list[str], code: int, stderr: bytes) -> None:
        text = stderr.decode("utf-8", errors="replace")
        where = f"{self._name()}: container {self.vmid} on {self.host.ssh}"
        if code == _PCT_ERROR and (found := self._no_config.search(text)):
            raise UnreachableError(f"{where} does not exist ({found.group(0)})",
                                   hint="check `container:` in the inventory; `pct list` on the node lists them")
        if code == _PCT_ERROR and self._not_running.search(text):
            raise UnreachableError(f"{where} is not running",
                                   hint=f"start it on the node with: pct start {self.vmid}")
        if code == _NOT_FOUND and f"{self.host.pct}:" in text:
            raise UnreachableError(f"{self._name()}: `{self.host.pct}` was not found on {self.host.ssh}",
                                   hint="set `pct:` to the path of pct on the Proxmox node")
