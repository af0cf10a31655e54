"""A memory-mapped store of tokenized samples, cached on the host and built once per key.

Layout of one store (a folder named by the key's hash):

    header.json    {"layout", "key", "num_samples", "num_tokens", "arrays": {name: dtype},
                    "sizes": {file: bytes}, "index_sha256", "built_at"}
    offsets.bin    int64, num_samples + 1: sample i is tokens offsets[i]:offsets[i+1]
    <name>.bin     one flat array per per-token array of a sample (input ids, loss mask, ...)

A store is built in a temp folder beside it and renamed into place (os.replace), so
nobody sees half of one; runs that need the same key take turns on a lock file, so one
builds and the others wait and then open its result. Opening checks the header, every
file's size and the sha256 of offsets.bin: a truncated or damaged store is set aside and
rebuilt, never trusted. Token bytes are not re-hashed on open (gigabytes at the recipe's
scale): a store damaged inside its token files without a change of size goes unnoticed.
"""
from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from dflash_files.atomic import fsync_path

from ..runlog import say

LAYOUT_VERSION = 1  # bump when the files of a store change
HEADER = "header.json"
OFFSETS = "offsets.bin"
_OFFSET_DTYPE = np.dtype("<i8")
_READ_BLOCK = 8 << 20
# A hash memo is trusted only for a file whose last change is older than this when the hash
# started: a change within the filesystem's timestamp granularity of the hashing could
# leave size, mtime and ctime as they were ("racy git").
_RACY_NS = 2_000_000_000


