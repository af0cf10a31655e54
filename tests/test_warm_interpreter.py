"""The warm interpreter (docs/runs.md "Warm interpreter"): the real agent
(remote/agent.py) launching the real trainer on the tiny CPU config, from a release that
is a copy of remote/, with the warm interpreter on (the suite's hosts have it off:
support.inventory.HOST_ENV); and the CLI launching over the ssh and pct transports, through
the real sshd and the fake pct.

Each test pays one warm interpreter's imports (about 5 CPU-s here) and one cold trainer's
(the launch that starts it), plus a few short runs: 15-30 CPU-s a test.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from dflash_files import procfs
from dflash_agent import warm as agent_warm
from dflash_train import warm as trainer_warm
from dflash_files.compile_key import CACHE_DIR
from dflash_run import dflash_in_process
from support import container_workspace, workspace_on_node
from support.inventory import HOST_ENV
from support.train_configs import small_config
from support.wait import wait_until
from support_agent.harness import kill_run

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)
WHY = "a warm interpreter's imports and trainer processes"
IDLE_S = "120"
SUN_PATH_BYTES = 108  # what a Unix socket's address holds, its NUL included


class Host:
    """A workspace with a real release, driven through the real agent."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        # Its warm interpreter's socket path is longer than a Unix socket's address allows
        # (sun_path: 107 bytes and a NUL).
        self.ws = tmp_path / ("w" * 100)
        self.release("rel-a")
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.runs: List[str] = []

    def release(self, release_id: str) -> None:
        remote = self.ws / "releases" / release_id / "remote"
        shutil.copytree(REPO / "remote", remote, ignore=shutil.ignore_patterns("__pycache__"))
        current = self.ws / "current"
        if current.is_symlink():
            current.unlink()
        os.symlink(os.path.join("releases", release_id), current)

    def agent(self, *args: str) -> Dict[str, Any]:
        done = subprocess.run([sys.executable, str(self.ws / "current" / "remote" / "agent.py"),
                               "--workspace", str(self.ws), *args], capture_output=True, env=self.env, timeout=120)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
        return json.loads(done.stdout)

    def config(self, name: str, **changes: Any) -> Path:
        return small_config(self.tmp / f"{name}.yaml", **changes)

    def launch(self, run_id: str, config: Path, *extra: str) -> Dict[str, Any]:
        self.runs.append(run_id)
        return self.agent("launch", "--run-id", run_id, "--config", str(config), "--python", sys.executable,
                          "--env", "DFLASH_WARM_IDLE_S=" + IDLE_S, *extra)

    def run_dir(self, run_id: str) -> Path:
        return self.ws / "runs" / run_id

    def record(self, run_id: str) -> Dict[str, Any]:
        return json.loads((self.run_dir(run_id) / "run.json").read_text())

    def exit_record(self, run_id: str, timeout: float = 120.0) -> Dict[str, Any]:
        path = self.run_dir(run_id) / "exit.json"
        wait_until(path.exists, timeout, f"{run_id}'s exit.json")
        return json.loads(path.read_text())

    def first_step(self, run_id: str) -> None:
        events = self.run_dir(run_id) / "events.jsonl"
        wait_until(lambda: events.exists() and '"type": "step"' in events.read_text(), 120.0, f"{run_id}'s first step")

    def place(self, release_id: str = "rel-a") -> agent_warm.Place:
        return agent_warm.place(str(self.ws / "warm"), release_id, sys.executable)

    def ready(self, release_id: str = "rel-a") -> Dict[str, Any]:
        """pid.json of the release's warm interpreter, once it serves."""
        found: Dict[str, Any] = {}

        def serving() -> bool:
            found.clear()
            found.update(agent_warm.read_info(self.place(release_id)) or {})
            return found.get("state") == "ready"
        wait_until(serving, 120.0, "the warm interpreter to be ready")
        return dict(found)

    def warm_pids(self) -> List[int]:
        return warm_pids(self.ws)

    def cleanup(self) -> None:
        for run_id in self.runs:
            kill_run(self.run_dir(run_id))
        kill_warm(self.ws)


