"""The warm interpreter, as the supervisor uses it (docs/runs.md "Warm interpreter").

One per release and interpreter (python's real path), in <workspace>/warm/<key>/ (lock,
pid.json, sock, warm.log: docs/layout.md), running dflash_train.warm: a process of the
trainer's interpreter that has done the trainer's imports and forks a run's trainer on
request. The supervisor asks it first (fork_trainer); whatever keeps it from giving a
trainer (none yet, dead, still importing, hung, refused, killed mid-fork) is a WarmFailed
whose reason the supervisor records (run.json `started_by`, `warm_reason`; agent.log)
before it execs the trainer as without one; the run never fails because of it. After a
trainer started without it, the supervisor starts one for the next launch (`start`).

At most one per folder: it holds an flock on `lock` for its whole life, taken before its
imports, and a start happens under an flock on `start.lock` and only when `lock` is free.
It ends after DFLASH_WARM_IDLE_S seconds without a request (the run's environment: the
host's or --env; default DEFAULT_IDLE_S; 0: no warm interpreter), when torch's files
change under it, when its release is removed, or when a warm interpreter of another
release of the same interpreter starts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import signal
import socket
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from dflash_contract.names import RUN_TIME_ENV
from dflash_files import procfs

from . import locks, oom
from .jsonio import AgentError, encode_line

IDLE_ENV = "DFLASH_WARM_IDLE_S"
DEFAULT_IDLE_S = 900.0
REPLY_TIMEOUT_S = 10.0  # for each answer before the trainer runs: longer is a hung one
READY_TIMEOUT_S = 10.0  # for a new one to hold its lock (before its imports)
STATUS_POLL_S = 1.0  # how often a trainer whose waiter died is looked for in /proc


class WarmFailed(Exception):
    """No trainer from the warm interpreter; str(): why, as recorded."""

    def __init__(self, reason: str, hung: bool = False, replace: bool = False, ends: bool = False):
        super().__init__(reason)
        self.hung = hung  # it must be killed before another can start
        self.replace = replace  # it lives but cannot serve this release's runs: end it
        self.ends = ends  # it is ending by itself (torch changed under it, ...)


@dataclasses.dataclass(frozen=True)
class Place:
    dir: str

    def file(self, name: str) -> str:
        return os.path.join(self.dir, name)


def place(warm_root: str, release_id: str, python: str) -> Place:
    # abspath, not realpath: two virtual environments of one python are two interpreters.
    key = hashlib.sha256(("%s\0%s" % (release_id, os.path.abspath(python))).encode()).hexdigest()[:16]
    return Place(os.path.join(warm_root, key))


def idle_s(env: Dict[str, str]) -> float:
    """DFLASH_WARM_IDLE_S of a run's environment; 0: no warm interpreter."""
    text = env.get(IDLE_ENV)
    if text is None:
        return DEFAULT_IDLE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise AgentError("%s=%r is not a number of seconds >= 0 (0: no warm interpreter); it comes from --env or "
                         "the host's environment" % (IDLE_ENV, text), "usage")
    return value


def read_info(where: Place) -> Optional[Dict[str, Any]]:
    """pid.json if its process still runs, else None."""
    try:
        with open(where.file("pid.json")) as handle:
            info = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not procfs.identity_alive(info.get("pid"), info.get("start_time")):
        return None
    return info


def _read_line(conn: socket.socket, what: str) -> Dict[str, Any]:
    data = b""
    while b"\n" not in data:
        try:
            chunk = conn.recv(65536)
        except socket.timeout:
            raise WarmFailed("the warm interpreter did not answer %s within %.0f s (hung)" % (what, REPLY_TIMEOUT_S),
                             hung=True)
        except OSError as exc:
            raise WarmFailed("the connection to the warm interpreter broke %s: %s" % (what, exc))
        if not chunk:
            raise WarmFailed("the warm interpreter closed the connection %s (killed?)" % what)
        data += chunk
    return json.loads(data.decode("utf-8"))


class WarmTrainer:
    """A trainer forked by the warm interpreter, waiting for its go byte."""

    def __init__(self, conn: socket.socket, pid: int, warm_pid: Optional[int]):
        self.conn, self.pid, self.warm_pid = conn, pid, warm_pid
        self.oom_files = oom.counter_files(pid)  # its cgroup is the warm interpreter's

    def go(self, start: bool) -> None:
        """Let it run (or, not `start`, end without running: exit 125). A go that does
        not reach it kills its group and raises WarmFailed: it never runs twice."""
        try:
            self.conn.sendall(b"g" if start else b"n")
            if start:
                _read_line(self.conn, "after the go byte")
        except (OSError, WarmFailed) as exc:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            self.wait()
            raise WarmFailed("the trainer it forked did not start: %s" % exc)

    def wait(self) -> Tuple[Optional[int], Optional[str]]:
        """(its wait status, None); (None, why) when its waiter died before saying it:
        then this returns once the trainer's pid is gone."""
        self.conn.settimeout(None)
        try:
            return _read_line(self.conn, "with the trainer's exit status")["status"], None
        except (WarmFailed, KeyError, ValueError) as exc:
            start = procfs.start_time(self.pid)
            while procfs.identity_alive(self.pid, start):
                time.sleep(STATUS_POLL_S)
            return None, "the trainer's exit status is unknown: %s" % exc
        finally:
            self.conn.close()


