"""dflash gc: remove the releases on hosts that no recorded run uses and `current` is not."""
from __future__ import annotations

import dataclasses

from dflash_contract import requests
from dflash_contract.replies import GcReply

from ..errors import DflashError, ExitCode, at_least
from ..session import Session


@dataclasses.dataclass(frozen=True)
class GcResult:
    """Each host's outcome, in the order named: its agent's reply (what it removed and
    kept, the space freed), or its error."""
    hosts: tuple[tuple[str, GcReply | DflashError], ...]


def gc(session: Session, host_names: list[str], *, all_hosts: bool = False, keep: int = 0) -> GcResult:
    """Each host's agent removes what it may (never a release a run uses, never `current`,
    never while a deploy installs one), keeping the `keep` newest unused releases."""
    at_least("keep", keep, 0)
    if all_hosts:
        host_names = sorted(session.inventory.hosts)
    if not host_names:
        raise DflashError("name at least one host, or use --all", ExitCode.USAGE)
    hosts = [session.host(name) for name in host_names]
    results = session.on_each_host(hosts, lambda host: session.agent(host.name).call(requests.Gc(keep)))
    return GcResult(tuple((name, results[name]) for name in host_names))
