"""A copy of what a release holds, to change and deploy without touching the checkout; what
the suite added to the checkout."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from dflash_cli import release

REPO = Path(__file__).resolve().parents[2]


def copy_release_dirs(dest: Path) -> Path:
    """remote/ and configs/ of this checkout copied under `dest` (caches left out)."""
    for top in release.RELEASE_DIRS:
        shutil.copytree(REPO / top, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


# Written by Python itself (where PYTHONDONTWRITEBYTECODE is not set), not by a test.
CACHES = ("__pycache__/",)


def untracked_entries() -> set[str] | None:
    """`git status --porcelain --ignored`'s untracked and ignored entries of the checkout
    (folders whole), or None where it is no git work tree."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--ignored"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {line[3:] for line in done.stdout.splitlines() if line[:3] in ("?? ", "!! ")}


def added_since(before: set[str] | None) -> list[str]:
    """What is in the checkout now and was not in `before`, less Python's bytecode caches."""
    after = untracked_entries()
    if before is None or after is None:
        return []
    return sorted(entry for entry in after - before if not entry.endswith(CACHES))
