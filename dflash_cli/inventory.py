"""The host inventory (configs/hosts.yaml, docs/hosts.md "Inventory").

`local` always exists, even without the file. `--hosts FILE` or DFLASH_HOSTS picks
another inventory; otherwise ./configs/hosts.yaml is read when present.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Literal, Mapping, Sequence

import dflash_schema

from .errors import DflashError, ExitCode
from .project_tree import in_state_root

DEFAULT_INVENTORY = Path("configs/hosts.yaml")
LOCAL_WORKSPACE = "~/.dflash/local"
BUILTIN = "(built-in)"  # the source of an inventory read from no file


@dataclasses.dataclass(frozen=True)
class Host:
    transport: Literal["local", "ssh", "pct"]
    workspace: str
    ssh: str | None = None  # user@host[:port] or an alias from ~/.ssh/config
    container: int | None = None  # the LXC vmid, for transport pct
    # Interpreter on the host (inside the container for pct). Default: the environment
    # `dflash setup` made (<workspace>/env/bin/python) where there is one, else python3
    # remotely and for `local` the interpreter running dflash (agent_client.PREFER_SETUP_ENV).
    python: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    host_key: Literal["strict", "accept-new"] = "strict"  # unknown host keys: refuse or record
    # which SSH client connects: auto is the OpenSSH client where `ssh` is installed,
    # else paramiko (docs/hosts.md "Which SSH client")
    ssh_client: Literal["auto", "openssh", "paramiko"] = "auto"
    pct: str = "pct"  # path of pct on the Proxmox node
    connect_timeout: float = 10.0
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # for the trainer
    # Where the other hosts of a run on several hosts reach this one: its rendezvous
    # address when it is the first. Often not the SSH target (a container's address is
    # not its Proxmox node's), so it is a key of its own.
    address: str | None = None
    name: str = dataclasses.field(default="", metadata={"internal": True})
    # Whether the inventory names `python`; kept through dataclasses.replace.
    python_named: bool | None = dataclasses.field(default=None, metadata={"internal": True})

    def __post_init__(self) -> None:
        if self.python_named is None:
            object.__setattr__(self, "python_named", self.python is not None)
        if self.python is None:
            object.__setattr__(self, "python", sys.executable if self.transport == "local" else "python3")
        if self.transport in ("ssh", "pct") and not self.ssh:
            raise ValueError(f"transport {self.transport} needs the key 'ssh' (user@host[:port] or an alias)")
        if self.transport == "pct" and self.container is None:
            raise ValueError("transport pct needs the key 'container' (the LXC vmid)")
        if self.transport != "pct" and self.container is not None:
            raise ValueError(f"'container' only applies to transport pct, not {self.transport}")
        if self.transport == "local" and self.ssh:
            raise ValueError("transport local takes no 'ssh' key")
        if not self.workspace:
            raise ValueError("'workspace' must not be empty")
        if self.connect_timeout <= 0:
            raise ValueError("'connect_timeout' must be positive")
        if self.address is not None and not is_address(self.address):
            raise ValueError(f"'address' must be a host name or IP address, got {self.address!r}")

    def rendezvous_address(self) -> str | None:
        """Where the other hosts reach this one: `address`, else the host of an `ssh`
        target (`user@host[:port]`) for transport ssh, else 127.0.0.1 for `local`. A pct
        container has none by default: its node's address is not its own."""
        if self.address:
            return self.address
        if self.transport == "local":
            return "127.0.0.1"
        if self.transport == "ssh" and self.ssh:
            host = self.ssh.rpartition("@")[2]
            if host.startswith("["):  # [v6 address]:port
                return host[1:].partition("]")[0]
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return None


@dataclasses.dataclass(frozen=True)
class InventoryFile:
    hosts: Mapping[str, Host] = dataclasses.field(default_factory=dict)
    # A name for several hosts, launched as one run in this order (rank 0 first).
    groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A DNS name or an IPv4/IPv6 address: what MASTER_ADDR may hold.
_ADDRESS = re.compile(r"^[A-Za-z0-9._:-]+$")


