"""What a release is: the code and configs of remote/ and configs/, content-addressed.

MANIFEST has one line per file, `sha256  size  mode  path`, sorted by path. The release
id is the first 16 hex digits of the MANIFEST's own sha256, so the same tree always
gives the same id and any change of content, path or executable bit gives a new one.

Which files (docs/releases.md "What a release holds"): those of remote/ and configs/ that git
would commit (tracked, or untracked and not ignored: `git ls-files --cached --others
--exclude-standard`) in a git checkout, else those no `.gitignore` of the tree ignores;
then minus what the tree's `.dflashignore` (gitignore syntax) names, and never caches or
dotfiles. A release over LARGE_RELEASE_BYTES is refused unless allowed: data belongs on
the host, not in every release.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from .errors import DflashError, ExitCode
from .project_tree import (BUNDLED_DIR, LARGE_RELEASE_BYTES, PROJECT_MARKERS, RELEASE_DIRS, shipped_tree,
                           source_folder)

if TYPE_CHECKING:
    import pathspec

_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp")
#: Files git tracks that hosts do not need, in gitignore syntax, at the tree's root.
DFLASHIGNORE = ".dflashignore"
_LARGEST_SHOWN = 5
_CHUNK = 1 << 20
#: tar's block and record sizes (tarfile.BLOCKSIZE and RECORDSIZE)
_TAR_BLOCK, _TAR_RECORD = 512, 20 * 512
GIT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class SourceTree:
    """The tree a deploy sends: `checkout` is the project tree the user stands in (or
    named with --source), `bundled` the copy that ships with this dflash."""
    root: Path
    kind: str  # checkout | bundled


def project_root() -> Path:
    """The tree that ships with this dflash: the wheel's copy, or else the checkout
    dflash_cli/ lives in (an editable install, or a run from the checkout)."""
    root = shipped_tree()
    if root is None:
        raise _ships_no_tree()
    return Path(root)


def find_source(explicit: Path | None = None, cwd: Path | None = None) -> SourceTree:
    """What to deploy: `explicit` (--source) if given, else the nearest folder holding
    `cwd` (default: the current directory) that is a project tree, else the bundled copy
    (project_tree.source_folder)."""
    if explicit is not None and not explicit.is_dir():
        raise DflashError(f"--source {explicit}: no such directory", ExitCode.USAGE)
    found = source_folder(None if explicit is None else str(explicit), str(cwd or Path.cwd()))
    if found is None and explicit is not None:
        raise DflashError(f"--source {explicit}: not a dflash project tree (it needs "
                          f"{' and '.join(PROJECT_MARKERS)})", ExitCode.USAGE)
    if found is None:
        raise _ships_no_tree()
    folder, kind = found
    return SourceTree(Path(folder), kind)


def _ships_no_tree() -> DflashError:
    return DflashError(f"this dflash ships no remote/agent.py (looked in {BUNDLED_DIR}): "
                       "reinstall it, or deploy a project tree with --source DIR", ExitCode.USAGE)


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative, with forward slashes
    size: int
    sha256: str
    mode: int  # 0o644 or 0o755


@dataclasses.dataclass(frozen=True)
class Listing:
    """The files a release of `root` holds, listed but not yet read: (path, size, mode)
    each, sorted by path, the sizes as stat gives them. Enough to refuse a release that is
    too large (`check_size`) before any file is hashed or any host contacted."""
    root: Path
    files: tuple[tuple[str, int, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.files)

    def check_size(self, allow_large: bool) -> None:
        """Refuse a release over LARGE_RELEASE_BYTES (unless `allow_large`), naming its
        largest files, before anything is sent."""
        if allow_large or self.total_bytes <= LARGE_RELEASE_BYTES:
            return
        largest = sorted(self.files, key=lambda f: -f[1])[:_LARGEST_SHOWN]
        names = ", ".join(f"{path} ({_mib(size)})" for path, size, _ in largest)
        raise DflashError(
            f"the release of {self.root} holds {_mib(self.total_bytes)} (more than "
            f"{_mib(LARGE_RELEASE_BYTES)}); largest files: {names}; nothing was sent", ExitCode.USAGE,
            hint="data belongs on the host (point the config's paths there); list such files in "
                 f".gitignore or {DFLASHIGNORE}, or pass --allow-large to send them anyway")

    def hashed(self) -> "Release":
        """The release itself: every listed file read and hashed. A file that cannot be
        read (removed since it was listed, say) is an error: nothing is sent then."""
        entries = []
        for path, _, mode in self.files:
            try:
                entries.append(_entry(self.root / path, path, mode))
            except OSError as exc:
                raise DflashError(f"cannot read {path} of {self.root}: {exc.strerror} (changed since it was "
                                  "listed?); nothing was sent", ExitCode.USAGE) from exc
        return Release(self.root, tuple(entries))


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

    def tar_stream(self, paths: set[str], check: Callable[[], None] = lambda: None) -> "TarStream":
        """An uncompressed tar of MANIFEST and the files named in `paths`, read from disk
        as it is sent (memory stays bounded whatever the files' size); its length is
        known before the first byte, as the host's `install` needs."""
        return TarStream(self, [f for f in self.files if f.path in paths], check)


def parse_manifest(text: str) -> tuple[FileEntry, ...]:
    """The files of a MANIFEST's lines `sha256  size  mode  path`."""
    entries = []
    for line in text.splitlines():
        sha256, size, mode, path = line.split("  ", 3)
        entries.append(FileEntry(path, int(size), sha256, int(mode, 8)))
    return tuple(entries)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _padding(size: int) -> int:
    return -size % _TAR_BLOCK


class TarStream(io.RawIOBase):
    """A tar as a readable file: the headers tarfile itself writes, each file's bytes
    read in chunks (and checked against its MANIFEST entry, so a file changed since the
    scan stops the stream short, which the host discards), then the end blocks. `check`
    is called before each chunk and may raise to stop."""

    def __init__(self, tree: Release, files: list[FileEntry], check: Callable[[], None]):
        self._tree, self._check = tree, check
        manifest = tree.manifest_text.encode()
        self._members = [(_header("MANIFEST", len(manifest), 0o444), manifest, None)]
        self._members += [(_header(f.path, f.size, f.mode), None, f) for f in files]
        body = sum(len(header) + size + _padding(size) for header, size in
                   ((h, len(data) if data is not None else f.size) for h, data, f in self._members))
        end = body + 2 * _TAR_BLOCK
        self._end = b"\0" * (end + (-end % _TAR_RECORD) - body)
        self.length = body + len(self._end)
        self._pieces, self._pending = self._generate(), memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            self._check()
            piece = next(self._pieces, None)
            if piece is None:
                return 0
            self._pending = memoryview(piece)
        count = min(len(buffer), len(self._pending))
        buffer[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    def _generate(self) -> Iterator[bytes]:
        for header, data, entry in self._members:
            yield header
            if entry is None:
                yield data
                size = len(data)
            else:
                yield from self._file(entry)
                size = entry.size
            yield b"\0" * _padding(size)
        yield self._end

    def _file(self, entry: FileEntry) -> Iterator[bytes]:
        digest, left = hashlib.sha256(), entry.size
        with open(self._tree.root / entry.path, "rb") as fh:
            while left:
                chunk = fh.read(min(_CHUNK, left))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
                if left == 0 and (fh.read(1) or digest.hexdigest() != entry.sha256):
                    break  # the last bytes are held back: the stream ends short
                yield chunk
        if left or digest.hexdigest() != entry.sha256:
            raise DflashError(f"{entry.path} changed while deploying; run the command again", ExitCode.USAGE)


def _header(path: str, size: int, mode: int) -> bytes:
    import tarfile  # what only an upload needs

    info = tarfile.TarInfo(path)
    info.size, info.mode = size, mode
    return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


def scan(root: Path | None = None) -> Release:
    """The release of the tree at `root` (default: the one shipping with dflash)."""
    return list_files(root).hashed()


def list_files(root: Path | None = None) -> Listing:
    """The files of the release of the tree at `root` (default: the one shipping with
    dflash), not yet read."""
    root = root or project_root()
    chosen = _selected(root)
    files = []
    for top in RELEASE_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(_SKIP_SUFFIXES) or name.startswith("."):
                    continue
                full = Path(dirpath) / name
                path = full.relative_to(root).as_posix()
                if not full.is_file() or not chosen(path):
                    continue
                mode = 0o755 if os.access(full, os.X_OK) else 0o644
                files.append((path, full.stat().st_size, mode))
    files.sort()
    return Listing(root, tuple(files))


def _entry(full: Path, path: str, mode: int) -> FileEntry:
    digest, size = hashlib.sha256(), 0
    with open(full, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileEntry(path, size, digest.hexdigest(), mode)


def _selected(root: Path) -> Callable[[str], bool]:
    """Whether a path (relative to `root`) belongs in the release: what git would commit
    (or, outside git, what no .gitignore ignores), minus what .dflashignore names."""
    committable = _git_committable(root)
    specs: dict[Path, pathspec.GitIgnoreSpec | None] = {}

    def spec_of(path: Path) -> pathspec.GitIgnoreSpec | None:
        if path not in specs:
            specs[path] = _spec(path)
        return specs[path]

    def chosen(path: str) -> bool:
        if committable is not None and path not in committable:
            return False
        if committable is None and _gitignored(root, path, spec_of):
            return False
        dflashignore = spec_of(root / DFLASHIGNORE)
        return not (dflashignore and dflashignore.match_file(path))
    return chosen


def run_git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """`git -C root ARGS`; raises OSError (no git) or subprocess.TimeoutExpired."""
    # GIT_OPTIONAL_LOCKS=0: `status` must not take the index lock of a tree the user works in.
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=GIT_TIMEOUT_S,
                          env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}, stdin=subprocess.DEVNULL)


def _git_committable(root: Path) -> set[str] | None:
    """`git ls-files --cached --others --exclude-standard` under remote/ and configs/,
    relative to `root`; None when `root` is not a git checkout's tree (its launcher not
    tracked: a copy inside an ignored folder of another repository is not its code)."""
    try:
        # -t tags each path: "? " untracked, any other letter tracked; paths are relative to root
        listed = run_git(root, "ls-files", "-z", "-t", "--cached", "--others", "--exclude-standard",
                         "--", *RELEASE_DIRS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return None
    entries = listed.stdout.decode("utf-8", "surrogateescape").split("\0")
    tags = {path: tag for tag, path in (entry.split(" ", 1) for entry in entries if entry)}
    if tags.get(PROJECT_MARKERS[0], "?") == "?":
        return None
    return set(tags)


def _spec(path: Path) -> pathspec.GitIgnoreSpec | None:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None
    import pathspec  # only trees outside git or with a .dflashignore pay for its import

    return pathspec.GitIgnoreSpec.from_lines(lines)


def _gitignored(root: Path, path: str, spec_of: Callable[[Path], pathspec.GitIgnoreSpec | None]) -> bool:
    """Whether the .gitignore files of `root` and of the folders above `path` in it ignore
    `path` (or a folder holding it), the deepest deciding, as git does."""
    parts = path.split("/")
    for depth in range(len(parts) - 1, -1, -1):
        folder = root.joinpath(*parts[:depth])
        spec = spec_of(folder / ".gitignore")
        if spec is None:
            continue
        relative = parts[depth:]
        # A pattern naming a folder ignores everything below it.
        for end in range(1, len(relative) + 1):
            candidate = "/".join(relative[:end]) + ("" if end == len(relative) else "/")
            decided = spec.check_file(candidate).include
            if decided is not None:
                return decided
    return False