class StoreDamaged(Exception):
    """A store folder that must not be read: why, in words."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path, memo_dir: Path) -> str:
    """sha256 of a file's bytes, remembered in `memo_dir` by the file's identity (device,
    inode, size, mtime, ctime), so a later launch skips reading gigabytes of unchanged data.
    Any write changes the ctime (which no user can set back) and a replacement the inode,
    so a remembered hash is never that of other content."""
    stat = os.stat(path)
    identity = [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    memo = memo_dir / f"{sha256_hex(str(path.resolve()).encode())[:24]}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads(memo.read_text())
        if (record["identity"] == identity
                and record["hashed_at_ns"] - max(stat.st_mtime_ns, stat.st_ctime_ns) > _RACY_NS):
            return record["sha256"]
    hashed_at = time.time_ns()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
    with contextlib.suppress(OSError):  # a memo only saves time: a full disk must not fail the run here
        memo_dir.mkdir(parents=True, exist_ok=True)
        _write_json(memo, {"path": str(path), "identity": identity, "sha256": digest.hexdigest(),
                           "hashed_at_ns": hashed_at})
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class TokenStore:
    """An opened, verified store: per-token arrays memory-mapped (copy-on-write, so torch
    can wrap slices without copying; nothing is ever written back)."""

    folder: Path
    offsets: np.ndarray  # (num_samples + 1,) int64
    arrays: dict[str, np.ndarray]  # name -> (num_tokens,)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, index: int) -> dict[str, np.ndarray]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return {name: values[start:end] for name, values in self.arrays.items()}

    @classmethod
    def open(cls, folder: Path, key: dict) -> "TokenStore":
        """Raises StoreDamaged (with FileNotFoundError as cause for a store not built yet)."""
        try:
            header = json.loads((folder / HEADER).read_text())
            if header.get("layout") != LAYOUT_VERSION or header.get("key") != key:
                raise StoreDamaged(f"{HEADER} is of another layout or key")
            num_samples, num_tokens = int(header["num_samples"]), int(header["num_tokens"])
            dtypes = {name: np.dtype(dtype) for name, dtype in header["arrays"].items()}
            expected = {OFFSETS: (num_samples + 1) * _OFFSET_DTYPE.itemsize}
            expected.update({f"{name}.bin": num_tokens * dtype.itemsize for name, dtype in dtypes.items()})
            if header["sizes"] != expected:
                raise StoreDamaged(f"{HEADER} does not describe its own arrays")
            for name, size in expected.items():
                actual = (folder / name).stat().st_size
                if actual != size:
                    raise StoreDamaged(f"{name} has {actual} bytes, not {size}")
            index = (folder / OFFSETS).read_bytes()
            if sha256_hex(index) != header["index_sha256"]:
                raise StoreDamaged(f"{OFFSETS} does not match its checksum")
        except FileNotFoundError as exc:
            raise StoreDamaged(f"{exc.filename} is missing") from exc
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreDamaged(f"{HEADER} is unreadable ({exc})") from exc
        offsets = np.frombuffer(index, dtype=_OFFSET_DTYPE)
        arrays = {name: np.memmap(folder / f"{name}.bin", dtype=dtype, mode="c", shape=(num_tokens,))
                  for name, dtype in dtypes.items()}
        return cls(folder, offsets, arrays)


class StoreWriter:
    """Appends samples (each a dict of equally long per-token arrays) to a store being built."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._files: dict[str, object] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._offsets = array.array("q", [0])

    @property
    def num_samples(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def append(self, arrays: dict[str, np.ndarray], lengths: np.ndarray) -> None:
        """Samples whose arrays are concatenated: sample j has lengths[j] tokens of each."""
        if not len(lengths):
            return
        if not self._files:
            for name, values in arrays.items():
                if not name.isidentifier():
                    raise ValueError(f"per-token array name {name!r} is no identifier")
                self._dtypes[name] = values.dtype
                self._files[name] = open(self.folder / f"{name}.bin", "wb")
        if set(arrays) != set(self._files):
            raise ValueError(f"samples with arrays {sorted(arrays)} after ones with {sorted(self._files)}")
        total = int(lengths.sum())
        for name, values in arrays.items():
            if values.dtype != self._dtypes[name] or values.shape != (total,):
                raise ValueError(f"array {name!r}: {values.dtype} {values.shape}, expected "
                                 f"{self._dtypes[name]} ({total},)")
            self._files[name].write(values.tobytes())
        self._offsets.extend((np.cumsum(lengths, dtype=np.int64) + self._offsets[-1]).tolist())

    def finish(self, key: dict) -> int:
        """Writes the index and header, flushed to disk. Returns the number of samples."""
        index = np.frombuffer(self._offsets, dtype=np.int64).astype(_OFFSET_DTYPE).tobytes()
        (self.folder / OFFSETS).write_bytes(index)
        for handle in self._files.values():
            handle.close()
        num_samples, num_tokens = self.num_samples, self.num_tokens
        sizes = {OFFSETS: len(index)}
        sizes.update({f"{name}.bin": num_tokens * dtype.itemsize for name, dtype in self._dtypes.items()})
        for name in sizes:
            fsync_path(self.folder / name)
        header = {"layout": LAYOUT_VERSION, "key": key, "num_samples": num_samples, "num_tokens": num_tokens,
                  "arrays": {name: dtype.str for name, dtype in self._dtypes.items()}, "sizes": sizes,
                  "index_sha256": sha256_hex(index), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _write_json(self.folder / HEADER, header)
        fsync_path(self.folder)
        return num_samples

    def close(self) -> None:
        """After a failure (a no-op after finish): the build is discarded, so a write that
        cannot complete now (a full disk) is of no interest."""
        for handle in self._files.values():
            with contextlib.suppress(OSError):
                handle.close()


def open_or_build(root: Path, key: dict, build: Callable[[StoreWriter], None]) -> TokenStore:
    """The store for `key` under `root`: opened if intact, else built by `build` (which
    appends every sample to the writer it is given) and then opened."""
    folder = root / sha256_hex(json.dumps(key, sort_keys=True).encode())[:24]
    with contextlib.suppress(StoreDamaged):
        return _hit(TokenStore.open(folder, key))
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{folder.name}.lock", folder):
        try:
            return _hit(TokenStore.open(folder, key))  # built by the run we waited for
        except StoreDamaged as exc:
            if folder.exists():
                say(f"tokenized data cache {folder} is damaged ({exc}): rebuilding it")
                _discard(folder)
        for stale in root.glob(f".{folder.name}.build-*"):  # left by a builder that was killed
            shutil.rmtree(stale, ignore_errors=True)
        building = Path(tempfile.mkdtemp(prefix=f".{folder.name}.build-", dir=root))
        try:
            building.chmod(0o755)  # shared by every run of the workspace
            writer = StoreWriter(building)
            try:
                build(writer)
                writer.finish(key)
            finally:
                writer.close()
            os.replace(building, folder)
            fsync_path(root)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(exc.errno, f"no space left to cache the tokenized data in {root} "
                                         f"({exc.strerror}); free some, or delete old entries there") from exc
            raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return TokenStore.open(folder, key)


def _hit(store: TokenStore) -> TokenStore:
    say(f"tokenized data cache hit: {store.folder} ({len(store)} samples, {int(store.offsets[-1])} tokens)")
    return store


@contextlib.contextmanager
def _locked(lock_path: Path, folder: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another run is building the tokenized data cache {folder}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the file's close, or with the process


def _discard(folder: Path) -> None:
    """Renamed away first, so the damaged store is gone at once even if removal is slow."""
    aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.damaged-", dir=folder.parent))
    os.replace(folder, aside / folder.name)
    shutil.rmtree(aside, ignore_errors=True)


def _write_json(path: Path, value: dict) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
