"""Where a project tree and its local state are: which folder a deploy sends, and where the
defaults of --hosts, --cli-config and --logs-dir are found (the standard library only:
every command's start-up reads it)."""
from __future__ import annotations

import os

RELEASE_DIRS = ("remote", "configs")
#: What makes a folder a project tree dflash can deploy: the agent's launcher and its
#: package. configs/ goes along when it is there; a patched tree may hold nothing else.
PROJECT_MARKERS = ("remote/agent.py", "remote/dflash_agent/__init__.py")
#: Above this a release is refused (unless --allow-large): code and configs are small.
LARGE_RELEASE_BYTES = 64 << 20
#: Where an installed wheel keeps its copy of remote/ and configs/ (setup.py puts it there).
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "_release")
#: The copies that ship with this dflash, in the order they are looked for: the wheel's,
#: else the checkout dflash_cli/ lives in (an editable install, or a run from the checkout).
SHIPPED = (BUNDLED_DIR, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


#: What makes a folder the root of a project's local state, as `.git` makes git's: the
#: inventory, dflash.yaml or the logs folder. The defaults of --hosts, --cli-config and
#: --logs-dir are found there from any folder under it (docs/cli.md "Local state").
STATE_MARKERS = ("configs/hosts.yaml", "dflash.yaml", "logs")


def state_root(cwd: str | None = None) -> str | None:
    """The nearest folder holding `cwd` (default: the current one, itself included) that
    holds one of STATE_MARKERS; None when no folder up to / does."""
    folder = os.path.realpath(cwd or os.getcwd())
    while True:
        if any(os.path.exists(os.path.join(folder, marker)) for marker in STATE_MARKERS):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def in_state_root(relative: str) -> str:
    """`relative` (a default: logs, configs/hosts.yaml, dflash.yaml) in the state root,
    or as given (under the current folder) when there is none."""
    root = state_root()
    return relative if root is None else os.path.join(root, relative)


def is_project_tree(folder: str | os.PathLike[str]) -> bool:
    return all(os.path.isfile(os.path.join(folder, marker)) for marker in PROJECT_MARKERS)


def nearest_project_tree(cwd: str) -> str | None:
    """The nearest folder holding `cwd` (itself included) that is a project tree."""
    folder = os.path.realpath(cwd)
    while True:
        if is_project_tree(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def shipped_tree() -> str | None:
    """The tree that ships with this dflash, if it ships one."""
    return next((root for root in SHIPPED if is_project_tree(root)), None)


def source_folder(explicit: str | None, cwd: str) -> tuple[str, str] | None:
    """The folder a deploy sends and its kind: `explicit` (--source) where it is a project
    tree, else the nearest project tree holding `cwd` ("checkout"), else the one that
    ships with this dflash ("bundled"); None where there is none (the deploy refuses)."""
    if explicit is not None:
        return (os.path.realpath(explicit), "checkout") if is_project_tree(explicit) else None
    found = nearest_project_tree(cwd)
    if found is not None:
        return found, "checkout"
    shipped = shipped_tree()
    return None if shipped is None else (shipped, "bundled")

