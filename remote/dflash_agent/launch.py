"""The `launch` verb: claim the run id and its resources, start a detached supervisor,
return once run.json exists.

Detaching matters over SSH and `pct exec`: the channel closes only when every process
holding its pipes is gone. The supervisor is double-forked into a new session with
stdin from /dev/null, stdout+stderr to runs/ID/agent.log and every other descriptor
closed; only a private report pipe tells this process that run.json was written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import sys
import time
import traceback
from typing import Any, Dict, Optional, Tuple

from . import locks, preflight
from .jsonio import NO_SPACE, AgentError, no_space, read_tail_text, write_atomic
from .layout import RunDir, Workspace
from .preflight import PathRequirement
from .supervisor import TrainerPlan, supervise

REPORT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    run_id: str
    config: str  # a path (relative: to the release root) or "-" for stdin
    name: Optional[str] = None
    resources: Tuple[str, ...] = ()
    force: bool = False
    env: Tuple[Tuple[str, str], ...] = ()
    python: str = sys.executable
    stall_after: float = 300.0
    source: Optional[Dict[str, Any]] = None  # where the release came from; names its release_id
    modules: Tuple[str, ...] = ()  # the trainer's interpreter must find these
    paths: Tuple[PathRequirement, ...] = ()  # the config's host paths that must exist
    overrides: Tuple[str, ...] = ()  # the --set KEY=VALUE the CLI resolved the config with
    restart: Optional[Dict[str, Any]] = None  # the config's restart policy (attempts.py)


def _read_config(request: LaunchRequest, release_root: str) -> bytes:
    if request.config == "-":
        return sys.stdin.buffer.read()
    path = os.path.join(release_root, os.path.expanduser(request.config))
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise AgentError("cannot read config %s: %s" % (path, exc.strerror or exc), "not_found")


def trainer_env(ws: Workspace, run: RunDir, release_id: str, release_root: str,
                 extra: Tuple[Tuple[str, str], ...]) -> Tuple[Tuple[str, str], ...]:
    env = dict(os.environ)
    remote = os.path.join(release_root, "remote")
    env["PYTHONPATH"] = remote + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing is written into a release
        "DFLASH_RUN_ID": run.run_id,
        "DFLASH_RELEASE_ID": release_id,
        "DFLASH_RELEASE_DIR": release_root,
        "DFLASH_WORKSPACE": ws.root,
    })
    env.update(dict(extra))  # the host's and the user's settings win
    return tuple(sorted(env.items()))


def launch(ws: Workspace, request: LaunchRequest) -> Dict[str, Any]:
    for resource in request.resources:
        locks.check_resource(resource)
    if request.stall_after <= 0:
        raise AgentError("--stall-after must be positive", "usage")
    release_id, release_root = ws.current_release()
    if request.source is not None and request.source.get("release_id") != release_id:
        raise AgentError("the current release is %s, not %s whose source was given (another deploy "
                         "ran in between?)" % (release_id, request.source.get("release_id")), "conflict")
    config = _read_config(request, release_root)
    run = ws.run(request.run_id)
    env = trainer_env(ws, run, release_id, release_root, request.env)
    preflight.check(ws.root, release_root, request.python, env, request.modules, request.paths)
    os.makedirs(ws.runs, exist_ok=True)
    try:
        os.mkdir(run.path)  # claims the run id
    except FileExistsError:
        raise AgentError("run %r already exists in %s" % (run.run_id, ws.runs), "conflict")
    try:
        locks.acquire(ws, request.resources, run.run_id, request.force)
    except BaseException:
        os.rmdir(run.path)
        raise
    try:
        write_atomic(run.config, config)
        plan = TrainerPlan(
            workspace=ws, run=run, name=request.name, release_id=release_id,
            release_root=release_root, config_source=request.config, python=request.python,
            env=env,
            env_keys=tuple(key for key, _ in request.env), resources=request.resources,
            stall_after=request.stall_after, source=request.source, overrides=request.overrides,
            restart=request.restart)
        report = start_supervisor(plan)
    except BaseException:
        if not os.path.exists(run.run_json):  # nothing started: the locks are ours to drop
            locks.release(ws, request.resources, run.run_id)
            shutil.rmtree(run.path, ignore_errors=True)  # and the run id: it never became a run
        raise
    return {"run_id": run.run_id, "run_dir": run.path, "pid": report["pid"],
            "pgid": report["pgid"], "release_id": release_id}


def _daemonize(log_path: str, keep_fd: int) -> None:
    """Become a background process holding nothing of the caller's: stdin /dev/null,
    stdout and stderr to `log_path`, every other descriptor but `keep_fd` closed."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep_fd:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor of the listing itself, already closed
    os.chdir("/")


def start_supervisor(plan: TrainerPlan) -> Dict[str, Any]:
    report_r, report_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(report_r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            # Grandchild: not a session leader, so it can never regain a terminal.
            _daemonize(plan.run.agent_log, report_w)
            code = supervise(plan, report_w)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(report_w)
    os.waitpid(child, 0)
    try:
        message = _read_report(report_r)
    finally:
        os.close(report_r)
    if message.get("errno") in NO_SPACE:
        raise no_space(message.get("filename"))
    if not message.get("ok"):
        detail = message.get("error") or "the supervisor exited without reporting"
        raise AgentError("launch of run %r failed: %s\n%s" % (
            plan.run.run_id, detail, read_tail_text(plan.run.agent_log, 40)), "internal")
    return message


def _read_report(fd: int) -> Dict[str, Any]:
    """The supervisor's one JSON line, or {} when it closed the pipe without one."""
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AgentError("the supervisor did not report within %.0f s" % REPORT_TIMEOUT_S, "internal")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data.decode("utf-8")) if data.strip() else {}
    except ValueError:
        return {}
