"""What one CLI invocation holds: the inventory, one transport per host, local state."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar


from dflash_contract.names import LOGS_ENV

from .errors import DflashError
from .inventory import Host, Inventory, load_inventory
from .project_tree import in_state_root
from .transports import open_transport
from .transports.base import Transport

if TYPE_CHECKING:
    from .agent_client import AgentClient
    from .local_config import LocalConfig

T = TypeVar("T")

#: where the inventory, the logs folder and dflash.yaml are named when not passed (`--hosts`,
#: `--logs-dir`, `--cli-config`; local_config reads its variable itself)
HOSTS_ENV = "DFLASH_HOSTS"
CLI_CONFIG_ENV = "DFLASH_CLI_CONFIG"
DEFAULT_LOGS = "logs"


@dataclasses.dataclass
class Session:
    hosts_file: str | None
    logs_dir: Path
    accept_new_host_key: bool = False
    cli_config_file: str | None = None  # dflash.yaml's place (--cli-config)
    _transports: dict[str, Transport] = dataclasses.field(default_factory=dict)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # host name -> the release whose agent answers there instead of the current one's
    # (use_release): launch installs its release first and makes it current as its run starts.
    _releases: dict[str, str] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def inventory(self) -> Inventory:
        """Read on first use, so `--help` works even with a broken inventory."""
        return load_inventory(self.hosts_file)

    @functools.cached_property
    def local_config(self) -> LocalConfig:
        """dflash.yaml (local_config.py), read on first use (and imported then: deploy,
        which never reads it, starts its probes sooner without the trackers' settings)."""
        from .local_config import load_local_config

        return load_local_config(self.cli_config_file)

    @classmethod
    def from_environment(cls, hosts_file: str | os.PathLike | None = None, logs_dir: str | os.PathLike | None = None,
                         accept_new_host_key: bool = False,
                         cli_config_file: str | os.PathLike | None = None) -> "Session":
        """A session as the CLI's options make it, for a caller without them (the Python
        API): what is not passed is taken from DFLASH_HOSTS, DFLASH_LOGS and
        DFLASH_CLI_CONFIG, else the defaults (./configs/hosts.yaml or the built-in `local`,
        ./logs, ./dflash.yaml when there is one)."""
        hosts = os.fspath(hosts_file) if hosts_file is not None else os.environ.get(HOSTS_ENV)
        logs = logs_dir if logs_dir is not None else os.environ.get(LOGS_ENV) or in_state_root(DEFAULT_LOGS)
        cli_config = os.fspath(cli_config_file) if cli_config_file is not None else None
        return cls(hosts, Path(logs), accept_new_host_key, cli_config)

    def host(self, name: str) -> Host:
        return self.inventory.get(name)

    def transport(self, host: Host) -> Transport:
        """The one connection to `host` for this invocation (opened on first use)."""
        with self._lock:
            if host.name not in self._transports:
                self._transports[host.name] = open_transport(
                    host, accept_new_host_key=self.accept_new_host_key)
            return self._transports[host.name]

    def agent(self, host_name: str) -> AgentClient:
        """The agent of `host_name`'s current release (or of the one `use_release` named),
        over that host's one connection."""
        # imported here: the protocol's dataclasses, which deploy never needs, cost start-up
        from .agent_client import AgentClient

        host = self.host(host_name)
        return AgentClient(host, self.transport(host), self._releases.get(host_name))

    def use_release(self, host_name: str, release_id: str) -> None:
        """From now on, `agent(host_name)` is the agent of this installed release."""
        self._releases[host_name] = release_id

    def on_each_host(self, hosts: Sequence[Host], work: Callable[[Host], T]) -> dict[str, T | DflashError]:
        """`work(host)` for all hosts at once; a host's DflashError is its result, so one
        failing host does not hide the others'."""
        results: dict[str, T | DflashError] = {}
        if not hosts:
            return results
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(hosts))) as pool:
            futures = {pool.submit(work, host): host.name for host in hosts}
            for future in concurrent.futures.as_completed(futures):
                try:
                    results[futures[future]] = future.result()
                except DflashError as exc:
                    results[futures[future]] = exc
        return results

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
