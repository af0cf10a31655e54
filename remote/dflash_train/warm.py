"""The warm interpreter: `python -m dflash_train.warm --dir DIR ...`, a process of the
trainer's interpreter that has imported what `python -m dflash_train` imports before it
trains, evaluates or regenerates, and forks a run's trainer on request, so that a launch
does not pay the interpreter's start and torch's and transformers' imports (seconds to
tens of seconds on a GPU host). The agent starts and uses it (dflash_agent/warm.py,
docs/runs.md "Warm interpreter"); the files it keeps are in DIR (docs/layout.md).

Nothing here may initialise CUDA: a CUDA context does not survive a fork. Before each
fork it checks that torch.cuda.is_initialized() is still False and that it runs no more
threads than its imports left, and refuses otherwise.

Per request (one connection on DIR/sock, one JSON line in, JSON lines out):
  in   {"argv": [...], "env": {...}, "cwd": DIR, "log": FILE}
  out  {"refused": WHY}                      no trainer: the agent starts one itself
  out  {"pid": PID}                          the trainer is forked, in its own session,
                                             waiting for the go byte
  in   b"g" (start) or anything else / EOF   (then it exits 125 without running)
  out  {"started": true}                     after "g" reached it
  out  {"status": WAITSTATUS}                when it has ended, as waitpid gives it
The trainer's parent is a waiter forked per request, in a session of its own, which sends
the last two lines: it outlives the warm interpreter, so a trainer's exit status reaches
the agent also when the warm interpreter is killed or ends while the run goes on.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback

from dflash_contract.names import RUN_TIME_ENV


# The agent's lines (agent.log, warm.log) and the refusals it records in run.json.
WHY_TORCH_CHANGED = "torch changed under it"
WHY_CUDA = "CUDA is initialised in it"
REQUEST_TIMEOUT_S = 10.0  # for the request line and the go byte; the agent waits as long
# What `python -m dflash_train` imports before its job starts.
IMPORTS = ("dflash_train.jobs.coordinator", "dflash_train.jobs.evaluation", "dflash_train.jobs.regenerate",
           "transformers.utils.logging")
# Imported when present: the families a target most often is, whose modeling modules
# transformers imports only when a model of them is built.
MODELING_MODULES = ("transformers.models.qwen3.modeling_qwen3", "transformers.models.llama.modeling_llama",
                    "transformers.models.qwen2.modeling_qwen2")


def say(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    os.write(2, ("%s warm[%d]: %s\n" % (stamp, os.getpid(), message)).encode("utf-8", "replace"))


def send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def read_line(conn: socket.socket, timeout: float) -> bytes:
    conn.settimeout(timeout)
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(1 << 20)
        if not chunk:
            raise EOFError("the connection closed before a whole line")
        data += chunk
    return data


def torch_marker() -> dict:
    """What says which torch this process imported: its version file's path, and that
    file's size, mtime and sha256 (an upgrade rewrites it; its text names the version and
    the build's git commit, so a new torch whose installer kept the same size and mtime
    still differs)."""
    import torch.version
    path = torch.version.__file__
    return dict(version_file(path), path=path, version=torch.__version__)


def version_file(path: str) -> dict:
    """{size, mtime_ns, sha256} of the file at `path` ({} if it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            data = handle.read()
    except OSError:
        return {}
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "sha256": hashlib.sha256(data).hexdigest()}


def write_json(path: str, obj: dict) -> None:
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as handle:
        json.dump(obj, handle)
    os.replace(tmp, path)


