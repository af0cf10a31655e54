"""The real trainer as the agent starts it: `python -m dflash_train` in its run dir, stdout and
stderr appended to train.log, the agent's environment; and what tests read of such a run.

By default the process is forked from a trainer that has already imported torch and
transformers (trainer_fork_server.py), one such server per environment of the test process:
the same trainer code in a process of its own, without the seconds of imports per run.
`fresh=True`, or an environment beyond the servers', starts a new interpreter instead."""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from .events import read_events
from .wait import DEFAULT_TIMEOUT_S, wait_until

REPO = Path(__file__).resolve().parents[2]
FORK_SERVER = Path(__file__).with_name("trainer_fork_server.py")
# What a forked run may set beyond the server's environment: read while the trainer runs,
# never by an import (PYTEST_CURRENT_TEST: pytest's name for the test running now).
RUN_TIME_VARIABLES = {"DFLASH_RUN_ID", "DFLASH_RELEASE_ID", "DFLASH_RELEASE_DIR", "DFLASH_WORKSPACE",
                      "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "PYTEST_CURRENT_TEST"}
# The CLI's, never read by a trainer, and set anew for every test (conftest's
# logs_outside_the_checkout): kept in a trainer's environment, it would make every test's
# environment differ from the fork server's, and every run start a new interpreter.
CLI_VARIABLES = {"DFLASH_LOGS"}


class ForkServer:
    """A running trainer_fork_server.py and what it has said: replies to requests and the
    exit statuses of the runs it forked."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(FORK_SERVER)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.changed = threading.Condition()
        self.replies: dict[int, dict] = {}
        self.exits: dict[int, int] = {}  # pid -> returncode
        self.requests = 0
        self.gone = False
        threading.Thread(target=self._read, name="trainer-fork-server", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "returncode" in message:
                    self.exits[message["pid"]] = message["returncode"]
                else:
                    self.replies[message["id"]] = message
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def request(self, op: str, **fields) -> dict:
        with self.changed:
            self.requests += 1
            number = self.requests
            self.proc.stdin.write(json.dumps({"op": op, "id": number, **fields}).encode() + b"\n")
            self.proc.stdin.flush()
            # the first request waits for the server's imports, on a loaded machine too
            self.changed.wait_for(lambda: number in self.replies or self.gone, DEFAULT_TIMEOUT_S)
            if number not in self.replies:
                raise RuntimeError(f"the trainer fork server did not answer {op!r} ({self.state()})")
            return self.replies.pop(number)

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """The returncode of run `pid`, or None if it is still running after `timeout` s."""
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exits or self.gone, timeout)
            if pid in self.exits:
                return self.exits[pid]
            if self.gone:
                raise RuntimeError(f"the trainer fork server is gone, run {pid}'s exit status with it ({self.state()})")
            return None

    def state(self) -> str:
        code = self.proc.poll()
        return "running" if code is None else f"exit code {code}"

    def close(self) -> None:
        """End the server (runs it forked keep going; their tests end them)."""
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedRun:
    """A forked run, with the part of subprocess.Popen's interface that tests use."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"dflash_train (pid {self.pid})", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # the server signals it only while it has not reaped it
            self.server.request("signal", pid=self.pid, signal=int(signum))

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# One server per environment the process's tests start trainers in (the usual one, and a
# few tests' own, e.g. a TORCHINDUCTOR_CACHE_DIR of their own): a server serves only runs of
# its own environment, and which test of a worker starts a trainer first is up to the
# scheduler. A server keeps its runs' exit statuses, so none is closed before the process ends.
MAX_FORK_SERVERS = 3
_servers: dict[frozenset, ForkServer] = {}


def fork_server(env: dict[str, str]) -> ForkServer | None:
    """This process's fork server for environment `env` (started at its first use), or None
    when MAX_FORK_SERVERS other environments have one already."""
    key = frozenset(env.items())
    server = _servers.get(key)
    if server is None or server.gone:
        if server is None and len(_servers) >= MAX_FORK_SERVERS:
            return None
        server = _servers[key] = ForkServer(env)
        atexit.register(server.close)
    return server


class Launched:
    def __init__(self, run_dir: Path, proc: subprocess.Popen | ForkedRun):
        self.run_dir, self.proc = run_dir, proc

    def events(self, type_: str | None = None) -> list[dict]:
        return read_events(self.run_dir / "events.jsonl", type_)

    def errors(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "errors.jsonl").read_text().splitlines()]

    def log(self) -> str:
        return (self.run_dir / "train.log").read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the trainer did not exit within {timeout}s; log tail:\n{self.log()[-3000:]}")

    def wait_for(self, what: str, predicate, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            wait_until(predicate, timeout, what,
                       give_up=lambda: None if self.proc.poll() is None else f"exit {self.proc.returncode}")
        except AssertionError as exc:
            pytest.fail(f"{exc}; log tail:\n{self.log()[-3000:]}")


def start_trainer(workspace: Path, run_dir: Path, config_text: str, run_id: str,
                  env: dict[str, str] | None = None, fresh: bool = False) -> Launched:
    """`python -m dflash_train` on `config_text` in `run_dir`, as the agent starts it.
    `env`: more variables (e.g. a rank's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
    `fresh`: in a new interpreter, whatever the environment (see the module's docstring)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_text)
    base = {**{k: v for k, v in os.environ.items() if k not in RUN_TIME_VARIABLES | CLI_VARIABLES},
            "PYTHONPATH": str(REPO / "remote"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    run = {**{k: v for k, v in os.environ.items() if k in RUN_TIME_VARIABLES},
           "DFLASH_RUN_ID": run_id, "DFLASH_RELEASE_ID": "rel-test", "DFLASH_RELEASE_DIR": str(REPO),
           "DFLASH_WORKSPACE": str(workspace), **(env or {})}
    argv = ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]
    (run_dir / "train.log").touch()  # there when this returns, however the run starts
    server = None if fresh or not run.keys() <= RUN_TIME_VARIABLES else fork_server(base)
    if server is not None:
        started = server.request("start", argv=argv, cwd=str(run_dir), env={**base, **run},
                                 log=str(run_dir / "train.log"))
        return Launched(run_dir, ForkedRun(server, started["pid"]))
    with open(run_dir / "train.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train", *argv], cwd=run_dir, env={**base, **run},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Launched(run_dir, proc)


def end(launched: Launched) -> None:
    if launched.proc.poll() is None:
        launched.proc.kill()
        launched.proc.wait()
