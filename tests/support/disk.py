"""Small real filesystems for disk-full tests: a tmpfs mounted over a test's folder
(the tests run as root, as CI does), filled up for real."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def tmpfs(path: Path, size_mib: int, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size_mib` MiB (and at most `inodes` files and folders) mounted at
    `path`, which is created; unmounted when the block ends."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mib}m" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "dflash-test", str(path)], check=True)
    try:
        yield path
    finally:
        # Lazy: a process of the test that still has a file open there must not keep
        # the mount (or fail the teardown); the memory goes once the last one lets go.
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def free_mib(path: Path) -> float:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize / (1 << 20)


def fill(folder: Path, leave_mib: float = 0.0) -> Path:
    """Write one file in `folder` until the filesystem has less than `leave_mib` + 1 MiB
    free, or, with leave_mib 0, until the kernel says ENOSPC. Returns the file."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as handle:  # unbuffered: nothing left to flush at close
        try:
            while free_mib(folder) >= leave_mib + 1:
                handle.write(b"\0" * (1 << 20))
            while not leave_mib:
                handle.write(b"\0" * 4096)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


def use_up_inodes(folder: Path) -> int:
    """Create empty files in `folder` until no inode is left. Returns how many."""
    count = 0
    while True:
        try:
            (folder / f"inode-{count}").touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return count
        count += 1
