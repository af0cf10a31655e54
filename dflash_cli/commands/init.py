"""dflash init: a project's configs/hosts.yaml and dflash.yaml, commented, made from the
hosts of the user's SSH client config (docs/cli.md "Starting a project")."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import paramiko

from ..errors import DflashError, ExitCode
from ..inventory import DEFAULT_INVENTORY, LOCAL_WORKSPACE
from ..local_config import DEFAULT_LOCAL_CONFIG
from ..local_state import write_atomic
from ..transports.ssh_options import config_file

WORKSPACE = "~/dflash"  # on an SSH host: where its releases, runs and caches go
_PATTERN = set("*?!")  # a Host line's pattern, not one host


@dataclasses.dataclass(frozen=True)
class Initialized:
    """What init wrote: the files, the SSH config read, the hosts made active (those
    named) and the ones written commented out."""
    root: Path
    files: tuple[Path, ...]
    ssh_config: Path
    hosts: tuple[str, ...]
    commented: tuple[str, ...]


def ssh_hosts(path: Path) -> list[tuple[str, dict[str, str]]]:
    """(alias, what it resolves to: hostname, user, port) of each Host of the SSH client
    config that names one host (no pattern), by name; none without the file."""
    if not path.is_file():
        return []
    try:
        parsed = paramiko.SSHConfig.from_path(str(path))
    except (OSError, UnicodeDecodeError, paramiko.ssh_exception.ConfigParseError) as exc:
        raise DflashError(f"{path}: cannot read this SSH config ({exc})", ExitCode.USAGE) from exc
    found = []
    for alias in sorted(parsed.get_hostnames()):
        if not _PATTERN & set(alias):
            resolved = parsed.lookup(alias)
            found.append((alias, {key: str(resolved[key]) for key in ("hostname", "user", "port") if key in resolved}))
    return found


def _entry(alias: str, resolved: dict[str, str], commented: bool) -> str:
    mark = "# " if commented else ""
    where = " ".join(f"{key} {value}" for key, value in resolved.items())
    lines = [f"{alias}:  # {where}" if where else f"{alias}:",
             "  transport: ssh",
             f"  ssh: {alias}  # resolved as `ssh {alias}` resolves it (your SSH config)",
             f"  workspace: {WORKSPACE}"]
    return "".join(f"  {mark}{line}\n" for line in lines)


def hosts_yaml(found: list[tuple[str, dict[str, str]]], named: list[str], ssh_config: Path) -> str:
    """The inventory: `local`, the named hosts, and every other host of the SSH config
    commented out, ready to take in."""
    text = (f"# Host inventory (docs/hosts.md), written by `dflash init` from {ssh_config}.\n"
            "# `local` exists even without this file. A host of your SSH config is commented out\n"
            "# until you take it in (`dflash init HOST...` takes those named): remove the `# `\n"
            "# of its lines, and set `workspace:` to a folder on it with room for runs.\n"
            "# Check them with `dflash hosts --check`; `dflash setup HOST` makes the trainer's\n"
            "# environment there.\n"
            "hosts:\n"
            "  local:\n"
            "    transport: local\n"
            f"    workspace: {LOCAL_WORKSPACE}\n")
    for alias, resolved in found:
        if alias in named:
            text += "\n" + _entry(alias, resolved, commented=False)
    rest = [(alias, resolved) for alias, resolved in found if alias not in named]
    if rest:
        text += "\n  # The other hosts of your SSH config:\n"
        text += "\n".join(_entry(alias, resolved, commented=True) for alias, resolved in rest)
    return text


DFLASH_YAML = """\
# This machine's CLI settings (docs/cli.md "Trackers"), written by `dflash init`.
# `watch` sends every scalar it writes to TensorBoard to the trackers named here; each
# tracker's package is an extra: pip install 'dflash-trainer[wandb]' (or [mlflow], [trackio]).
trackers: {}
# trackers:
#   wandb:
#     mode: offline          # online (default), or offline: files `wandb sync` uploads later
#     project: dflash
#   mlflow:
#     tracking_uri: file:./mlruns
#     experiment: dflash
#   trackio:
#     project: dflash
"""


def initialize(named: list[str], force: bool) -> Initialized:
    """Both files in the current folder, which they make a project root (as `git init`
    makes its repository here, whatever holds it), each atomically; refused (exit 2,
    nothing written) when either exists and not `force`, or a named host is not in the
    SSH config."""
    root = Path.cwd()
    ssh_config = Path(config_file() or os.path.expanduser("~/.ssh/config"))
    found = ssh_hosts(ssh_config)
    unknown = [name for name in named if name not in dict(found)]
    if unknown:
        known = ", ".join(alias for alias, _ in found) or "none"
        raise DflashError(f"{', '.join(unknown)}: not a Host of {ssh_config} (its hosts: {known}); nothing was "
                          "written", ExitCode.USAGE, hint=f"add a Host entry for it to {ssh_config} first")
    files = {root / DEFAULT_INVENTORY: hosts_yaml(found, named, ssh_config), root / DEFAULT_LOCAL_CONFIG: DFLASH_YAML}
    there = [str(path) for path in files if path.exists()]
    if there and not force:
        raise DflashError(f"{', '.join(there)} exist{'s' if len(there) == 1 else ''}; nothing was written",
                          ExitCode.USAGE, hint="--force writes over them")
    for path, text in files.items():
        write_atomic(path, text.encode())
    return Initialized(root, tuple(files), ssh_config, tuple(named),
                       tuple(alias for alias, _ in found if alias not in named))
