"""Drive the real agent (`python remote/agent.py`) as a subprocess against a temporary
workspace whose release holds a copy of the agent and the scripted stand-in trainer.

Every process a test starts is recorded and killed at teardown, by the process group
or pid read from run.json after checking its start time, never by name.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import pytest

from dflash_contract import replies as protocol
from dflash_contract.checker import ProtocolError
from dflash_contract.follow import follow_message
from dflash_files import procfs
from support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "dflash_train"
RELEASE_ID = "rel-0001"


def make_workspace(base: Path, release_id: str = RELEASE_ID) -> Path:
    """<base>/work space/ with releases/<id>/remote/{agent.py, dflash_agent, dflash_contract, dflash_train}
    and current -> releases/<id>. The space in the path checks that nothing splits it."""
    workspace = base / "work space"
    remote = workspace / "releases" / release_id / "remote"
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("dflash_agent", "dflash_contract"):
        shutil.copytree(REPO / "remote" / package, remote / package, ignore=ignore)
    shutil.copy2(REPO / "remote" / "agent.py", remote / "agent.py")
    shutil.copytree(STANDIN, remote / "dflash_train", ignore=ignore)
    (workspace / "configs").mkdir()
    os.symlink(os.path.join("releases", release_id), workspace / "current")
    return workspace


REPLIES = {reply.VERB: reply for reply in (
    protocol.LaunchReply, protocol.ResumeReply, protocol.StatusReply, protocol.StopReply, protocol.StacksReply,
    protocol.ReportReply, protocol.GpusReply, protocol.InfoReply, protocol.ArtifactsReply,
    protocol.CompileArtifactsReply, protocol.ReceiveCompileArtifactsReply, protocol.ReleaseFilesReply,
    protocol.RunConfigReply, protocol.GcReply)}
CHECK_REPLIES = {"launch": protocol.LaunchCheckReply, "resume": protocol.ResumeCheckReply}


def reply_type(args: Sequence[str]) -> type:
    verb = next((arg for arg in args if not arg.startswith("-")), None)
    return CHECK_REPLIES[verb] if "--check-only" in args else REPLIES[verb]


def read_as(kind: Any, obj: Dict[str, Any]) -> Any:
    """`obj` read strictly as its protocol type, which must give it back unchanged: the
    types describe what the agent prints, key for key."""
    typed = kind(obj) if not isinstance(kind, type) else kind.from_json(obj)
    assert typed.to_json() == obj, "%r reads back as %r" % (obj, typed.to_json())
    return typed


class AgentResult:
    def __init__(self, rc: int, stdout: bytes, stderr: bytes, args: Sequence[str] = ()):
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr.decode("utf-8", "replace")
        lines = stdout.splitlines()
        assert len(lines) == 1, "stdout must be exactly one JSON line, got %r (stderr: %s)" % (stdout, self.stderr)
        self.json: Dict[str, Any] = json.loads(lines[0])
        self.reply = read_as(reply_type(args) if rc == 0 else protocol.ErrorReply, self.json)


class FollowStream:
    """A running `follow` whose stdout lines are parsed as they come."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.raw_lines: List[bytes] = []
        self._queue: "queue.Queue[Any]" = queue.Queue()  # messages, None at the end, or why one was refused
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.raw_lines.append(line)
            message = json.loads(line)
            try:
                read_as(follow_message, message)
            except (AssertionError, ProtocolError) as exc:
                self._queue.put(exc)  # raised by the test's next read
                return
            self._queue.put(message)
        self._queue.put(None)

    def next(self, timeout: float = 10.0) -> Optional[Dict[str, Any]]:
        """The next message; None once the stream ended."""
        try:
            message = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no follow message within %.1f s" % timeout) from None
        if isinstance(message, Exception):
            raise message
        return message

    def until(self, predicate: Callable[[Dict[str, Any]], bool], timeout: float = 10.0) -> List[Dict[str, Any]]:
        """Messages up to and including the first that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            message = self.next(max(0.01, deadline - time.monotonic()))
            assert message is not None, "stream ended before the expected message; got %r" % seen
            seen.append(message)
            if predicate(message):
                return seen

    def rest(self, timeout: float = 20.0) -> List[Dict[str, Any]]:
        """All remaining messages; the process must exit 0 after them."""
        out = []
        while True:
            message = self.next(timeout)
            if message is None:
                break
            out.append(message)
        assert self.proc.wait(timeout) == 0, self.proc.stderr.read() if self.proc.stderr else ""
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)  # EOF now that the process is gone; then the pipe may close
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


class Agent:
    def __init__(self, workspace: Path):
        self.workspace = workspace
        self.agent_py = workspace / "current" / "remote" / "agent.py"
        self.env = dict(os.environ)
        self.env["PATH"] = os.pathsep.join(p for p in self.env.get("PATH", "").split(os.pathsep)
                                           if p and not os.path.exists(os.path.join(p, "nvidia-smi")))
        self.env.pop("PYTHONPATH", None)
        self._run_ids: List[str] = []
        self._streams: List[FollowStream] = []
        self._configs = 0

    def argv(self, *args: str) -> List[str]:
        return [sys.executable, str(self.agent_py), "--workspace", str(self.workspace), *args]

    def run(self, *args: str, stdin: Optional[bytes] = None, timeout: float = 60.0,
            env: Optional[Dict[str, str]] = None) -> AgentResult:
        done = subprocess.run(self.argv(*args), input=stdin if stdin is not None else b"",
                              capture_output=True, timeout=timeout, env=env or self.env)
        return AgentResult(done.returncode, done.stdout, done.stderr, args)

    def ok(self, *args: str, **kwargs: Any) -> Dict[str, Any]:
        result = self.run(*args, **kwargs)
        assert result.rc == 0, "agent %s failed (%d): %s\n%s" % (args, result.rc, result.json, result.stderr)
        return result.json

    def config(self, steps: Sequence[Dict[str, Any]]) -> Path:
        self._configs += 1
        path = self.workspace / "configs" / ("script-%d.json" % self._configs)
        path.write_text(json.dumps({"steps": list(steps)}))
        return path

    def launch_args(self, run_id: str, steps: Sequence[Dict[str, Any]], *extra: str) -> List[str]:
        return ["launch", "--run-id", run_id, "--config", str(self.config(steps)), *extra]

    def launch(self, run_id: str, steps: Sequence[Dict[str, Any]], *extra: str) -> Dict[str, Any]:
        self._run_ids.append(run_id)
        return self.ok(*self.launch_args(run_id, steps, *extra))

    def track(self, run_id: str) -> None:
        """Clean up a run started some other way."""
        self._run_ids.append(run_id)

    def run_dir(self, run_id: str) -> Path:
        return self.workspace / "runs" / run_id

    def fabricate_run(self, run_id: str, **fields: Any) -> Path:
        """A run directory as a launch would leave it, with whatever run.json says
        (by default: this very process, started now, on this boot)."""
        run_dir = self.run_dir(run_id)
        run_dir.mkdir(parents=True)
        record = {"run_id": run_id, "name": None, "release_id": "rel-0001", "release_dir": "", "workspace": "",
                  "config": "", "config_source": "config.yaml", "argv": ["python3"], "cwd": str(run_dir),
                  "env_keys": [], "pid": os.getpid(), "pgid": os.getpid(),
                  "start_time": procfs.start_time(os.getpid()), "boot_id": procfs.boot_id(), "host": "node",
                  "started_at": time.time(), "stall_after": 300.0, "resources": [],
                  "supervisor": {"pid": None, "start_time": None}}
        record.update(fields)
        (run_dir / "run.json").write_text(json.dumps(record))
        return run_dir

    def read(self, run_id: str, name: str) -> Any:
        return json.loads((self.run_dir(run_id) / name).read_text())

    def status(self, run_id: str) -> Dict[str, Any]:
        (status,) = self.ok("status", "--run-id", run_id)["runs"]
        return status

    def wait_state(self, run_id: str, *states: str, timeout: float = 15.0) -> Dict[str, Any]:
        found: Dict[str, Any] = {}

        def reached() -> bool:
            found.update(self.status(run_id))
            return found["state"] in states

        wait_until(reached, timeout, "run %r to reach %s (last: %s)" % (run_id, states, found.get("state")))
        return found

    def touch(self, run_id: str, name: str) -> None:
        (self.run_dir(run_id) / name).touch()

    def follow(self, run_id: str, *extra: str) -> FollowStream:
        proc = subprocess.Popen(self.argv("follow", "--run-id", run_id, *extra), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
        stream = FollowStream(proc)
        self._streams.append(stream)
        return stream

    def cleanup(self) -> None:
        for stream in self._streams:
            stream.close()
        for run_id in self._run_ids:
            kill_run(self.run_dir(run_id))


def kill_run(run_dir: Path) -> None:
    """SIGKILL what is left of a run the test started: the trainer's process group and
    the supervisor, each only after its start time matched run.json."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, ValueError):
        return
    if record.get("boot_id") != procfs.boot_id():
        return
    pgid = record["pgid"]
    ours = procfs.group_is_ours(pgid, record.get("start_time"))
    if ours:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    supervisor = record.get("supervisor") or {}
    if procfs.identity_alive(supervisor.get("pid"), supervisor.get("start_time")):
        try:
            os.kill(supervisor["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    if ours:
        wait_until(lambda: not procfs.group_members(pgid), 10.0, "run processes to exit")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    harness = Agent(make_workspace(tmp_path))
    try:
        yield harness
    finally:
        harness.cleanup()
