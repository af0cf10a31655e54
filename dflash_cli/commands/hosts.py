"""dflash hosts: the inventory, and with --check what each host really has and whether
it is ready to train (docs/hosts.md "Host environments")."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from dflash_contract.names import IMPORT_TIMEOUT_S, TRAINER_PACKAGES
from dflash_contract.replies import HostProbe
from rich.table import Table
from rich.text import Text

from .. import requirements
from ..agent_client import run_probe
from ..deployment import check_host
from ..errors import DflashError, UnreachableError
from ..host_check import PROBE_MODULES, loader, sources
from ..inventory import Host
from ..session import Session
from ..tables import Column, FittedTable
from ..transports import ssh_client
from ..transports.ssh_options import resolve

# The agent's own host facts (stdlib only), sent with `python -c` and its modules on
# stdin: it works before anything is deployed.
_PROBE = loader("dflash_agent.gpus", "probe")
# Importing torch and transformers on a loaded host takes a while (IMPORT_TIMEOUT_S).
PROBE_TIMEOUT_S = IMPORT_TIMEOUT_S + 60
# The table's columns in row order; at a narrow terminal the least important (the highest
# priority) are left out whole, never cut: a version or a header cut short reads as another.
_LISTED = [Column("host", 0), Column("transport", 1), Column("where", 2, wrap=True), Column("workspace", 3, wrap=True)]
_CHECKED = [Column("host", 0), Column("transport", 8), Column("where", 6, wrap=True),
            Column("workspace", 7, wrap=True), Column("status", 1, wrap=True), Column("python", 5, wrap=True),
            Column("torch", 3), Column("transformers", 4), Column("GPUs", 2, wrap=True), Column("release", 9)]


@dataclasses.dataclass(frozen=True)
class HostCheck:
    """What `--check` found on a host."""
    facts: HostProbe
    release_modified: list[str]  # the current release's files that differ from its MANIFEST


def missing_packages(facts: HostProbe) -> list[str]:
    """The trainer's packages the host's interpreter lacks."""
    return [name for name in TRAINER_PACKAGES if not facts.packages.get(name)]


def check(session: Session, host: Host) -> HostCheck:
    facts = run_probe(session.transport(host), host, _PROBE, HostProbe, stdin=sources(PROBE_MODULES),
                      timeout=PROBE_TIMEOUT_S)
    # A release edited on the host runs what nobody deployed: say so (deploy repairs it).
    return HostCheck(facts, check_host(session, host) if facts.current_release else [])


def _where(host: Host) -> str:
    if host.transport == "pct":
        return f"{host.ssh} -> pct {host.container}"
    return host.ssh or "this machine"


def _client(host: Host) -> str | None:
    """The SSH client that reaches `host` ("openssh" or "paramiko"), None for local."""
    if not host.ssh:
        return None
    try:
        return ssh_client(host)
    except DflashError as exc:
        return f"none ({exc.message})"


def status(host: Host, found: HostCheck, needs: requirements.TrainerRequirements) -> str:
    """"ok", "needs setup: ..." with the command that fixes it, or "release modified"."""
    problems = requirements.readiness_problems(found.facts, needs)
    if problems:
        return f"needs setup: {'; '.join(problems)}; run: dflash setup {host.name}"
    if modified := found.release_modified:
        return (f"release modified ({len(modified)} files differ: "
                f"{'; '.join(modified)}; dflash deploy {host.name} repairs it)")
    return "ok"


def ssh_options(session: Session, host: Host) -> dict:
    """How the host's `ssh:` resolves: the effective options and where each came from."""
    options = resolve(host.ssh, host, explain=True)
    return {"resolved_by": options.resolved_by, "client": _client(host),
            "options": [{"option": o, "value": v, "source": src} for o, v, src in options.explain()]}


@dataclasses.dataclass(frozen=True)
class HostEntry:
    """One host listed: where it is reached (`client`: the SSH client that reaches it),
    with --check what was found (or its error) and its status line, with -v how its
    SSH options resolve."""
    host: Host
    client: str | None
    groups: tuple[str, ...]
    found: HostCheck | DflashError | None = None
    status: str | None = None  # `ok`, or what to do; None: not checked, or no answer
    ssh: dict | None = None


@dataclasses.dataclass(frozen=True)
class HostsListing:
    """`hosts`: each host listed in inventory order, and the groups named (all, when no
    name was given)."""
    source: str  # the inventory's file
    checked: bool
    hosts: tuple[HostEntry, ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...]


def hosts(session: Session, names: Sequence[str] = (), *, do_check: bool = False,
          verbose: bool = False) -> HostsListing:
    """`names`: hosts and groups to list (each host once, in inventory order); none: all."""
    named = {host.name for name in names for host in session.inventory.expand([name])}
    listed = [session.inventory.hosts[n] for n in sorted(session.inventory.hosts) if not names or n in named]
    needs = requirements.load() if do_check else None
    groups = session.inventory.groups
    results = session.on_each_host(listed, lambda host: check(session, host)) if do_check else {}
    entries = []
    for host in listed:
        found = results.get(host.name)
        entries.append(HostEntry(
            host, _client(host), tuple(name for name, members in groups.items() if host.name in members), found,
            status(host, found, needs) if isinstance(found, HostCheck) else None,
            ssh_options(session, host) if verbose and host.ssh else None))
    return HostsListing(str(session.inventory.source), do_check, tuple(entries),
                        tuple((n, tuple(m)) for n, m in groups.items() if not names or n in names))


def row(entry: HostEntry, checked: bool) -> list[str]:
    """The host's row of the hosts table."""
    host, found = entry.host, entry.found
    # with --check: which SSH client was used to reach it
    where = f"{_where(host)} ({entry.client})" if checked and entry.client else _where(host)
    cells = [host.name, host.transport, where, host.workspace]
    if isinstance(found, DflashError):
        cells += [f"unreachable: {found.message}" if isinstance(found, UnreachableError)
                  else f"error: {found.message}", "", "", "", "", ""]
    elif found is not None:
        facts = found.facts
        gpus = ", ".join(f"{g.index}:{g.name}" for g in facts.gpus) or "none"
        cells += [entry.status, facts.python, facts.packages["torch"] or "-",
                  facts.packages["transformers"] or "-", facts.gpus_problem or gpus, facts.current_release or "-"]
    return cells


def hosts_table(listing: HostsListing) -> FittedTable:
    return FittedTable(f"hosts ({listing.source})", _CHECKED if listing.checked else _LISTED,
                       [row(entry, listing.checked) for entry in listing.hosts])


def to_json(entry: HostEntry) -> dict:
    """The host's object of `hosts --json`."""
    host, found = entry.host, entry.found
    out = {"host": host.name, "transport": host.transport, "where": _where(host), "workspace": host.workspace}
    if entry.client:
        out["ssh_client"] = entry.client
    out["groups"] = list(entry.groups)
    if isinstance(found, DflashError):
        out["error"] = found.message
    elif found is not None:
        out.update(found.facts.to_json(), release_modified=found.release_modified, status=entry.status,
                   missing_packages=missing_packages(found.facts))
    if entry.ssh is not None:
        out["ssh"] = entry.ssh
    return out


def options_table(name: str, resolved: dict) -> Table:
    """A host's SSH options (-v): each option, its value and where it came from."""
    table = Table(title=f"{name}: ssh options (resolved by {resolved['resolved_by']}; "
                        f"connects with the {resolved['client']} client)", title_justify="left")
    for column in ("option", "value", "from"):
        table.add_column(column)
    for option in resolved["options"]:
        table.add_row(*map(Text, (option["option"], option["value"], option["source"])))
    return table
