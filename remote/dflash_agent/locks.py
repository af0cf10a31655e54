"""Resource locks: <workspace>/locks/<resource>.json lists the runs using a resource.

A lock file is {"resource": R, "holders": [holder, ...]}; a holder is {"run_id",
"taken_at", "launcher_pid", "launcher_start_time", "boot_id"}. A launch is refused while
any holder lives; `--force` adds one more holder next to the live ones instead of
replacing them, so a later launch without `--force` still sees every run on the
resource. Holders whose run ended (terminal or LOST: its processes are gone, by pid and
start time) are reaped whenever the file is rewritten. A file in the older one-holder
form (the holder object itself) is read as a list of one.

Two launches for the same GPUs must not both win, and two `--force` launches must not
drop each other's holder, so every read-modify-write happens under an exclusive flock on
locks/.guard; the lock files themselves are written atomically.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from dflash_contract.states import RunState
from dflash_files import procfs
from dflash_files.atomic import write_json_atomic

from .jsonio import AgentError, read_json
from .layout import Workspace
from .state import UnreadableRecord, derive_state, observe, read_record

_RESOURCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_resource(name: str) -> None:
    if not _RESOURCE.match(name) or len(name) > 100:
        raise AgentError("invalid resource name %r (expected e.g. gpu0 or cpu)" % name, "usage")


@contextlib.contextmanager
def exclusive(path: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the body."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def is_held(path: str) -> bool:
    """Whether some process holds a flock on `path` now (a missing file: no)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def _guard(ws: Workspace) -> Iterator[None]:
    os.makedirs(ws.locks, exist_ok=True)
    with exclusive(os.path.join(ws.locks, ".guard")):
        yield


def _path(ws: Workspace, resource: str) -> str:
    return os.path.join(ws.locks, resource + ".json")


def read_holders(path: str) -> List[Dict[str, Any]]:
    """The holders a lock file lists; [] when there is no file or it is not a lock
    (torn, or written by hand: held by nobody)."""
    try:
        lock = read_json(path)
    except ValueError:
        return []
    if not isinstance(lock, dict):
        return []
    if "holders" not in lock:  # the one-holder form of older releases
        return [lock] if lock.get("run_id") else []
    holders = lock["holders"]
    return [h for h in holders if isinstance(h, dict)] if isinstance(holders, list) else []


def _write_holders(ws: Workspace, resource: str, holders: List[Dict[str, Any]]) -> None:
    path = _path(ws, resource)
    if holders:
        write_json_atomic(path, {"resource": resource, "holders": holders})
    elif os.path.exists(path):
        os.unlink(path)


def holder_state(ws: Workspace, holder: Dict[str, Any]) -> RunState:
    """The state of the run holding a lock; a run still being launched (no run.json yet)
    is STARTING while the launching process lives."""
    try:
        run = ws.run(str(holder.get("run_id") or ""))
        record = read_record(run)
    except UnreadableRecord:
        raise  # whether that run still holds the resource cannot be told: named, not guessed
    except AgentError:
        return RunState.LOST
    except FileNotFoundError:
        same_boot = holder.get("boot_id") == procfs.boot_id()
        launching = procfs.identity_alive(holder.get("launcher_pid"), holder.get("launcher_start_time"))
        return RunState.STARTING if same_boot and launching else RunState.LOST
    return derive_state(observe(run, record))


def _live_holders(ws: Workspace, resource: str) -> List[Tuple[Dict[str, Any], RunState]]:
    """(holder, state) of every holder whose run has not ended."""
    live = []
    for holder in read_holders(_path(ws, resource)):
        state = holder_state(ws, holder)
        if not state.terminal:
            live.append((holder, state))
    return live


def acquire(ws: Workspace, resources: Sequence[str], run_id: str, force: bool) -> None:
    """Take every lock or none. Without `force`, raises AgentError(kind="conflict")
    naming every live holder of the first resource in use."""
    record = {"run_id": run_id, "taken_at": time.time(), "launcher_pid": os.getpid(),
              "launcher_start_time": procfs.start_time(os.getpid()), "boot_id": procfs.boot_id()}
    with _guard(ws):
        live = {resource: _live_holders(ws, resource) for resource in resources}
        if not force:
            _refuse_if_in_use(live)
        for resource in resources:
            holders = [h for h, _ in live[resource] if h.get("run_id") != run_id]
            _write_holders(ws, resource, holders + [record])


def check_free(ws: Workspace, resources: Sequence[str], force: bool) -> None:
    """What `acquire` would refuse, without taking anything: a launch on several hosts
    checks every host before it starts any."""
    if force:
        return
    with _guard(ws):
        _refuse_if_in_use({resource: _live_holders(ws, resource) for resource in resources})


def _refuse_if_in_use(live: Dict[str, List[Tuple[Dict[str, Any], RunState]]]) -> None:
    """AgentError(kind="conflict") naming every live holder of the first resource in use."""
    for resource, holders in live.items():
        if holders:
            names = ", ".join("%r (%s)" % (h.get("run_id"), state) for h, state in holders)
            raise AgentError(
                "%s is in use by run%s %s; stop %s first or pass --force"
                % (resource, "s" if len(holders) > 1 else "", names, "them" if len(holders) > 1 else "it"),
                "conflict", resource=resource, holders=[h.get("run_id") for h, _ in holders])


def release(ws: Workspace, resources: Sequence[str], run_id: str) -> None:
    """Drop this run from its locks; the other holders (a --force launch's) stay."""
    with _guard(ws):
        for resource in resources:
            holders = read_holders(_path(ws, resource))
            remaining = [h for h in holders if h.get("run_id") != run_id]
            if len(remaining) != len(holders):
                _write_holders(ws, resource, remaining)
