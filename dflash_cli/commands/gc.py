"""dflash gc: remove the releases on hosts that no recorded run uses and `current` is not."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text


from dflash_contract import requests

from .. import console
from ..errors import DflashError, ExitCode
from ..session import Session


def run(session: Session, *, host_names: list[str], all_hosts: bool, keep: int, as_json: bool) -> ExitCode:
    """Each host's agent removes what it may (never a release a run uses, never `current`,
    never while a deploy installs one); the space freed per host on stderr (with
    `as_json`: one JSON object per host on stdout, its error for one that failed)."""
    if all_hosts:
        host_names = sorted(session.inventory.hosts)
    if not host_names:
        raise DflashError("name at least one host, or use --all", ExitCode.USAGE)
    hosts = [session.host(name) for name in host_names]
    results = session.on_each_host(hosts, lambda host: session.agent(host.name).call(requests.Gc(keep)))
    table = Table(title="releases removed", title_justify="left")
    for column in ("host", "removed", "kept", "freed"):
        table.add_column(column)
    for name in host_names:
        outcome = results[name]
        if as_json:
            console.data(console.json_line(console.host_outcome(name, outcome)))
        if isinstance(outcome, DflashError):
            table.add_row(name, Text(f"failed: {outcome.message}", style="red"), "", "")
            continue
        for removed in outcome.removed:
            if not as_json:
                console.data(f"{name}\t{removed.release_id}\t{removed.bytes}\n")
        table.add_row(name, str(len(outcome.removed)), str(len(outcome.kept)),
                      f"{outcome.freed_bytes / (1 << 20):.1f} MiB")
    if not as_json:
        console.human.print(table)
    failures = [r for r in results.values() if isinstance(r, DflashError)]
    return max((f.exit_code for f in failures), default=ExitCode.OK)