def fork_trainer(where: Place, args: Sequence[str], env: Dict[str, str], cwd: str, log: str) -> WarmTrainer:
    """A trainer `python -m dflash_train ARGS` forked by the warm interpreter of `where`,
    in its own session, waiting for WarmTrainer.go; WarmFailed saying why not."""
    sock = where.file("sock")
    info = read_info(where)
    if not os.path.exists(sock):
        if info is not None:
            raise WarmFailed("the warm interpreter (pid %s) is still importing" % info["pid"])
        raise WarmFailed("no warm interpreter for this release and interpreter")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(REPLY_TIMEOUT_S)
    try:
        try:
            _connect(conn, where)
        except OSError as exc:
            raise WarmFailed("the warm interpreter is gone (%s)" % (exc.strerror or exc))
        try:
            conn.sendall(encode_line({"argv": list(args), "env": env, "cwd": cwd, "log": log}))
        except OSError as exc:
            raise WarmFailed("the warm interpreter broke the connection (%s)" % (exc.strerror or exc))
        reply = _read_line(conn, "before forking")
        if "refused" in reply:
            raise WarmFailed("the warm interpreter refused: %s" % reply["refused"],
                             replace="environment differs" in reply["refused"], ends=bool(reply.get("ending")))
        return WarmTrainer(conn, int(reply["pid"]), None if info is None else info.get("pid"))
    except BaseException:
        conn.close()
        raise


def _connect(conn: socket.socket, where: Place) -> None:
    """Connect to `sock` through its folder's descriptor: a workspace's path may be longer
    than sun_path's 107 bytes."""
    folder = os.open(where.dir, os.O_PATH | os.O_DIRECTORY)
    try:
        conn.connect("/proc/self/fd/%d/sock" % folder)
    finally:
        os.close(folder)


def end(where: Place, signum: int) -> None:
    """Signal the warm interpreter of `where`, if it runs (by pid and start time)."""
    info = read_info(where)
    if info is not None:
        try:
            os.kill(info["pid"], signum)
        except OSError:
            pass


def start(warm_root: str, where: Place, python: str, env: Dict[str, str], release_id: str, release_root: str,
          idle: float, ending: bool = False) -> str:
    """Start the warm interpreter of `where` unless one holds its lock (`ending`: one was
    just told to end: its lock is waited for); what happened, for agent.log. Ends those of
    other releases of the same interpreter."""
    os.makedirs(where.dir, mode=0o700, exist_ok=True)
    with locks.exclusive(where.file("start.lock")):
        deadline = time.monotonic() + (READY_TIMEOUT_S if ending else 0.0)
        while locks.is_held(where.file("lock")):
            if time.monotonic() >= deadline:
                return "a warm interpreter holds %s: not starting another" % where.file("lock")
            time.sleep(0.1)
        pid = _spawn(where, python, {k: v for k, v in env.items() if k not in RUN_TIME_ENV}, release_root, idle)
    retired = _end_other_releases(warm_root, where, python)
    return "started the warm interpreter (pid %d, idle timeout %.0f s) for release %s%s" % (
        pid, idle, release_id, "; ended those of releases %s" % ", ".join(retired) if retired else "")


def _spawn(where: Place, python: str, env: Dict[str, str], release_root: str, idle: float) -> int:
    """Double-fork it into a session of its own (no child of the supervisor's left to
    reap); its pid once it holds its lock."""
    ready_r, ready_w = os.pipe()
    pid_r, pid_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(ready_r)
            os.close(pid_r)
            os.setsid()
            grandchild = os.fork()
            if grandchild != 0:
                os.write(pid_w, str(grandchild).encode())
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDONLY)
            log = os.open(where.file("warm.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(devnull, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.set_inheritable(ready_w, True)
            os.chdir(where.dir)
            argv = [python, "-m", "dflash_train.warm", "--dir", where.dir, "--idle-s", repr(idle),
                    "--release-dir", release_root, "--python", python, "--ready-fd", str(ready_w)]
            os.execvpe(python, argv, env)
        finally:
            os._exit(127)
    os.close(ready_w)
    os.close(pid_w)
    os.waitpid(child, 0)
    try:
        pid = int(os.read(pid_r, 32) or b"0")
        ready = select.select([ready_r], [], [], READY_TIMEOUT_S)[0] and os.read(ready_r, 1)
    finally:
        os.close(ready_r)
        os.close(pid_r)
    if ready != b"l":
        raise OSError("the warm interpreter (pid %d) did not take its lock within %.0f s (%s)"
                      % (pid, READY_TIMEOUT_S, where.file("warm.log")))
    return pid


def _end_other_releases(warm_root: str, where: Place, python: str) -> list:
    """SIGTERM the warm interpreters of the same interpreter but another release: a
    deploy moved on from them. Their release ids."""
    ended = []
    try:
        names = sorted(os.listdir(warm_root))
    except OSError:
        return ended
    interpreter = os.path.abspath(python)
    for name in names:
        other = Place(os.path.join(warm_root, name))
        info = read_info(other)
        if other.dir == where.dir or info is None or os.path.abspath(str(info.get("python"))) != interpreter:
            continue
        os.kill(info["pid"], signal.SIGTERM)
        ended.append(os.path.basename(str(info.get("release_dir"))))
    return ended