def is_address(text: str) -> bool:
    return bool(_ADDRESS.match(text))


@dataclasses.dataclass(frozen=True)
class Inventory:
    source: str  # the file read, or BUILTIN
    hosts: Mapping[str, Host]
    groups: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @property
    def described(self) -> str:
        """The inventory as a message names it: its file, or where one would have been read."""
        if self.source != BUILTIN:
            return self.source
        return f"the built-in inventory (`local` only: no --hosts, DFLASH_HOSTS or {DEFAULT_INVENTORY} here)"

    def get(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.hosts))
            groups = f"; groups: {', '.join(sorted(self.groups))}" if self.groups else ""
            raise DflashError(f"{self.source}: unknown host {name!r} (known hosts: {known}{groups})",
                              ExitCode.USAGE) from None

    def expand(self, names: Sequence[str]) -> list[Host]:
        """The hosts that host and group names stand for, in the order given (a group's
        in its own order): the rank order of a run on several hosts. A host named
        twice, directly or through a group, is an error: it would be two ranks."""
        hosts: list[Host] = []
        via: dict[str, str] = {}
        for name in names:
            members = self.groups.get(name, (name,)) if name not in self.hosts else (name,)
            for member in members:
                how = f"in group {name!r}" if member != name else "directly"
                if member in via:
                    raise DflashError(f"host {member!r} is named twice ({via[member]}, then {how}): "
                                      "a run has one trainer per host", ExitCode.USAGE)
                via[member] = how
                hosts.append(self.get(member))
        return hosts


def builtin_local() -> Host:
    return Host(transport="local", workspace=LOCAL_WORKSPACE, name="local")


def load_inventory(path: str | os.PathLike[str] | None = None) -> Inventory:
    """Read the inventory named by `path`, DFLASH_HOSTS or ./configs/hosts.yaml.

    A file named explicitly must exist; the default one may be absent (then only the
    built-in `local` host exists)."""
    explicit = path or os.environ.get("DFLASH_HOSTS")
    file = Path(explicit) if explicit else Path(in_state_root(str(DEFAULT_INVENTORY)))
    hosts: dict[str, Host] = {"local": builtin_local()}
    if not file.exists():
        if explicit:
            raise DflashError(f"{file}: inventory file not found", ExitCode.USAGE)
        return Inventory(BUILTIN, hosts)
    try:
        parsed = dflash_schema.load_file(InventoryFile, file)
    except dflash_schema.SchemaError as exc:
        raise DflashError(str(exc), ExitCode.USAGE) from exc
    for name, host in parsed.hosts.items():
        if not _HOST_NAME.match(name):
            raise DflashError(f"{file}: hosts.{name}: host names may use letters, digits, '.', '_' and '-'",
                              ExitCode.USAGE)
        hosts[name] = dataclasses.replace(host, name=name)
    return Inventory(str(file), hosts, _checked_groups(file, parsed.groups, hosts))


def _checked_groups(file: Path, groups: Mapping[str, tuple[str, ...]],
                    hosts: Mapping[str, Host]) -> dict[str, tuple[str, ...]]:
    """Every group names known hosts, each once, and is not itself a host's name."""
    for name, members in groups.items():
        where = f"{file}: groups.{name}"
        if not _HOST_NAME.match(name):
            raise DflashError(f"{where}: group names may use letters, digits, '.', '_' and '-'", ExitCode.USAGE)
        if name in hosts:
            raise DflashError(f"{where}: {name!r} is already a host's name", ExitCode.USAGE)
        if not members:
            raise DflashError(f"{where}: a group names at least one host", ExitCode.USAGE)
        for index, member in enumerate(members):
            if member not in hosts:
                known = ", ".join(sorted(hosts))
                raise DflashError(f"{where}[{index}]: unknown host {member!r} (known hosts: {known})",
                                  ExitCode.USAGE)
            if member in members[:index]:
                raise DflashError(f"{where}[{index}]: host {member!r} is in the group twice "
                                  f"(first at [{members.index(member)}])", ExitCode.USAGE)
    return dict(groups)