def warm_pids(workspace: Path | str) -> List[int]:
    """The live warm interpreters of a workspace (processes running dflash_train.warm on it;
    `workspace` as they name it)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            stat = procfs.read_stat(int(name))
        except OSError:
            continue
        if b"dflash_train.warm" in cmdline and str(workspace).encode() in b" ".join(cmdline) and procfs.is_running(stat):
            # the interpreter itself (double-forked: no session leader), not a waiter or
            # trainer forked from it (each leads a session of its own)
            if stat.session != int(name):
                pids.append(int(name))
    return pids


def kill_warm(workspace: Path | str) -> None:
    for pid in warm_pids(workspace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def host(tmp_path: Path):
    bed = Host(tmp_path)
    try:
        yield bed
    finally:
        bed.cleanup()


def proc_view(pid: int) -> Dict[str, Any]:
    """What the rest of the system sees of a trainer process."""
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    stat = procfs.read_stat(pid)
    return {"cwd": os.readlink(f"/proc/{pid}/cwd"), "sid": stat.session, "pgid": stat.pgrp,
            "fds": [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)],
            "signals": {key: status[key].strip() for key in ("SigBlk", "SigIgn")}}


def timed_first_step(host: Host, run_id: str, config: Path) -> float:
    began = time.monotonic()
    host.launch(run_id, config)
    host.first_step(run_id)
    return time.monotonic() - began


@pytest.mark.slow(seconds=40, why=WHY)
def test_a_launch_forked_by_the_warm_interpreter_is_the_run_an_exec_would_be(host, tmp_path):
    hang = host.config("hang", faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    # The agent inherits an ignored SIGHUP, as under `nohup` (and SIGQUIT, as a shell's
    # background job): neither trainer may keep it, the exec'd one no more than the forked.
    ignored = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        cold_s = timed_first_step(host, "cold", hang)
    finally:
        for signum, handler in ignored.items():
            signal.signal(signum, handler)
    cold = host.record("cold")
    assert (cold["started_by"], cold["warm_reason"]) == ("exec", "no warm interpreter for this release and interpreter")
    agent_log = (host.run_dir("cold") / "agent.log").read_text()
    assert "not using the warm interpreter: no warm interpreter" in agent_log
    info = host.ready()
    assert "started the warm interpreter (pid %d" % info["pid"] in (host.run_dir("cold") / "agent.log").read_text()
    assert len(host.place().file("sock").encode()) > SUN_PATH_BYTES

    warm_s = timed_first_step(host, "warm", hang)
    record = host.record("warm")
    assert (record["started_by"], record["warm_reason"]) == ("warm", None)
    assert record["argv"][1:3] == ["-m", "dflash_train"] and record["pid"] == record["pgid"]
    print(f"\nfirst step: cold exec {cold_s:.2f} s, warm interpreter {warm_s:.2f} s "
          f"(its imports, paid once: {info['import_s']:.1f} s)")

    seen_cold, seen_warm = proc_view(cold["pid"]), proc_view(record["pid"])
    assert seen_warm["cwd"] == str(host.run_dir("warm")) and seen_warm["sid"] == seen_warm["pgid"] == record["pid"]
    assert seen_warm["fds"] == ["/dev/null", str(host.run_dir("warm") / "train.log"), str(host.run_dir("warm") / "train.log")]
    assert seen_warm["signals"] == seen_cold["signals"]  # the same dispositions and mask as an exec'd trainer
    assert int(seen_cold["signals"]["SigIgn"], 16) & (1 << signal.SIGHUP - 1 | 1 << signal.SIGQUIT - 1) == 0
    (imports,) = [e for e in map(json.loads, (host.run_dir("warm") / "events.jsonl").read_text().splitlines())
                  if e["type"] == "startup" and e["phase"] == "import"]
    assert imports["since"] == "warm interpreter" and imports["label"] == "import (warm interpreter)"
    assert imports["duration_s"] < 1.0 and imports["warm_import_s"] == info["import_s"]
    assert "start-up: import (warm interpreter)" in (host.run_dir("warm") / "train.log").read_text()
    # Every phase from the launch to the first step, each a started (but import) and a done
    # event, the same forked as exec'd.
    phases = {run_id: [(e["phase"], e["state"], e.get("drafter")) for e in map(json.loads, (
        host.run_dir(run_id) / "events.jsonl").read_text().splitlines()) if e["type"] == "startup" and e["state"] != "alive"]
        for run_id in ("cold", "warm")}
    order = [(name, None) for name in ("find sources", "build data", "load target", "drafter weights", "plan shapes",
                                       "set up evaluator")]
    order += [("set up", 0), ("build train step", 0), ("set up", 1), ("build train step", 1)]  # one drafter at a time
    assert phases["warm"] == phases["cold"] == [("import", "done", None)] + [
        (name, state, drafter) for name, drafter in order for state in ("started", "done")]

    # `stop`: SIGTERM to its group; the trainer's handler ends it as an exec'd one ends.
    for run_id in ("cold", "warm"):
        host.agent("stop", "--run-id", run_id)
    assert host.exit_record("warm")["exit_code"] == host.exit_record("cold")["exit_code"] == 143
    assert host.warm_pids() == [info["pid"]]  # one, still serving


def build_event(host: Host, run_id: str) -> Dict[str, Any]:
    (build,) = [e for e in map(json.loads, (host.run_dir(run_id) / "events.jsonl").read_text().splitlines())
                if e["type"] == "startup" and e["phase"] == "build train step" and e["state"] == "done"]
    return build


@pytest.mark.timeout(900)
@pytest.mark.slow(seconds=60, why="an exec'd trainer compiling the step on CPU, then one forked by the warm interpreter")
def test_a_forked_trainer_builds_its_step_from_what_an_exec_d_one_compiled(host):
    config = host.config("compiled", compile="default", devices={"drafters": ["cpu"]}, optim={"max_steps": 2},
                         eval={"num_prompts": 0})
    host.launch("cold", config)
    assert host.exit_record("cold", timeout=600)["exit_code"] == 0, (host.run_dir("cold") / "train.log").read_text()
    host.ready()
    host.launch("warm", config)
    assert host.exit_record("warm", timeout=300)["exit_code"] == 0, (host.run_dir("warm") / "train.log").read_text()
    assert (host.record("cold")["started_by"], host.record("warm")["started_by"]) == ("exec", "warm")
    cold, warm = build_event(host, "cold"), build_event(host, "warm")
    assert cold["graphs_traced"] >= 1 and cold["graphs_loaded"] == 0
    # The compile cache the exec'd trainer filled serves the forked one: nothing traced or compiled.
    assert (warm["graphs_traced"], warm["graphs_loaded"]) == (0, cold["graphs_traced"]), warm
    assert warm["trace_s"] == 0 and warm["inductor_cache_misses"] == warm["autograd_cache_misses"] == 0, warm


@pytest.mark.slow(seconds=35, why=WHY)
def test_exit_codes_signals_env_and_the_warm_interpreter_killed_mid_run(host, tmp_path):
    exit3 = host.config("exit3", faults=[{"thread": "coordinator", "at": "startup", "kind": "exit", "code": 3}])
    other_ws = tmp_path / "other workspace"
    env_pair = ("--env", f"DFLASH_WORKSPACE={other_ws}")  # the warm interpreter starts with the launch's pairs
    host.launch("prime", exit3, *env_pair)
    assert host.exit_record("prime")["exit_code"] == 3
    info = host.ready()

    host.launch("exit3", exit3, *env_pair)
    assert host.record("exit3")["started_by"] == "warm"
    ended = host.exit_record("exit3")
    assert (ended["exit_code"], ended["signal"], ended["exec_error"]) == (3, None, None)

    hang = host.config("hang", faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    host.launch("killed", hang, *env_pair)
    host.first_step("killed")
    record = host.record("killed")
    assert record["started_by"] == "warm"
    # The --env pair reached it: the tiny target is cached under its $DFLASH_WORKSPACE (the
    # runs before it ended before building one).
    assert list((other_ws / CACHE_DIR).glob("tiny-*")), sorted(other_ws.rglob("*"))
    os.kill(info["pid"], signal.SIGKILL)  # the warm interpreter dies mid-run: the run goes on
    time.sleep(0.5)
    assert procfs.identity_alive(record["pid"], record["start_time"])
    os.kill(record["pid"], signal.SIGKILL)
    ended = host.exit_record("killed")
    assert (ended["exit_code"], ended["signal"], ended["oom_killed"]) == (None, "SIGKILL", False)
    state = host.agent("status", "--run-id", "killed")["runs"][0]["state"]
    assert state == "FAILED"


@pytest.mark.slow(seconds=40, why=WHY)
def test_a_dead_warm_interpreter_is_an_exec_with_the_reason_and_is_replaced(host):
    exit3 = host.config("exit3", faults=[{"thread": "coordinator", "at": "startup", "kind": "exit", "code": 3}])
    host.launch("prime", exit3)
    host.exit_record("prime")
    first = host.ready()
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not procfs.identity_alive(first["pid"], first["start_time"]), 10.0, "it to die")

    host.launch("after-kill", exit3)
    record = host.record("after-kill")
    assert record["started_by"] == "exec"
    assert record["warm_reason"].startswith("the warm interpreter is gone (")
    assert host.exit_record("after-kill")["exit_code"] == 3
    assert "not using the warm interpreter: the warm interpreter is gone" in (host.run_dir("after-kill") / "agent.log").read_text()
    assert host.ready()["pid"] != first["pid"]


def torch_overlay(root: Path) -> Path:
    """A folder for PYTHONPATH whose `torch` package is the real one, entry by entry
    (symlinks), but for its version file, a copy that a test may rewrite: a torch
    "upgraded" under a process that imported it. Nothing of the real one is written to:
    __pycache__ is a folder of links without version's."""
    real = Path(torch.__file__).parent
    package = root / "torch"
    package.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name == "version.py":
            shutil.copy2(entry, package / entry.name)
        elif entry.name == "__pycache__":
            (package / entry.name).mkdir()
            for compiled in entry.iterdir():
                if not compiled.name.startswith("version."):
                    os.symlink(compiled, package / entry.name / compiled.name)
        else:
            os.symlink(entry, package / entry.name)
    return root


