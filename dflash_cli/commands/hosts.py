"""dflash hosts: the inventory, and with --check what each host really has and whether
it is ready to train (docs/hosts.md "Host environments")."""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from dflash_contract.names import IMPORT_TIMEOUT_S, TRAINER_PACKAGES
from dflash_contract.replies import HostProbe
from rich.table import Table
from rich.text import Text

from .. import console, requirements
from ..agent_client import run_probe
from ..deployment import check_host
from ..errors import DflashError, ExitCode, UnreachableError
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


def _print_options(name: str, resolved: dict) -> None:
    table = Table(title=f"{name}: ssh options (resolved by {resolved['resolved_by']}; "
                        f"connects with the {resolved['client']} client)", title_justify="left")
    for column in ("option", "value", "from"):
        table.add_column(column)
    for row in resolved["options"]:
        table.add_row(*map(Text, (row["option"], row["value"], row["source"])))
    console.human.print(table)


def run(session: Session, *, names: Sequence[str] = (), do_check: bool, as_json: bool,
        verbose: bool) -> ExitCode:
    """`names`: hosts and groups to list (each host once, in inventory order); none: all."""
    named = {host.name for name in names for host in session.inventory.expand([name])}
    hosts = [session.inventory.hosts[n] for n in sorted(session.inventory.hosts) if not names or n in named]
    needs = requirements.load() if do_check else None
    groups = session.inventory.groups
    results = session.on_each_host(hosts, lambda host: check(session, host)) if do_check else {}
    statuses: dict[str, str] = {}  # host -> its status with --check, when it answered
    rows = []
    for host in hosts:
        client = _client(host)
        # with --check: which SSH client was used to reach it
        where = f"{_where(host)} ({client})" if do_check and client else _where(host)
        row = [host.name, host.transport, where, host.workspace]
        result = results.get(host.name)
        if isinstance(result, DflashError):
            row += [f"unreachable: {result.message}" if isinstance(result, UnreachableError)
                    else f"error: {result.message}", "", "", "", "", ""]
        elif result is not None:
            facts = result.facts
            found = ", ".join(f"{g.index}:{g.name}" for g in facts.gpus) or "none"
            statuses[host.name] = status(host, result, needs)
            row += [statuses[host.name], facts.python, facts.packages["torch"] or "-",
                    facts.packages["transformers"] or "-", facts.gpus_problem or found, facts.current_release or "-"]
        rows.append(row)
        if as_json:
            entry = {"host": host.name, "transport": host.transport, "where": _where(host),
                     "workspace": host.workspace}
            if client:
                entry["ssh_client"] = client
            entry["groups"] = [name for name, members in groups.items() if host.name in members]
            if isinstance(result, DflashError):
                entry["error"] = result.message
            elif result is not None:
                entry.update(result.facts.to_json(), release_modified=result.release_modified,
                             status=statuses[host.name], missing_packages=missing_packages(result.facts))
            if verbose and host.ssh:
                entry["ssh"] = ssh_options(session, host)
            console.data(json.dumps(entry) + "\n")
        elif not do_check:
            console.data(f"{host.name}\n")
    if not as_json:  # --json is the whole answer; a table on stderr would be noise
        console.human.print(FittedTable(f"hosts ({session.inventory.source})", _CHECKED if do_check else _LISTED,
                                        rows))
        for name, members in ((n, m) for n, m in groups.items() if not names or n in names):
            console.say(f"group {name}: {', '.join(members)} (one run, rank 0 first)")
        for host in hosts if verbose else ():
            if host.ssh:
                _print_options(host.name, ssh_options(session, host))
    failures = [r for r in results.values() if isinstance(r, DflashError)]
    if any(isinstance(f, UnreachableError) for f in failures):
        return ExitCode.UNREACHABLE
    unfit = [name for name, text in statuses.items() if text != "ok"]
    return ExitCode.USAGE if failures or unfit else ExitCode.OK
