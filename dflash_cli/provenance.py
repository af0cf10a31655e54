"""Where deployed code came from: its source tree, git commit and uncommitted changes.

Users deploy patched training code, so a run records the patch, not only the commit:
`deploy` and `launch` print one `source:` line, and `launch` stores the same facts in
run.json as `source` (docs/releases.md), which `status` shows. The release id already names
the code exactly; this says where it came from.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

from dflash_contract.records import ReleaseSource

from . import DISTRIBUTION, release

#: run.json lists at most this many modified paths: the record travels to the host as one
#: argument (Linux caps one at 128 KiB), and diff_sha256 covers every change anyway.
MODIFIED_LISTED = 200
_NAMES_SHOWN = 3


def describe(source: release.SourceTree, tree: release.Release, *, version: bool = True) -> ReleaseSource:
    """run.json's `source` for the release `tree` scanned from `source`. `version` False
    leaves dflash_version None unless `summary` names it (the bundled copy): looking it
    up imports importlib.metadata, CPU spent on a line that does not show it."""
    version = _dflash_version() if version or source.kind == "bundled" else None
    return ReleaseSource(kind=source.kind, path=str(source.root), release_id=tree.release_id, dflash_version=version,
                         **_git_state(source.root, tree))


def _dflash_version() -> str | None:
    from importlib import metadata  # read here: its import costs more than the rest of the module

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def summary(source: ReleaseSource) -> str:
    """One line: `/path (git abc1234, modified: 2 files [...], diff sha256 …)`."""
    details = []
    if source.kind == "bundled":
        head = f"bundled with dflash {source.dflash_version or '(version unknown)'}"
        details.append(source.path)
    else:
        head = source.path
    if source.git_commit:
        details.append(f"git {source.git_commit[:7]}")
        count = source.modified_count or 0
        if source.dirty:
            names = ", ".join(source.modified[:_NAMES_SHOWN]) + (", …" if count > _NAMES_SHOWN else "")
            details.append(f"modified: {count} file{'s' if count != 1 else ''} [{names}], "
                           f"diff sha256 {(source.diff_sha256 or '')[:12]}")
        else:
            details.append("clean")
    else:
        details.append(source.git_problem or "no git facts")
    return f"{head} ({', '.join(details)})"


def _git_state(root: Path, tree: release.Release) -> dict[str, Any]:
    """git_commit, dirty, diff_sha256, modified (the first MODIFIED_LISTED paths under
    remote/ and configs/ that differ from HEAD) and modified_count; None/empty with
    `git_problem` saying why when the tree is not a git checkout.

    diff_sha256 hashes `git diff HEAD --binary -- remote configs`, then, sorted, NUL
    path NUL sha256 of each deployed file git does not track (untracked or ignored):
    those travel too, so they are part of the patch."""
    unknown: dict[str, Any] = {"git_commit": None, "dirty": None, "diff_sha256": None, "modified": (),
                               "modified_count": 0}
    if shutil.which("git") is None:
        return {**unknown, "git_problem": "git not found"}
    try:
        # The launcher must be tracked: a tree copied into an ignored folder of another
        # repository (a venv inside a checkout) is not that repository's code.
        tracked = release.run_git(root, "ls-files", "--error-unmatch", "--", release.PROJECT_MARKERS[0])
        if tracked.returncode != 0:
            return {**unknown, "git_problem": _problem(tracked, "not a git checkout")}
        head = release.run_git(root, "rev-parse", "--verify", "--quiet", "HEAD")
        if head.returncode != 0:
            return {**unknown, "git_problem": "git checkout without a commit"}
        prefix = release.run_git(root, "rev-parse", "--show-prefix").stdout.decode().strip()
        status = release.run_git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignored=matching",
                      "--no-renames", "--", *release.RELEASE_DIRS)
    except subprocess.TimeoutExpired:
        return _timed_out(unknown)
    if status.returncode != 0:
        return {**unknown, "git_problem": _problem(status, "git failed")}
    deployed = {f.path: f.sha256 for f in tree.files}
    changed, untracked = set(), set()
    for entry in status.stdout.decode("utf-8", "surrogateescape").split("\0"):
        if not entry:
            continue
        code, path = entry[:2], entry[3:]
        path = path[len(prefix):] if path.startswith(prefix) else path  # repository-relative
        if code in ("??", "!!"):  # counts only if it is deployed (ignored caches are not)
            untracked.update(p for p in deployed if p == path or (path.endswith("/") and p.startswith(path)))
        else:
            changed.add(path)
    modified = sorted(changed | untracked)
    commit = head.stdout.decode().strip()
    if not modified:
        return {**unknown, "git_commit": commit, "dirty": False, "git_problem": None}
    try:
        diff = release.run_git(root, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--no-textconv",
                               "--no-renames", "--", *release.RELEASE_DIRS)
    except subprocess.TimeoutExpired:
        return _timed_out(unknown)
    if diff.returncode != 0:
        return {**unknown, "git_problem": _problem(diff, "git failed")}
    digest = hashlib.sha256(diff.stdout)
    for path in sorted(untracked):
        digest.update(b"\0" + path.encode("utf-8", "surrogateescape") + b"\0" + deployed[path].encode())
    return {"git_commit": commit, "dirty": True, "diff_sha256": digest.hexdigest(),
            "modified": tuple(modified[:MODIFIED_LISTED]), "modified_count": len(modified), "git_problem": None}


def _timed_out(unknown: dict[str, Any]) -> dict[str, Any]:
    return {**unknown, "git_problem": f"git did not answer within {release.GIT_TIMEOUT_S:.0f} s"}


def _problem(done: subprocess.CompletedProcess[bytes], default: str) -> str:
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    if not lines or "not a git repository" in lines[0] or "did not match any file" in lines[0]:
        return default
    return f"git: {lines[0]}"  # e.g. "fatal: detected dubious ownership in repository at …"
