"""What the shell completes (docs/cli.md "Shell completion"): run ids and run names from
logs/, hosts and groups from the inventory. Read from this machine only: a completion
asks no host anything, and one that cannot read what it needs offers nothing."""
from __future__ import annotations

from pathlib import Path

import click
from click.shell_completion import CompletionItem

from .errors import DflashError
from .inventory import load_inventory
from .local_state import recorded_runs
from .project_tree import in_state_root
from .run_names import name_of, newest_first
from .session import DEFAULT_LOGS

PROG = "dflash"
COMPLETE_VAR = "_DFLASH_COMPLETE"  # click's: `_DFLASH_COMPLETE=bash_source dflash` prints the bash script
SHELLS = ("bash", "zsh", "fish")


def _root_option(ctx: click.Context, name: str) -> str | None:
    """A global option (`--logs-dir`, `--hosts`) as typed or from its variable."""
    return ctx.find_root().params.get(name)


def runs(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The run ids logs/ records (of --host, when typed), and the runs' names, that
    start with what is typed; each id with its host."""
    logs = Path(_root_option(ctx, "logs_dir") or in_state_root(DEFAULT_LOGS))
    try:
        refs = recorded_runs(logs, ctx.params.get("host_name"))
    except DflashError:  # a logs/latest.json that names no folder: nothing to offer from it
        return []
    hosts = {ref.run_id: ref.host for ref in refs}
    ids = [run_id for run_id in newest_first(list(hosts)) if run_id.startswith(incomplete)]
    names = sorted({name for run_id in hosts if (name := name_of(run_id)) and name.startswith(incomplete)} - set(ids))
    return ([CompletionItem(run_id, help=hosts[run_id]) for run_id in ids]
            + [CompletionItem(name, help="run name") for name in names])


def _inventory_names(ctx: click.Context, groups: bool) -> list[tuple[str, str]]:
    try:
        inventory = load_inventory(_root_option(ctx, "hosts_file"))
    except DflashError:
        return []
    names = [(name, host.transport) for name, host in sorted(inventory.hosts.items())]
    return names + ([(name, "group") for name in sorted(inventory.groups)] if groups else [])


def hosts(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The inventory's hosts that start with what is typed."""
    return [CompletionItem(name, help=kind) for name, kind in _inventory_names(ctx, groups=False)
            if name.startswith(incomplete)]


def hosts_and_groups(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The inventory's hosts and groups that start with what is typed."""
    return [CompletionItem(name, help=kind) for name, kind in _inventory_names(ctx, groups=True)
            if name.startswith(incomplete)]