class Warm:
    def __init__(self, args: argparse.Namespace, lock_fd: int, info: dict, env: dict):
        self.dir, self.idle_s, self.release_dir = args.dir, args.idle_s, args.release_dir
        self.lock_fd, self.info = lock_fd, info
        self.env = {k: v for k, v in env.items() if k not in RUN_TIME_ENV}  # as it started: imports add to it
        self.listener: socket.socket | None = None

    def refusal(self, request: dict) -> tuple[str | None, bool]:
        """(why this request gets no trainer, whether this process must end), (None, False)
        to fork."""
        marker = self.info["torch"]
        if version_file(marker["path"]) != {k: marker[k] for k in ("size", "mtime_ns", "sha256")}:
            return "%s (%s is not the file it imported)" % (WHY_TORCH_CHANGED, marker["path"]), True
        if not os.path.isdir(self.release_dir):
            return "its release %s is gone" % self.release_dir, True
        import torch
        if torch.cuda.is_initialized():
            return WHY_CUDA, True
        threads = len(os.listdir("/proc/self/task"))
        if threads > self.info["threads"]:
            return "it runs %d threads, %d more than after its imports (a fork keeps only one)" % (
                threads, threads - self.info["threads"]), True
        env = {k: v for k, v in request["env"].items() if k not in RUN_TIME_ENV}
        differ = sorted(k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k))
        if differ:
            return "the run's environment differs from the one it imported in (%s)" % ", ".join(differ), False
        return None, False

    def serve(self) -> dict:
        """Answer connections until idle for idle_s (then exit). Returns only in a forked
        trainer: its request."""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = os.path.join(self.dir, "sock.%d" % os.getpid())
        # Bound by its path from the cwd (DIR, as the agent starts it): a workspace's path
        # may be longer than sun_path's 107 bytes.
        self.listener.bind(os.path.relpath(staging))
        os.chmod(staging, 0o600)
        self.listener.listen(16)
        os.replace(staging, os.path.join(self.dir, "sock"))  # connectable from here on
        write_json(os.path.join(self.dir, "pid.json"), dict(self.info, state="ready", ready_at=time.time()))
        say("ready: imports took %.1f s; idle timeout %.0f s" % (self.info["import_s"], self.idle_s))
        last_use = time.monotonic()
        while True:
            while True:  # the waiters that have ended
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
            left = self.idle_s - (time.monotonic() - last_use)
            if left <= 0:
                say("idle for %.0f s: exiting" % self.idle_s)
                return {}
            if not select.select([self.listener], [], [], min(left, 5.0))[0]:
                continue
            conn, _ = self.listener.accept()
            last_use = time.monotonic()
            try:
                request = self.answer(conn)
            except (OSError, EOFError, ValueError) as exc:
                say("a request failed: %s: %s" % (type(exc).__name__, exc))
                request = None
            if request is not None:
                if request.get("end"):
                    return {}
                return request
            conn.close()

    def answer(self, conn: socket.socket) -> dict | None:
        """Fork the waiter for one request; in the forked trainer, return its request."""
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            send(conn, {"refused": "uid %d is not this process's" % uid})
            return None
        request = json.loads(read_line(conn, REQUEST_TIMEOUT_S))
        why, end = self.refusal(request)
        if why is not None:
            say("refused a run: %s" % why)
            send(conn, {"refused": why, "ending": end})
            return {"end": True} if end else None
        if os.fork() != 0:
            return None
        # The waiter: out of the warm interpreter's session, so that nothing sent to it
        # reaches the waiter; it holds neither the listener nor the lock.
        self.listener.close()
        os.close(self.lock_fd)
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        wait_for_trainer(conn, request)  # returns only in the trainer
        request["conn"] = conn
        return request


def wait_for_trainer(conn: socket.socket, request: dict) -> None:
    """In the waiter: fork the trainer, tell its pid, pass the go byte on, wait for it,
    tell its status, exit. Returns only in the trainer, once it may start."""
    go_r, go_w = os.pipe()
    sync_r, sync_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(sync_r)
        os.setsid()  # its own process group (pgid == pid), as an exec'd trainer's
        os.write(sync_w, b"s")
        os.close(sync_w)
        go = os.read(go_r, 1)
        os.close(go_r)
        if go != b"g":
            os._exit(125)  # the agent gave up before run.json existed: never start
        return
    os.close(go_r)
    os.close(sync_w)
    code = 0
    try:
        if os.read(sync_r, 1) != b"s":
            raise RuntimeError("the trainer died before its setsid")
        send(conn, {"pid": pid})
        conn.settimeout(REQUEST_TIMEOUT_S)
        if conn.recv(1) == b"g":
            os.write(go_w, b"g")
            os.close(go_w)
            send(conn, {"started": True})
        else:
            os.close(go_w)
    except BaseException as exc:  # noqa: BLE001 - the agent reads EOF; the log says why
        say("waiter for pid %d: %s: %s" % (pid, type(exc).__name__, exc))
        code = 1
    _, status = os.waitpid(pid, 0)
    try:
        send(conn, {"status": status})
    except OSError:
        code = 1  # the supervisor is gone; run.json and /proc tell the rest
    os._exit(code)


