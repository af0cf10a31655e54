"""A full disk, said so that a person can act on it, and room kept back to say it.

A run's failure path writes files (errors.jsonl, exit.json) on the disk that may be full
to its last byte. Each writer keeps a reserve there, a file of real bytes made when it
starts, and gives it back to the filesystem just before the one write that must not fail
for want of space (docs/layout.md: the `*.reserve` files).
"""
from __future__ import annotations

import errno
import os
import re
from typing import Any, Dict, Optional

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, no inodes left, or a quota reached
# Several records or an exit.json each; a record is bounded well below it (dflash_train/runlog.py).
RESERVE_BYTES = 256 * 1024


# How a Rust writer's error quotes the OS error it met (std::io::Error's Display), as
# safetensors' SafetensorError does: "I/O error: No space left on device (os error 28)".
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is an OSError for
    want of space, or quotes one as a Rust writer does."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in NO_SPACE:
            return True
        if any(int(code) in NO_SPACE for code in RUST_OS_ERROR.findall(str(current))):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _existing(path: str) -> str:
    """`path`, or its nearest folder that exists (the file may be gone, or never made)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on the filesystem of `path`."""
    stat = os.statvfs(_existing(path))
    return stat.f_bavail * stat.f_frsize


def mount_point(path: str) -> str:
    """The folder the filesystem of `path` is mounted at: the highest one on its device."""
    path = _existing(path)
    device = os.stat(path).st_dev
    while True:
        parent = os.path.dirname(path)
        if parent == path or os.stat(parent).st_dev != device:
            return path
        path = parent


class DiskFull(OSError):
    """A write that failed for want of space, naming what it wrote and what is free.
    str() is the message alone; errno is ENOSPC, so code that tells a full disk by its
    errno tells this one too; `detail` goes into the errors.jsonl record."""

    def __init__(self, path: str, needed: Optional[int] = None, free: Optional[int] = None):
        """`free`: the bytes free when the write began, when that says more than now."""
        free, mount = free_bytes(path) if free is None else free, mount_point(path)
        need = "" if needed is None else "; it needs at least %d bytes" % needed
        super().__init__("no space left on device writing %s (%d bytes free on %s%s)" % (path, free, mount, need))
        self.errno = errno.ENOSPC  # not filename too: OSError's str() would then be "[Errno 28] None: path"
        self.detail: Dict[str, Any] = {"path": path, "free_bytes": free, "mount": mount, "needed_bytes": needed}


class Reserve:
    """RESERVE_BYTES held in the file `path` for the write that says why a run ended."""

    def __init__(self, path: str):
        self.path = path

    def make(self) -> bool:
        """Write the reserve (again: a previous process's is replaced); False when the
        disk has no room for it already. Random bytes, as a compressing filesystem (ZFS,
        btrfs) would store zeros in no blocks at all."""
        try:
            with open(self.path, "wb") as handle:
                handle.write(os.urandom(RESERVE_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            return True
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            self.release()
            return False

    def release(self) -> bool:
        """Give the reserve's blocks back; False when there was none to give."""
        try:
            os.unlink(self.path)
            return True
        except FileNotFoundError:
            return False