@pytest.mark.slow(seconds=40, why=WHY + "; two of them")
def test_a_torch_upgraded_under_it_is_never_forked_and_a_fresh_one_serves_the_next_launch(host, tmp_path):
    host.env["PYTHONPATH"] = str(torch_overlay(tmp_path / "site"))
    version_file = tmp_path / "site" / "torch" / "version.py"
    exit3 = host.config("exit3", faults=[{"thread": "coordinator", "at": "startup", "kind": "exit", "code": 3}])
    host.launch("prime", exit3)
    host.exit_record("prime")
    stale = host.ready()
    assert stale["torch"]["path"] == str(version_file)

    # A new build of the same size whose installer kept the file's mtime: only its text
    # (the build's git commit) says it is another torch.
    stamp = version_file.stat()
    text = version_file.read_text()
    commit = text.split("git_version = '", 1)[1][:40]
    version_file.write_text(text.replace(commit, commit[::-1]))
    os.utime(version_file, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert version_file.stat().st_size == stamp.st_size

    host.launch("upgraded", exit3)
    record = host.record("upgraded")
    assert record["started_by"] == "exec"
    assert record["warm_reason"] == ("the warm interpreter refused: %s (%s is not the file it imported)"
                                     % (trainer_warm.WHY_TORCH_CHANGED, version_file))
    assert host.exit_record("upgraded")["exit_code"] == 3
    wait_until(lambda: not procfs.identity_alive(stale["pid"], stale["start_time"]), 30.0, "the stale one to exit")
    log = (Path(host.place().dir) / "warm.log").read_text()
    assert "warm[%d]: refused a run: %s" % (stale["pid"], trainer_warm.WHY_TORCH_CHANGED) in log

    fresh = host.ready()
    assert fresh["pid"] != stale["pid"]
    assert fresh["torch"]["sha256"] == hashlib.sha256(version_file.read_bytes()).hexdigest() != stale["torch"]["sha256"]
    host.launch("after", exit3)
    assert (host.record("after")["started_by"], host.record("after")["warm_reason"]) == ("warm", None)
    assert host.exit_record("after")["exit_code"] == 3
    assert host.warm_pids() == [fresh["pid"]]


@pytest.mark.slow(seconds=30, why=WHY)
def test_a_new_release_gets_its_own_and_the_old_one_exits(host):
    exit3 = host.config("exit3", faults=[{"thread": "coordinator", "at": "startup", "kind": "exit", "code": 3}])
    host.launch("a", exit3)
    host.exit_record("a")
    old = host.ready("rel-a")
    host.release("rel-b")  # a deploy: `current` moves on
    host.launch("b", exit3)
    record = host.record("b")
    assert (record["release_id"], record["started_by"]) == ("rel-b", "exec")
    wait_until(lambda: "ended those of releases rel-a" in (host.run_dir("b") / "agent.log").read_text(), 30.0,
               "rel-b's launch to end rel-a's warm interpreter")
    wait_until(lambda: not procfs.identity_alive(old["pid"], old["start_time"]), 30.0, "rel-a's to exit")
    new = host.ready("rel-b")
    assert new["release_dir"].endswith("rel-b") and host.warm_pids() == [new["pid"]]


@pytest.mark.slow(seconds=30, why=WHY)
def test_two_launches_at_once_start_one_warm_interpreter(host):
    exit3 = host.config("exit3", faults=[{"thread": "coordinator", "at": "startup", "kind": "exit", "code": 3}])
    threads = [threading.Thread(target=host.launch, args=(f"r{i}", exit3)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(3):
        host.exit_record(f"r{i}")
    info = host.ready()
    time.sleep(1.0)  # a second one would have taken its lock by now (before its imports)
    assert host.warm_pids() == [info["pid"]]
    log = (Path(host.place().dir) / "warm.log").read_text()
    assert log.count("ready: imports took") == 1, log


def test_the_run_time_variables_are_the_same_on_both_sides():
    assert agent_warm.RUN_TIME_ENV == trainer_warm.RUN_TIME_ENV


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_bad_idle_timeout_is_the_launchs_usage_error(host, value):
    done = subprocess.run([sys.executable, str(host.ws / "current" / "remote" / "agent.py"), "--workspace", str(host.ws),
                           "launch", "--run-id", "r", "--config", str(host.config("c")), "--env",
                           f"DFLASH_WARM_IDLE_S={value}"], capture_output=True, env=host.env, timeout=120)
    reply = json.loads(done.stdout)
    assert done.returncode != 0 and reply["kind"] == "usage", reply
    assert f"DFLASH_WARM_IDLE_S={value!r}" in reply["error"] and "--env" in reply["error"]
    assert not host.run_dir("r").exists()


@pytest.mark.slow(seconds=35, why=WHY + "; 10 s of waiting for the hung one")
def test_a_hung_warm_interpreter_is_an_exec_and_is_killed_and_replaced(host):
    exit3 = host.config("exit3", faults=[{"thread": "coordinator", "at": "startup", "kind": "exit", "code": 3}])
    host.launch("prime", exit3)
    host.exit_record("prime")
    hung = host.ready()
    os.kill(hung["pid"], signal.SIGSTOP)  # it accepts no connection and answers nothing
    began = time.monotonic()
    host.launch("after-hang", exit3)
    waited_s = time.monotonic() - began
    record = host.record("after-hang")
    assert record["started_by"] == "exec"
    assert record["warm_reason"] == "the warm interpreter did not answer before forking within 10 s (hung)"
    assert waited_s >= agent_warm.REPLY_TIMEOUT_S
    assert host.exit_record("after-hang")["exit_code"] == 3
    wait_until(lambda: not procfs.identity_alive(hung["pid"], hung["start_time"]), 30.0, "the hung one to be killed")
    assert host.ready()["pid"] != hung["pid"]


@pytest.mark.slow(seconds=25, why=WHY + ", through sshd (and the fake pct)")
@pytest.mark.parametrize("host_name", ["node", "ct200"])
def test_over_ssh_and_pct_a_launch_is_forked_by_it_and_fails_as_an_exec_does(host_name, make_inventory, fake_pve,
                                                                              tmp_path):
    """Over the ssh and pct transports, launched by the CLI: the second launch is forked
    (through a pct exec of its own, in another mount namespace than the first's, which
    started the warm interpreter) and fails as the first, exec'd, did."""
    hosts = make_inventory(tmp_path, **{host_name: {"env": dict(HOST_ENV, DFLASH_WARM_IDLE_S=IDLE_S)}})
    if host_name == "node":
        workspace = on_node = tmp_path / "node ws"
    else:
        workspace, on_node = container_workspace(fake_pve, tmp_path), workspace_on_node(fake_pve, tmp_path)
    config = small_config(tmp_path / "raise.yaml",
                          faults=[{"thread": "coordinator", "at": "startup", "kind": "raise", "depth": 12}])
    runs: List[str] = []

    def dflash(*args: str):
        return dflash_in_process("--logs-dir", str(tmp_path / "logs"), *args, hosts=hosts)

    try:
        for _ in range(2):
            launched = dflash("launch", host_name, "--config", str(config))
            assert launched.returncode == 0, launched.stderr
            runs.append(launched.stdout.strip())
            watch = dflash("watch", runs[-1], "--host", host_name)
            assert watch.returncode == 1 and f"run {runs[-1]} on {host_name} ended: FAILED" in watch.stderr, watch.stderr
            assert "_descend_" in watch.stdout  # the traceback, shown
            if len(runs) == 1:
                wait_until(lambda: any((agent_warm.read_info(agent_warm.Place(str(folder))) or {}).get("state") == "ready"
                                       for folder in (on_node / "warm").iterdir()), 120.0, "the warm interpreter")
        (exec_run, warm_run) = [on_node / "runs" / run_id for run_id in runs]
        records = [json.loads((run / "run.json").read_text()) for run in (exec_run, warm_run)]
        assert [r["started_by"] for r in records] == ["exec", "warm"], [r["warm_reason"] for r in records]
        assert str(workspace) in records[1]["release_dir"]
        ends = [json.loads((run / "exit.json").read_text()) for run in (exec_run, warm_run)]
        assert [(e["exit_code"], e["signal"], e["exec_error"]) for e in ends] == [(1, None, None)] * 2
        errors = [[json.loads(line) for line in (run / "errors.jsonl").read_text().splitlines()]
                  for run in (exec_run, warm_run)]
        assert [(r["thread"], r["phase"], r["traceback"]) for r in errors[1]] == \
            [(r["thread"], r["phase"], r["traceback"]) for r in errors[0]]
        assert errors[1][0]["traceback"].count(", in _descend_") >= 12
    finally:
        for run_id in runs:
            kill_run(on_node / "runs" / run_id)
        kill_warm(workspace)
