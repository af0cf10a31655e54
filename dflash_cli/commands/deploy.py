"""dflash deploy: a content-addressed release of remote/ and configs/ on each host."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from ..deployment import DeployResult, deploy_host, described_source, start_probes
from ..errors import DflashError, ExitCode
from ..progress import cancel_on_ctrl_c, transfer_bars
from ..session import Session

if TYPE_CHECKING:
    from rich.table import Table


@dataclasses.dataclass(frozen=True)
class DeployDone:
    """`deploy`: the release sent and each host's outcome, in the order named: its
    DeployResult (deployed or unchanged), or its error; `interrupted` when Ctrl-C stopped
    the uploads."""
    release_id: str
    files: int
    total_bytes: int
    hosts: tuple[tuple[str, DeployResult | DflashError], ...]
    interrupted: bool


def deploy(session: Session, host_names: list[str], *, all_hosts: bool = False, verify: bool = False,
           source_dir: Path | None = None, allow_large: bool = False) -> DeployDone:
    """Deploy to each host in parallel, a progress bar per host on stderr."""
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
        with transfer_bars() as bars:
            results = session.on_each_host(
                hosts, lambda host: deploy_host(session, host, tree, bars, verify, cancel, early=early[host.name]))
    return DeployDone(tree.release_id, len(tree.files), tree.total_bytes,
                      tuple((name, results[name]) for name in host_names), cancel.is_set())


def results_table(done: DeployDone) -> Table:
    from rich.table import Table  # imported once the hosts were done
    from rich.text import Text

    table = Table(title=f"release {done.release_id} ({done.files} files, {done.total_bytes / 1024:.0f} KiB)",
                  title_justify="left")
    for column in ("host", "result", "files sent", "reused", "bytes sent", "round trips", "seconds"):
        table.add_column(column, justify="left" if column in ("host", "result") else "right")
    for name, r in done.hosts:
        if isinstance(r, DflashError):
            table.add_row(name, Text(f"failed: {r.message}", style="red"), "", "", "", "", "")
        else:
            table.add_row(name, r.status, str(r.files_sent), str(r.files_reused), str(r.bytes_sent),
                          str(r.round_trips), f"{r.seconds:.2f}")
    return table
