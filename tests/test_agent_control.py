"""`stop`, `stacks`, `report`, `status`, `info`, and the JSON-only stdout contract."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from importlib import metadata

import pytest

from dflash_files import procfs
from support.old_python import old_python_problems
from support.wait import wait_until
from support_agent.harness import REPO
from support_agent.harness import agent  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

NEVER = {"wait_file": "never"}


def ready(agent, run_id):
    wait_until(lambda: (agent.run_dir(run_id) / "ready").exists(), what="%s to be ready" % run_id)


def sleeper_pid(agent, run_id):
    wait_until(lambda: (agent.run_dir(run_id) / "sleeper.json").exists())
    return agent.read(run_id, "sleeper.json")["pid"]


def test_stop_escalates_to_sigkill_and_returns_only_when_the_group_is_gone(agent):
    # SIG_IGN is inherited: the sleeper child ignores SIGTERM too.
    answer = agent.launch("stubborn", [{"ignore_sigterm": True}, {"spawn_sleeper": True},
                                       {"heartbeat": 1}, {"touch": "ready"}, NEVER])
    ready(agent, "stubborn")
    sleeper = sleeper_pid(agent, "stubborn")
    assert procfs.read_stat(sleeper).pgrp == answer["pgid"]
    started = time.monotonic()
    result = agent.ok("stop", "--run-id", "stubborn", "--grace", "0.5")
    assert time.monotonic() - started >= 0.5
    assert result == {"run_id": "stubborn", "state": "STOPPED", "killed": True}
    assert procfs.group_members(answer["pgid"]) == []
    assert not procfs.is_running(procfs.read_stat(sleeper))
    assert agent.read("stubborn", "exit.json")["signal"] == "SIGKILL"
    assert agent.read("stubborn", "stop_requested.json")["grace_s"] == 0.5


def test_stop_of_a_polite_run_needs_no_sigkill(agent):
    answer = agent.launch("polite", [{"spawn_sleeper": True}, {"touch": "ready"}, NEVER])
    ready(agent, "polite")
    sleeper = sleeper_pid(agent, "polite")
    assert agent.ok("stop", "--run-id", "polite", "--grace", "30") == {
        "run_id": "polite", "state": "STOPPED", "killed": False}
    assert procfs.group_members(answer["pgid"]) == [] and not procfs.is_running(procfs.read_stat(sleeper))
    assert agent.read("polite", "exit.json")["signal"] == "SIGTERM"
    assert agent.status("polite")["state"] == "STOPPED"


def test_stop_of_an_ended_run_changes_nothing(agent):
    agent.launch("ended", [])
    agent.wait_state("ended", "SUCCEEDED")
    assert agent.ok("stop", "--run-id", "ended") == {"run_id": "ended", "state": "SUCCEEDED", "killed": False}
    assert not (agent.run_dir("ended") / "stop_requested.json").exists()
    assert agent.status("ended")["state"] == "SUCCEEDED"


def test_stop_never_signals_a_reused_pid(agent):
    # run.json names this test process with another start time: the pid was reused.
    agent.fabricate_run("reused", pgid=os.getpgid(0), start_time=procfs.start_time(os.getpid()) - 1)
    assert agent.ok("stop", "--run-id", "reused")["state"] == "LOST"
    assert procfs.is_running(procfs.read_stat(os.getpid()))  # still here to check


def dump_headers(text):
    return [line for line in text.splitlines() if line.startswith("=== stacks of every thread: ")]


def test_stacks_dumps_every_thread_by_name(agent):
    agent.launch("hang", [{"faulthandler": True}, {"thread": "drafter-1"}, {"heartbeat": 1},
                          {"touch": "ready"}, NEVER])
    ready(agent, "hang")
    first = agent.ok("stacks", "--run-id", "hang")["text"]
    assert "drafter_waits_here" in first and first.lower().count("thread 0x") >= 2
    # faulthandler names threads by ident only; threads.json turns that into the name.
    (drafter,) = [block for block in first.split("\n\n") if "drafter_waits_here" in block]
    assert re.match(r"Thread 0x[0-9a-f]+ \[drafter-1\] \(most recent call first\):", drafter), drafter
    assert re.search(r"^(Current thread|Thread) 0x[0-9a-f]+ \[MainThread\]", first, re.MULTILINE), first
    second = agent.ok("stacks", "--run-id", "hang")["text"]
    assert "drafter_waits_here" in second and second.lower().count("thread 0x") == first.lower().count("thread 0x")
    faulthandler_log = (agent.run_dir("hang") / "faulthandler.log").read_text()
    # Each dump follows its header line, and each answer holds only its own dump.
    assert len(dump_headers(faulthandler_log)) == 2
    unnamed = re.sub(r" \[[^\]]+\]", "", first + second)
    assert re.sub(r"^=== .*\n", "", faulthandler_log, flags=re.MULTILINE) == unnamed
    report = agent.ok("report", "--run-id", "hang")
    assert report["last_stacks"] == dump_headers(faulthandler_log)[1] + "\n" + second
    assert agent.status("hang")["state"] == "RUNNING"


def test_stacks_refuses_when_sigusr1_would_kill_the_trainer(agent):
    answer = agent.launch("nohandler", [{"touch": "ready"}, NEVER])
    ready(agent, "nohandler")
    result = agent.run("stacks", "--run-id", "nohandler")
    assert (result.rc, result.json["kind"]) == (2, "conflict")
    assert "SIGUSR1" in result.json["error"]
    assert procfs.identity_alive(answer["pid"], None)
    agent.ok("stop", "--run-id", "nohandler")
    result = agent.run("stacks", "--run-id", "nohandler")
    assert (result.rc, result.json["kind"]) == (2, "conflict") and "not running" in result.json["error"]


def test_report_has_everything_fetch_traceback_needs(agent):
    agent.launch("failed", [{"faulthandler": True}, {"lines": {"count": 50, "width": 5}},
                            {"error": {"thread": "drafter-1", "message": "boom"}},
                            {"error": {"thread": "coordinator", "message": "drafter-1 failed"}},
                            {"kill_self": "SIGABRT"}], "--name", "rep")
    assert agent.wait_state("failed", "FAILED")["reason"] == "RuntimeError: boom"  # the root cause's
    report = agent.ok("report", "--run-id", "failed", "--log-lines", "3")
    assert report["run_id"] == "failed" and report["state"] == "FAILED"
    assert report["run"] == agent.read("failed", "run.json")
    assert report["exit"]["signal"] == "SIGABRT"
    lines = (agent.run_dir("failed") / "errors.jsonl").read_text().splitlines()
    assert report["errors"] == [json.loads(line) for line in lines]
    assert [e["thread"] for e in report["errors"]] == ["drafter-1", "coordinator"]  # root cause first
    assert "Fatal Python error: Aborted" in report["faulthandler"]
    assert report["last_stacks"].startswith("Fatal Python error: Aborted")  # the crash's own dump
    assert report["log_tail"] == "".join("line %06d xxxxx\n" % i for i in (47, 48, 49))
    assert report["agent_error"] is None  # the supervisor had none


def test_status_lists_runs_newest_first(agent):
    for run_id in ("first", "second", "third"):
        agent.launch(run_id, [], "--name", "name of " + run_id)
        agent.wait_state(run_id, "SUCCEEDED")
    runs = agent.ok("status")["runs"]
    assert [r["run_id"] for r in runs] == ["third", "second", "first"]
    assert set(runs[0]) == {"run_id", "name", "state", "reason", "pid", "started_at", "ended_at", "exit", "errors",
                            "last_heartbeat", "release_id", "source", "overrides", "step", "attempt", "attempts",
                            "resume_step", "checkpoint_step", "startup", "startup_elapsed_s", "peer_failure"}
    assert runs[0]["reason"] is None  # a success has none
    assert runs[0]["name"] == "name of third"
    result = agent.run("status", "--run-id", "missing")
    assert (result.rc, result.json["kind"]) == (2, "not_found")


def test_info_reads_versions_without_importing_torch(agent):
    result = agent.run("info", env=dict(agent.env, PYTHONPROFILEIMPORTTIME="1"))
    assert result.rc == 0
    info = result.json
    assert info["packages"] == {"torch": metadata.version("torch"),
                                "transformers": metadata.version("transformers")}
    assert info["boot_id"] == procfs.boot_id() and info["gpus"] == []
    assert info["current_release"] == "rel-0001" and info["python"]
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "dflash_agent.gpus" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "transformers")]


@pytest.mark.parametrize("verb", [None, "launch", "status", "stop", "stacks", "report", "gpus",
                                  "info", "follow"])
def test_help_goes_to_stderr(agent, verb):
    argv = agent.argv(*([verb] if verb else []), "--help")
    done = subprocess.run(argv, capture_output=True, env=agent.env, timeout=30)
    assert done.returncode == 0 and done.stdout == b""
    assert b"usage:" in done.stderr


@pytest.mark.parametrize("args, text", [
    ([], "required"),
    (["dance"], "invalid choice"),
    (["stop"], "--run-id"),
    (["stop", "--run-id", "x", "--grace", "soon"], "invalid"),
    (["follow", "--run-id", "x", "--offset", "-1"], ">= 0"),
    (["report", "--run-id", "../etc"], "invalid run id"),
])
def test_usage_errors_are_json_on_stdout(agent, args, text):
    result = agent.run(*args)
    assert result.rc == 2 and result.json["kind"] == "usage" and text in result.json["error"], result.json


@pytest.mark.parametrize("package, may_import", [
    ("dflash_agent", {"dflash_agent", "dflash_contract", "dflash_files"}),
    # the agent imports them: the agent's rules; they lean on neither half
    ("dflash_contract", {"dflash_contract"}),
    ("dflash_files", {"dflash_files"}),
])
def test_agent_is_stdlib_only_and_python38_syntax(package, may_import):
    sources = sorted((REPO / "remote" / package).rglob("*.py"))
    sources += [REPO / "remote" / "agent.py"] if package == "dflash_agent" else []
    problems = [problem for path in sources for problem in old_python_problems(
        path.read_text(), f"{path.parent.name}/{path.name}", packages=frozenset(may_import), relative_imports=True)]
    assert sources and problems == []


def test_stacks_and_stop_of_unknown_runs(agent):
    for verb in ("stacks", "stop", "report"):
        result = agent.run(verb, "--run-id", "ghost")
        assert (result.rc, result.json["kind"]) == (2, "not_found")
