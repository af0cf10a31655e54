"""A copy of what a release holds, to change and deploy without touching the checkout."""
from __future__ import annotations

import shutil
from pathlib import Path

from dflash_cli import release

REPO = Path(__file__).resolve().parents[2]


def copy_release_dirs(dest: Path) -> Path:
    """remote/ and configs/ of this checkout copied under `dest` (caches left out)."""
    for top in release.RELEASE_DIRS:
        shutil.copytree(REPO / top, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
    return dest
