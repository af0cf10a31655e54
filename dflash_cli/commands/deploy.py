"""dflash deploy: a content-addressed release of remote/ and configs/ on each host."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .. import console, release
from ..deployment import DeployResult, deploy_host, described_source, start_probes
from ..errors import DflashError, ExitCode
from ..progress import cancel_on_ctrl_c, transfer_bars
from ..session import Session

if TYPE_CHECKING:
    from rich.table import Table


def run(session: Session, *, host_names: list[str], all_hosts: bool, verify: bool,
        source_dir: Path | None, allow_large: bool, as_json: bool = False) -> ExitCode:
    """Deploy to each host in parallel; a table of results on stderr (with `as_json`, one
    JSON object per host on stdout instead)."""
    if all_hosts:
        host_names = sorted(session.inventory.hosts)
    if not host_names:
        raise DflashError("name at least one host, or use --all", ExitCode.USAGE)
    hosts = [session.host(name) for name in host_names]  # unknown names fail before any work
    # Ctrl-C from here on, while the tree is hashed too, stops each host's upload and says so.
    with cancel_on_ctrl_c() as cancel:
        # Each host's connection and receiver start while the tree is hashed.
        source, listing, early = start_probes(session, hosts, verify, source_dir, allow_large)
        try:
            tree = listing.hashed()
        except BaseException:
            for probe in early.values():
                probe.abandon()
            raise
        for probe in early.values():
            probe.ask(tree.release_id)
        described_source(source, tree, kept=False)  # while the hosts look
        table = _table(tree)
        with transfer_bars() as bars:
            results = session.on_each_host(
                hosts, lambda host: deploy_host(session, host, tree, bars, verify, cancel, early=early[host.name]))
    if not as_json:
        _print_table(table, results, host_names)
    failures = [r for r in results.values() if isinstance(r, DflashError)]
    for name in host_names:
        outcome = results[name]
        if isinstance(outcome, DflashError) and outcome.hint:
            console.say(f"{name}: hint: {outcome.hint}")
        if cancel.is_set() and isinstance(outcome, DeployResult):
            console.say(f"{name}: release {outcome.release_id} is live ({outcome.status} "
                        "before the interrupt took effect)")
    for name in host_names:
        outcome = results[name]
        if as_json:
            console.data(console.json_line(console.host_outcome(name, outcome)))
        elif isinstance(outcome, DeployResult):
            console.data(f"{name}\t{outcome.release_id}\t{outcome.status}\n")
    if cancel.is_set():
        return ExitCode.INTERRUPTED
    return max((f.exit_code for f in failures), default=ExitCode.OK)


def _table(tree: release.Release) -> Table:
    """The results' table, with no row yet."""
    from rich.table import Table  # imported once the hosts were asked

    table = Table(title=f"release {tree.release_id} ({len(tree.files)} files, "
                        f"{tree.total_bytes / 1024:.0f} KiB)", title_justify="left")
    for column in ("host", "result", "files sent", "reused", "bytes sent", "round trips", "seconds"):
        table.add_column(column, justify="left" if column in ("host", "result") else "right")
    return table


def _print_table(table: Table, results: dict, order: list[str]) -> None:
    from rich.text import Text

    for name in order:
        r = results[name]
        if isinstance(r, DflashError):
            table.add_row(name, Text(f"failed: {r.message}", style="red"), "", "", "", "", "")
        else:
            table.add_row(name, r.status, str(r.files_sent), str(r.files_reused), str(r.bytes_sent),
                          str(r.round_trips), f"{r.seconds:.2f}")
    console.human.print(table)