def become_trainer(request: dict) -> None:
    """Make this forked process what `python -m dflash_train ARGV` exec'd by the agent is
    (supervisor._exec_trainer): stdin /dev/null, stdout and stderr appended to the log, cwd
    the run dir, the run's environment, a fresh interpreter's signal dispositions and an
    empty signal mask; then run dflash_train's __main__."""
    request.pop("conn").close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    os.chdir(request["cwd"])
    for signum in range(1, signal.NSIG):
        if signum in (signal.SIGKILL, signal.SIGSTOP) or signum in range(signal.SIGRTMIN, signal.SIGRTMAX + 1):
            continue
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            continue
    for name in ("SIGPIPE", "SIGXFSZ"):  # as the interpreter's own start leaves them
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # as `-m` has it
    sys.argv = ["-m", *request["argv"]]  # as `python -m` has it until runpy names the file
    from . import startup_phases
    startup_phases.forked_from_warm(request["import_s"])
    try:
        runpy.run_module("dflash_train", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # argparse's usage errors, as `python -m` ends on them
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter ends on an uncaught exception
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.warm")
    parser.add_argument("--dir", required=True, help="its folder: lock, pid.json, sock, warm.log")
    parser.add_argument("--idle-s", type=float, required=True, help="exit after this long without a request")
    parser.add_argument("--release-dir", required=True, help="the release it runs: gone, it exits")
    parser.add_argument("--python", required=True, help="the interpreter as the agent names it (pid.json)")
    parser.add_argument("--ready-fd", type=int, required=True, help="gets one byte once it holds the lock")
    args = parser.parse_args()
    began = time.monotonic()
    env = dict(os.environ)
    lock_fd = os.open(os.path.join(args.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one per folder, for its whole life
    except BlockingIOError:
        say("another warm interpreter holds %s: exiting" % os.path.join(args.dir, "lock"))
        os.write(args.ready_fd, b"x")
        os._exit(0)
    info = {"pid": os.getpid(), "start_time": _start_ticks(), "python": args.python,
            "release_dir": args.release_dir, "idle_s": args.idle_s, "started_at": time.time(), "state": "importing"}
    write_json(os.path.join(args.dir, "pid.json"), info)
    os.write(args.ready_fd, b"l")
    os.close(args.ready_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for name in IMPORTS:
        importlib.import_module(name)
    for name in MODELING_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # The threads the imports leave: numpy's OpenBLAS thread server, which shuts its
    # threads down around a fork (its pthread_atfork handler). Any more, started by
    # something that ran since, would be lost mid-work in the forked trainer.
    info.update(torch=torch_marker(), import_s=round(time.monotonic() - began, 3),
                threads=len(os.listdir("/proc/self/task")))
    warm = Warm(args, lock_fd, info, env)
    try:
        request = warm.serve()
    finally:
        if threading.current_thread() is threading.main_thread() and os.getpid() == info["pid"]:
            _remove_own(args.dir, info["pid"])
    if request:
        request["import_s"] = info["import_s"]
        become_trainer(request)


def _start_ticks() -> int:
    with open("/proc/self/stat", "rb") as handle:
        return int(handle.read().rsplit(b")", 1)[1].split()[19])


def _remove_own(folder: str, pid: int) -> None:
    """sock and pid.json, if they are still this process's (a successor may have its own)."""
    try:
        with open(os.path.join(folder, "pid.json")) as handle:
            ours = json.load(handle).get("pid") == pid
    except (OSError, ValueError):
        ours = False
    if ours:
        for name in ("sock", "pid.json"):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


if __name__ == "__main__":
    main()
