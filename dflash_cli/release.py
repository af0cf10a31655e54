"""What a release is: the files of remote/ and configs/, content-addressed.

MANIFEST has one line per file, `sha256  size  mode  path`, sorted by path. The release
id is the first 16 hex digits of the MANIFEST's own sha256, so the same tree always
gives the same id and any change of content, path or executable bit gives a new one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import Callable

from .errors import DflashError, ExitCode

RELEASE_DIRS = ("remote", "configs")
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp")


#: What makes a folder a project tree dflash can deploy: the agent's launcher and its
#: package. configs/ goes along when it is there; a patched tree may hold nothing else.
PROJECT_MARKERS = ("remote/agent.py", "remote/dflash_agent/__init__.py")
#: Where an installed wheel keeps its copy of remote/ and configs/ (setup.py puts it there).
BUNDLED_DIR = Path(__file__).resolve().parent / "_release"


@dataclasses.dataclass(frozen=True)
class SourceTree:
    """The tree a deploy sends: `checkout` is the project tree the user stands in (or
    named with --source), `bundled` the copy that ships with this dflash."""
    root: Path
    kind: str  # checkout | bundled


def is_project_tree(folder: Path) -> bool:
    return all((folder / marker).is_file() for marker in PROJECT_MARKERS)


def project_root() -> Path:
    """The tree that ships with this dflash: the wheel's copy, or else the checkout
    dflash_cli/ lives in (an editable install, or a run from the checkout)."""
    for root in (BUNDLED_DIR, Path(__file__).resolve().parent.parent):
        if is_project_tree(root):
            return root
    raise DflashError(f"this dflash ships no remote/agent.py (looked in {BUNDLED_DIR}): "
                      "reinstall it, or deploy a project tree with --source DIR", ExitCode.USAGE)


def find_source(explicit: Path | None = None, cwd: Path | None = None) -> SourceTree:
    """What to deploy: `explicit` (--source) if given, else the nearest folder holding
    `cwd` (default: the current directory) that is a project tree, else the bundled copy."""
    if explicit is not None:
        if not explicit.is_dir():
            raise DflashError(f"--source {explicit}: no such directory", ExitCode.USAGE)
        if not is_project_tree(explicit):
            raise DflashError(f"--source {explicit}: not a dflash project tree (it needs "
                              f"{' and '.join(PROJECT_MARKERS)})", ExitCode.USAGE)
        return SourceTree(explicit.resolve(), "checkout")
    here = (cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if is_project_tree(folder):
            return SourceTree(folder, "checkout")
    return SourceTree(project_root(), "bundled")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative, with forward slashes
    size: int
    sha256: str
    mode: int  # 0o644 or 0o755


@dataclasses.dataclass(frozen=True)
class Release:
    root: Path
    files: tuple[FileEntry, ...]

    @property
    def manifest_text(self) -> str:
        return "".join(f"{f.sha256}  {f.size}  {f.mode:o}  {f.path}\n" for f in self.files)

    @property
    def release_id(self) -> str:
        return hashlib.sha256(self.manifest_text.encode()).hexdigest()[:16]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def tar_of(self, paths: set[str], check: Callable[[], None] = lambda: None) -> bytes:
        """A gzipped tar holding MANIFEST and the files named in `paths`. `check` is
        called between blocks and may raise to stop: compressing a big file takes a while."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT, compresslevel=6) as tar:
            manifest = self.manifest_text.encode()
            info = tarfile.TarInfo("MANIFEST")
            info.size, info.mode = len(manifest), 0o444
            tar.addfile(info, io.BytesIO(manifest))
            for entry in self.files:
                if entry.path in paths:
                    data = (self.root / entry.path).read_bytes()
                    if hashlib.sha256(data).hexdigest() != entry.sha256:
                        raise DflashError(f"{entry.path} changed while deploying; run the command again",
                                          ExitCode.USAGE)
                    info = tarfile.TarInfo(entry.path)
                    info.size, info.mode = entry.size, entry.mode
                    tar.addfile(info, _Checked(io.BytesIO(data), check))
        return buf.getvalue()


class _Checked(io.RawIOBase):
    """A readable file that calls `check` before each read."""

    def __init__(self, source: io.BytesIO, check: Callable[[], None]):
        self._source, self._check = source, check

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._check()
        return self._source.readinto(buffer)


def scan(root: Path | None = None) -> Release:
    root = root or project_root()
    entries = []
    for top in RELEASE_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(_SKIP_SUFFIXES) or name.startswith("."):
                    continue
                full = Path(dirpath) / name
                if not full.is_file():
                    continue
                data = full.read_bytes()
                mode = 0o755 if os.access(full, os.X_OK) else 0o644
                entries.append(FileEntry(full.relative_to(root).as_posix(), len(data),
                                         hashlib.sha256(data).hexdigest(), mode))
    entries.sort(key=lambda e: e.path)
    return Release(root, tuple(entries))
