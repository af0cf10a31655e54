"""The trainer with its imports done, forked once per run: what support.trainer starts
instead of a new `python -m dflash_train` when the run does not depend on the
interpreter's own start.

Why: a trainer spends about 4 of the 5 CPU-seconds of a short test run importing torch and
transformers, and the suite starts it dozens of times on 2 cores. A forked child is still a
process of its own (pid, session, signals, exit status, files); what it skips is the
interpreter start and those imports, which every run launched through the agent still does.

Protocol, one JSON object per line. In, on stdin:
  {"op": "start", "id": N, "argv": [...], "cwd": DIR, "env": {...}, "log": FILE}
  {"op": "signal", "id": N, "pid": PID, "signal": SIGNUM}
Out, on stdout:
  {"id": N, "pid": PID}                 the run started
  {"id": N, "sent": true|false}         false: that pid has already exited
  {"pid": PID, "returncode": CODE}      a run exited (negative: the signal that ended it)
The server exits when stdin closes; runs still going keep going.

Run as a script with remote/ on PYTHONPATH and the environment a trainer would have.
"""
from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys

# What `python -m dflash_train` imports before it trains, evaluates or regenerates.
import dflash_train.jobs.coordinator  # noqa: F401
import dflash_train.jobs.evaluation  # noqa: F401
import dflash_train.jobs.regenerate  # noqa: F401
import transformers.utils.logging  # noqa: F401


def reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def serve() -> dict:
    """Answer requests until stdin closes (then exit). Returns only in a forked child: the
    start request that child is to run."""
    running: dict[int, int] = {}  # pidfd -> pid: readable once that child has exited
    pending = b""
    while True:
        ready, _, _ = select.select([0, *running], [], [])
        for fd in ready:
            if fd != 0:
                pid = running.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                sys.exit(0)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if request["op"] == "signal":
                    # Through the pidfd: a pid this server has reaped may already name another process.
                    pidfd = next((fd for fd, pid in running.items() if pid == request["pid"]), None)
                    if pidfd is not None:
                        signal.pidfd_send_signal(pidfd, request["signal"])
                    reply({"id": request["id"], "sent": pidfd is not None})
                    continue
                pid = os.fork()
                if pid == 0:
                    for pidfd in running:  # the siblings' exits are the server's business
                        os.close(pidfd)
                    return request
                running[os.pidfd_open(pid)] = pid
                reply({"id": request["id"], "pid": pid})


def become(request: dict) -> None:
    """Turn this forked child into the process `python -m dflash_train ARGV` would be, as
    support.trainer starts it: its own session, in the run dir, stdin from /dev/null,
    stdout and stderr appended to the log, the request's environment."""
    os.setsid()
    os.chdir(request["cwd"])
    with open(os.devnull, "rb") as null, open(request["log"], "ab") as log:
        os.dup2(null.fileno(), 0)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # as `-m` has it
    sys.argv = ["dflash_train", *request["argv"]]


if __name__ == "__main__":
    become(serve())
    runpy.run_module("dflash_train", run_name="__main__", alter_sys=True)
