"""Files others read, written so that a reader sees the old file or the whole new one."""
from __future__ import annotations

import itertools
import json
import os
from typing import Any

_TMP_COUNTER = itertools.count()


def write_atomic(path: str, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a part (temp file in the same
    folder, fsync, os.replace)."""
    folder, name = os.path.split(path)
    # Unique per process and call; tempfile would cost the agent's short-lived process more to import.
    tmp = os.path.join(folder, ".%s.%d.%d.tmp" % (name, os.getpid(), next(_TMP_COUNTER)))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            exc.filename = path  # the file meant, not the temp file (a failed write() names none)
        raise


def write_json_atomic(path: str, obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def fsync_path(path: "str | os.PathLike[str]") -> None:
    """Make what is at `path` durable: a file's bytes, or a folder's entries (after a
    rename or a create in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
