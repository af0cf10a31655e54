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


def project_root() -> Path:
    """The checkout holding dflash_cli/, remote/ and configs/ (pip install -e keeps it)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "remote" / "agent.py").is_file():
        raise DflashError(f"cannot find remote/agent.py under {root}: dflash must run from a checkout",
                          ExitCode.USAGE)
    return root


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
