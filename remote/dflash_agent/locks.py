"""Resource locks: <workspace>/locks/<resource>.json holds the run id using it.

Two launches for the same GPUs must not both win, so every look-then-take happens
under an exclusive flock on locks/.guard; the lock files themselves are written
atomically. A lock whose run is terminal or LOST is stale and is replaced.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from typing import Any, Dict, Iterator, Optional, Sequence

from . import procfs
from .jsonio import AgentError, read_json, write_json_atomic
from .layout import Workspace
from .state import LOST, STARTING, TERMINAL, derive_state, observe, read_record

_RESOURCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_resource(name: str) -> None:
    if not _RESOURCE.match(name) or len(name) > 100:
        raise AgentError("invalid resource name %r (expected e.g. gpu0 or cpu)" % name, "usage")


@contextlib.contextmanager
def _guard(ws: Workspace) -> Iterator[None]:
    os.makedirs(ws.locks, exist_ok=True)
    fd = os.open(os.path.join(ws.locks, ".guard"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def _path(ws: Workspace, resource: str) -> str:
    return os.path.join(ws.locks, resource + ".json")


def _read_holder(path: str) -> Optional[Dict[str, Any]]:
    try:
        holder = read_json(path)
    except ValueError:
        return {}  # not JSON (torn, or written by hand): held by nobody
    return holder if holder is None or isinstance(holder, dict) else {}


def holder_state(ws: Workspace, holder: Dict[str, Any]) -> str:
    """The state of the run holding a lock; a run still being launched (no run.json yet)
    is STARTING while the launching process lives."""
    try:
        run = ws.run(str(holder.get("run_id") or ""))
        record = read_record(run)
    except AgentError:
        return LOST
    except FileNotFoundError:
        same_boot = holder.get("boot_id") == procfs.boot_id()
        launching = procfs.identity_alive(holder.get("launcher_pid"), holder.get("launcher_start_time"))
        return STARTING if same_boot and launching else LOST
    return derive_state(observe(run, record))


def acquire(ws: Workspace, resources: Sequence[str], run_id: str, force: bool) -> None:
    """Take every lock or none. Raises AgentError(kind="conflict") naming the holder."""
    record = {"run_id": run_id, "taken_at": time.time(), "launcher_pid": os.getpid(),
              "launcher_start_time": procfs.start_time(os.getpid()), "boot_id": procfs.boot_id()}
    with _guard(ws):
        for resource in resources:
            holder = _read_holder(_path(ws, resource))
            if not holder or force:
                continue
            state = holder_state(ws, holder)
            if state not in TERMINAL:
                raise AgentError(
                    "%s is in use by run %r (%s); stop it first or pass --force"
                    % (resource, holder.get("run_id"), state),
                    "conflict", holder=holder.get("run_id"), resource=resource)
        for resource in resources:
            write_json_atomic(_path(ws, resource), dict(record, resource=resource))


def release(ws: Workspace, resources: Sequence[str], run_id: str) -> None:
    """Drop the locks that still name this run (a --force launch may have taken one)."""
    with _guard(ws):
        for resource in resources:
            path = _path(ws, resource)
            holder = _read_holder(path)
            if holder is not None and holder.get("run_id") == run_id:
                os.unlink(path)
