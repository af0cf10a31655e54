"""A run's checkpoints as resume, restart and status take them (docs/runs.md "Attempts").

A checkpoint is complete when its step folder holds every file (attempts.checkpoint_folders)
and intact when they hold what its SHA256SUMS lists (dflash_files.checksums.verify). A
resume or a restart starts only from an intact one: each reads every byte of the one it
picks, newest first, passing over (and naming) the corrupt ones. `status` of a run that
ended verifies too, but remembers each folder's verdict with the identity of its files
(device, inode, size, mtime, ctime) in checkpoints/.verified.json, so that it hashes a
checkpoint once, not on every call: a file changed through the filesystem has another
identity and is hashed again.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional, Tuple

from dflash_contract.replies import CorruptCheckpoint
from dflash_files.atomic import write_json_atomic
from dflash_files.checkpoint_files import CHECKPOINTS_DIR, LOADED_FILES
from dflash_files.checksums import verify

from .attempts import checkpoint_folders
from .jsonio import AgentError, read_json
from .layout import RunDir

VERDICTS = ".verified.json"  # in CHECKPOINTS_DIR: status's remembered verdicts


@dataclasses.dataclass(frozen=True)
class Pick:
    """The checkpoint to start from (None: no intact one), and the newer ones found corrupt."""
    checkpoint: Optional[Tuple[int, str]]
    corrupt: Tuple[CorruptCheckpoint, ...]  # newest first


def newest_intact(run: RunDir, remembered: bool = False) -> Pick:
    """The newest intact checkpoint, every byte read (`remembered`: a verdict kept from
    an earlier call for files of the same identity is taken instead, as status does)."""
    verdicts = _Verdicts(run)
    corrupt = []
    for step, folder in reversed(checkpoint_folders(run)):
        problem = verdicts.problem(folder, remembered)
        if problem is None:
            verdicts.save()
            return Pick((step, folder), tuple(corrupt))
        corrupt.append(CorruptCheckpoint(step=step, path=folder, problem=problem))
    verdicts.save()
    return Pick(None, tuple(corrupt))


def at_step(run: RunDir, step: int) -> Tuple[int, str]:
    """The checkpoint of `step`, every byte read; AgentError when there is none or it is corrupt."""
    folders = checkpoint_folders(run)
    folder = dict(folders).get(step)
    if folder is None:
        raise AgentError("run %r has no complete checkpoint at step %d (it has steps %s)"
                         % (run.run_id, step, ", ".join(str(s) for s, _ in folders)), "not_found")
    verdicts = _Verdicts(run)
    problem = verdicts.problem(folder, remembered=False)
    verdicts.save()
    if problem is not None:
        others = [str(s) for s, _ in folders if s != step]
        raise AgentError("run %r: the checkpoint at step %d is corrupt, not resumed from: %s (%s)"
                         % (run.run_id, step, problem, folder), "conflict",
                         hint="another step (%s), or none: the newest intact checkpoint is taken"
                              % (", ".join(others) or "there is none"))
    return step, folder


def none_intact(run: RunDir, corrupt: Tuple[CorruptCheckpoint, ...]) -> str:
    """Why a run whose every checkpoint is corrupt cannot resume."""
    return "run %r has no intact checkpoint: %s" % (
        run.run_id, "; ".join("step %d: %s" % (c.step, c.problem) for c in corrupt))


class _Verdicts:
    """The verdicts of this call, and those remembered in checkpoints/.verified.json:
    {folder name: {"files": [[path, dev, ino, size, mtime_ns, ctime_ns], ...], "problem"}}."""

    def __init__(self, run: RunDir):
        self.path = os.path.join(run.file(CHECKPOINTS_DIR), VERDICTS)
        try:
            kept = read_json(self.path)
        except (OSError, ValueError):
            kept = None  # unreadable or torn: only costs hashing again
        self.kept = kept if isinstance(kept, dict) else {}  # type: Dict[str, Any]
        self.changed = False

    def problem(self, folder: str, remembered: bool) -> Optional[str]:
        name = os.path.basename(folder)
        files = _identity(folder)
        entry = self.kept.get(name)
        if remembered and isinstance(entry, dict) and entry.get("files") == files:
            return entry.get("problem")
        problem = verify(folder, LOADED_FILES).problem
        if _identity(folder) == files:  # not replaced while it was read
            self.kept[name] = {"files": files, "problem": problem}
            self.changed = True
        return problem

    def save(self) -> None:
        """Write what this call learned, for the folders still there; a full or read-only
        disk only costs hashing again."""
        if not self.changed:
            return
        root = os.path.dirname(self.path)
        kept = {name: entry for name, entry in self.kept.items() if os.path.isdir(os.path.join(root, name))}
        try:
            write_json_atomic(self.path, kept)
        except OSError:
            pass


def _identity(folder: str) -> List[List[Any]]:
    """[path, device, inode, size, mtime_ns, ctime_ns] of every file under `folder`, sorted."""
    found = []
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in names:
            path = os.path.join(top, name)
            try:
                info = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            found.append([os.path.relpath(path, folder), info.st_dev, info.st_ino, info.st_size,
                          info.st_mtime_ns, info.st_ctime_ns])
    return sorted(found)
