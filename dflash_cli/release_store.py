"""Releases as the runs used them, read back from the hosts: what `diff`, `runs` and
`launch` compare.

A release is content-addressed, so what was fetched once never changes: the cache under
<logs>/releases/ holds MANIFESTs by release id (manifests/<id>) and file contents by
sha256 (objects/<sha256>), each checked against its name before it is kept. Comparing two
releases compares their MANIFESTs first, and only the files whose hashes differ are
fetched, once, whichever run or host they came from.
"""
from __future__ import annotations

import base64
import dataclasses
import difflib
import hashlib
import re
from pathlib import Path


from dflash_contract import requests
from dflash_contract.replies import RunStatus

from .errors import DflashError, ExitCode
from .local_state import RELEASES_DIR, write_atomic
from .release import FileEntry, Release, parse_manifest
from .session import Session

#: Bytes tested for a NUL to call a file binary, as git does.
_BINARY_PROBE = 8000
_RELEASE_ID = re.compile(r"[0-9a-f]{16}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class FileChange:
    path: str
    old: FileEntry | None  # None: added
    new: FileEntry | None  # None: removed


@dataclasses.dataclass(frozen=True)
class FileDiff:
    change: FileChange
    text: str  # the unified diff, or a line saying binary or too large files differ
    added: int
    removed: int
    compared: bool = True  # False: binary or too large, no line counts


class ReleaseStore:
    def __init__(self, session: Session):
        self.session = session
        self.root = session.logs_dir / RELEASES_DIR
        self._local: Release | None = None

    def _object(self, sha256: str) -> Path:
        return self.root / "objects" / sha256

    def manifest(self, host: str, release_id: str) -> tuple[FileEntry, ...]:
        """The release's files, from the cache or the host. The id and each file's sha256
        name files of the cache: a host's that is not hex digits is refused before any
        path is made of it."""
        if not _RELEASE_ID.fullmatch(release_id):
            raise DflashError(f"host {host}: refusing the release id {release_id!r}: not 16 hex digits",
                              ExitCode.UNREACHABLE)
        cached = self.root / "manifests" / release_id
        if not cached.is_file():
            text = self.session.agent(host).call(requests.ReleaseFiles(release_id)).manifest
            if hashlib.sha256(text.encode()).hexdigest()[:16] != release_id:
                raise DflashError(f"host {host}: the MANIFEST of release {release_id} does not hash to its id",
                                  ExitCode.UNREACHABLE)
            self._write(cached, text.encode())
        try:
            entries = parse_manifest(cached.read_text())
        except ValueError as exc:
            raise DflashError(f"host {host}: the MANIFEST of release {release_id} ({cached}) cannot be read: {exc}",
                              ExitCode.UNREACHABLE) from exc
        for entry in entries:
            if not _SHA256.fullmatch(entry.sha256):
                raise DflashError(f"host {host}: the MANIFEST of release {release_id} ({cached}) gives {entry.path} "
                                  f"the sha256 {entry.sha256!r}, which is not 64 hex digits", ExitCode.UNREACHABLE)
        return entries

    def add_local(self, tree: Release) -> None:
        """The release a deploy just sent, from its own tree: nothing to fetch for it."""
        self._write(self.root / "manifests" / tree.release_id, tree.manifest_text.encode())
        self._local = tree

    def contents(self, host: str, release_id: str, entries: list[FileEntry]) -> dict[str, bytes | None]:
        """{path: bytes} of `entries` of the release (None: too large to fetch inline)."""
        missing = [e for e in entries if not self._object(e.sha256).is_file()]
        if self._local is not None and self._local.release_id == release_id:
            for entry in missing:
                self._keep(entry, (self._local.root / entry.path).read_bytes())
            missing = []
        too_large: set[str] = set()
        if missing:
            reply = self.session.agent(host).call(requests.ReleaseFiles(release_id,
                                                                                tuple(e.path for e in missing)))
            too_large = set(reply.too_large)
            for entry in missing:
                if entry.path in reply.files:
                    self._keep(entry, base64.b64decode(reply.files[entry.path]), host)
        return {e.path: None if e.path in too_large else self._object(e.sha256).read_bytes() for e in entries}

    def _keep(self, entry: FileEntry, data: bytes, host: str | None = None) -> None:
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            where = f"host {host}" if host else "the local tree"
            raise DflashError(f"{where}: {entry.path} does not match its MANIFEST entry", ExitCode.UNREACHABLE)
        self._write(self._object(entry.sha256), data)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        try:
            write_atomic(path, data)
        except OSError as exc:  # a full disk, a read-only logs folder: nothing half-written stays
            raise DflashError(f"cannot keep a release file in {path.parent}: {exc.strerror or exc}",
                              ExitCode.USAGE) from exc

    def diff(self, old: tuple[str, str], new: tuple[str, str], paths: tuple[str, ...] = ()) -> list[FileDiff]:
        """File by file, what changed from release `old` to release `new`, each given as
        (host, release id); only under `paths` when some are given."""
        old_files = {e.path: e for e in self.manifest(*old)}
        new_files = {e.path: e for e in self.manifest(*new)}
        changes = [FileChange(path, old_files.get(path), new_files.get(path))
                   for path in sorted(old_files.keys() | new_files.keys())
                   if _under(path, paths) and old_files.get(path) != new_files.get(path)]
        old_data = self.contents(*old, [c.old for c in changes if c.old is not None])
        new_data = self.contents(*new, [c.new for c in changes if c.new is not None])
        return [file_diff(c, old_data.get(c.path, b"") if c.old else b"",
                          new_data.get(c.path, b"") if c.new else b"") for c in changes]


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return not prefixes or any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _text(data: bytes | None) -> list[str] | None:
    """The lines of `data`, or None for a binary (or not fetched) file."""
    if data is None or b"\0" in data[:_BINARY_PROBE]:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def file_diff(change: FileChange, old: bytes | None, new: bytes | None, labels: tuple[str, str] | None = None) -> FileDiff:
    """A unified diff of one file, as `git diff` labels it (a/PATH, b/PATH, /dev/null)."""
    old_label = labels[0] if labels else (f"a/{change.path}" if change.old else "/dev/null")
    new_label = labels[1] if labels else (f"b/{change.path}" if change.new else "/dev/null")
    old_lines, new_lines = _text(old), _text(new)
    if old_lines is None or new_lines is None:
        why = "too large to compare here" if None in (old, new) else "binary"
        return FileDiff(change, f"Files {old_label} and {new_label} differ ({why})\n", 0, 0, compared=False)
    lines = list(difflib.unified_diff(old_lines, new_lines, old_label, new_label))
    lines = [line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines]
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    return FileDiff(change, "".join(lines), added, removed)


def summary(diffs: list[FileDiff]) -> str:
    """`2 files (+14 −3)`."""
    return (f"{len(diffs)} file{'s' if len(diffs) != 1 else ''} "
            f"(+{sum(d.added for d in diffs)} \u2212{sum(d.removed for d in diffs)})")


def change_since(store: ReleaseStore, host: str, previous: RunStatus, release_id: str) -> dict:
    """What release `release_id` changed from the one run `previous` used (it names one),
    both on `host`: {"since", "same_release", "files", "added", "removed", "text"}; "text"
    reads `same release as RUN` or `changed since RUN: 2 files (+14 −3)`."""
    since = previous.run_id
    if previous.release_id == release_id:
        return {"since": since, "same_release": True, "files": 0, "added": 0, "removed": 0,
                "text": f"same release as {since}"}
    try:
        diffs = store.diff((host, previous.release_id), (host, release_id))
    except DflashError as exc:
        return {"since": since, "same_release": False, "text": f"changed since {since}: unknown ({exc.message})"}
    return {"since": since, "same_release": False, "files": len(diffs), "added": sum(d.added for d in diffs),
            "removed": sum(d.removed for d in diffs), "text": f"changed since {since}: {summary(diffs)}"}
