"""A copy of what a release holds, to change and deploy without touching the checkout; what
the suite added to the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from dflash_cli import release

REPO = Path(__file__).resolve().parents[2]


def copy_release_dirs(dest: Path) -> Path:
    """remote/ and configs/ of this checkout copied under `dest` (caches left out)."""
    for top in release.RELEASE_DIRS:
        shutil.copytree(REPO / top, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def build_wheel(tmp_path: Path) -> Path:
    """This checkout built as a wheel (offline, no build isolation) from a copy in
    `tmp_path`: what `pip install` of the published distribution installs."""
    src = copy_release_dirs(tmp_path / "build src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in settings["package-dir"].items():
        if not folder.startswith("remote/"):  # the CLI's and the API's; remote/ was copied whole
            shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "wheel",
                           "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp_path / "dist"),
                           str(src)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout}\n{done.stderr}"
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


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
