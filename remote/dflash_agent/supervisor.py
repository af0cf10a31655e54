"""The supervisor: starts the trainer, records run.json before it runs and exit.json
after it ends, then releases the run's locks.

It runs detached (launch.py daemonizes it): stdin /dev/null, stdout+stderr appended to
runs/ID/agent.log, no descriptor of the caller left open.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
from typing import Any, Dict, Optional, Tuple

from . import locks, oom, procfs
from .jsonio import encode_line, write_json_atomic
from .layout import RunDir, Workspace


@dataclasses.dataclass(frozen=True)
class TrainerPlan:
    """Everything needed to start one trainer process."""
    workspace: Workspace
    run: RunDir
    name: Optional[str]
    release_id: str
    release_root: str
    config_source: str
    python: str
    env: Tuple[Tuple[str, str], ...]  # the trainer's whole environment
    env_keys: Tuple[str, ...]  # the --env keys (values may be secrets: not recorded)
    resources: Tuple[str, ...]
    stall_after: float
    source: Optional[Dict[str, Any]] = None  # where the release came from, as the CLI saw it
    distributed: Optional[Dict[str, Any]] = None  # this host's place in a run on several hosts

    @property
    def argv(self) -> Tuple[str, ...]:
        return (self.python, "-m", "dflash_train", "--config", self.run.config,
                "--run-dir", self.run.path)


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    sys.stderr.write("%s supervisor[%d]: %s\n" % (stamp, os.getpid(), message))
    sys.stderr.flush()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "SIG%d" % signum


def _send(fd: int, message: Dict[str, Any]) -> None:
    os.write(fd, encode_line(message))


def _exec_trainer(plan: TrainerPlan, pipes: Dict[str, int], train_log_fd: int) -> None:
    """In the forked child: new session, wait for the go byte, exec. Never returns."""
    reason = "unknown"
    try:
        os.setsid()  # its own process group (pgid == pid), so stop reaches all it spawns
        for key in ("report", "go_w", "sync_r", "exec_r"):
            os.close(pipes[key])
        os.write(pipes["sync_w"], b"s")
        os.close(pipes["sync_w"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(train_log_fd, 1)
        os.dup2(train_log_fd, 2)
        os.close(devnull)
        os.close(train_log_fd)
        os.chdir(plan.run.path)
        # Python ignores these; an exec'd program must start with the defaults (as
        # subprocess's restore_signals does).
        for name in ("SIGPIPE", "SIGXFSZ"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        if os.read(pipes["go_r"], 1) != b"g":
            os._exit(125)  # the supervisor gave up before run.json existed: never start
        os.execvpe(plan.python, list(plan.argv), dict(plan.env))
    except BaseException as exc:  # exec failed: say why in train.log and to the supervisor
        reason = "cannot start the trainer: %s: %s" % (type(exc).__name__, exc)
    try:
        os.write(2, ("dflash-agent: %s (argv: %r)\n" % (reason, list(plan.argv))).encode("utf-8", "replace"))
        os.write(pipes["exec_w"], reason.encode("utf-8", "replace"))
    finally:
        os._exit(127)


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def supervise(plan: TrainerPlan, report_fd: int) -> int:
    """Start the trainer and wait for it. Reports {"ok": ...} on `report_fd` once
    run.json exists (or why it could not start) and closes it."""
    run = plan.run
    oom_before = oom.oom_kill_count()
    pipes = {"report": report_fd}
    pipes["go_r"], pipes["go_w"] = os.pipe()
    pipes["sync_r"], pipes["sync_w"] = os.pipe()
    pipes["exec_r"], pipes["exec_w"] = os.pipe()  # close-on-exec: EOF without data = exec worked
    train_log_fd = os.open(run.train_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid == 0:
        _exec_trainer(plan, pipes, train_log_fd)
    for key in ("go_r", "sync_w", "exec_w"):
        os.close(pipes[key])
    os.close(train_log_fd)
    # Wait until the child is in its own session: from then on pgid == pid holds.
    in_session = os.read(pipes["sync_r"], 1) == b"s"
    os.close(pipes["sync_r"])
    try:
        if not in_session:
            raise RuntimeError("the trainer process died before starting")
        start_ticks = procfs.start_time(pid)
        record = {
            "run_id": run.run_id, "name": plan.name, "release_id": plan.release_id,
            "release_dir": plan.release_root, "workspace": plan.workspace.root,
            "config": _read_text(run.config), "config_source": plan.config_source,
            "argv": list(plan.argv), "cwd": run.path, "env_keys": list(plan.env_keys),
            "pid": pid, "pgid": pid, "start_time": start_ticks, "boot_id": procfs.boot_id(),
            "host": socket.gethostname(), "started_at": time.time(),
            "stall_after": plan.stall_after, "resources": list(plan.resources),
            "supervisor": {"pid": os.getpid(), "start_time": procfs.start_time(os.getpid())},
            "source": plan.source, "distributed": plan.distributed,
        }
        write_json_atomic(run.run_json, record)
    except BaseException as exc:
        os.close(pipes["go_w"])  # the child reads EOF and exits without exec
        os.waitpid(pid, 0)
        _send(report_fd, {"ok": False, "error": "%s: %s" % (type(exc).__name__, exc),
                          "errno": getattr(exc, "errno", None), "filename": getattr(exc, "filename", None)})
        os.close(report_fd)
        raise
    os.write(pipes["go_w"], b"g")
    os.close(pipes["go_w"])
    log("trainer pid %d started: %r" % (pid, list(plan.argv)))
    _send(report_fd, {"ok": True, "pid": pid, "pgid": pid})
    os.close(report_fd)

    exec_error = _read_all(pipes["exec_r"]).decode("utf-8", "replace") or None
    os.close(pipes["exec_r"])
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        exit_code, sig = None, signal_name(os.WTERMSIG(status))
    else:
        exit_code, sig = os.WEXITSTATUS(status), None
    exit_record = {
        "exit_code": exit_code, "signal": sig,
        "oom_killed": oom.was_oom_killed(oom_before, oom.oom_kill_count(), sig, pid, start_ticks),
        "ended_at": time.time(), "exec_error": exec_error,
    }
    write_json_atomic(run.exit_json, exit_record)
    log("trainer ended: %r" % exit_record)
    locks.release(plan.workspace, plan.resources, run.run_id)
    return 0


def _read_text(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", "surrogateescape")
