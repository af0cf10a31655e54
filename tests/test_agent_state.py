"""Run-state derivation: the pure function on its own, reading files from their end, and
every state reached by real runs of the agent with the stand-in trainer."""
from __future__ import annotations

import json
import os
import random
import signal

import pytest

from dflash_agent import attempts, jsonio, resume
from dflash_contract.records import ExitRecord
from dflash_contract.states import RunState
from dflash_files import procfs
from dflash_agent.layout import RunDir
from dflash_agent.state import (ALIVE, ENDING, GONE, EventSummary, Observation, derive_state, read_record,
                                 summarize_events)
from support_agent.harness import agent  # noqa: F401  (fixture)
from support_agent.harness import dead_pid
from support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

NOW = 1_000_000.0


def obs(**kw):
    base = dict(started_at=NOW - 10, stall_after=60.0, startup_stall_after=90.0, now=NOW, trainer=ALIVE)
    base.update(kw)
    if base.get("exit") is not None:  # exit.json's keys that decide the state, the rest as the supervisor writes them
        base["exit"] = ExitRecord(**{"oom_killed": False, "ended_at": NOW, "exec_error": None, **base["exit"]})
    return Observation(**base)


def beat(age, step=5, **kw):
    return EventSummary(last_event_ts=NOW - age, last_heartbeat=NOW - age, step=step, **kw)


@pytest.mark.parametrize("observation, expected", [
    (obs(trainer=GONE, exit={"exit_code": 0, "signal": None}), RunState.SUCCEEDED),
    (obs(trainer=GONE, exit={"exit_code": 0, "signal": None}, error_count=1), RunState.FAILED),
    (obs(trainer=GONE, exit={"exit_code": 3, "signal": None}), RunState.FAILED),
    (obs(trainer=GONE, exit={"exit_code": None, "signal": "SIGKILL"}), RunState.FAILED),
    (obs(trainer=GONE, exit={"exit_code": None, "signal": "SIGTERM"}, stop_requested=True), RunState.STOPPED),
    (obs(trainer=GONE, exit={"exit_code": 0, "signal": None}, stop_requested=True), RunState.STOPPED),
    (obs(trainer=GONE), RunState.LOST),
    (obs(trainer=GONE, stop_requested=True), RunState.STOPPED),
    # No exit.json and no process left (the supervisor was killed): what the run itself
    # recorded decides; LOST only when nothing was recorded.
    (obs(trainer=GONE, error_count=2), RunState.FAILED),
    (obs(trainer=GONE, events=beat(5, done={"type": "done", "exit_code": 0})), RunState.SUCCEEDED),
    (obs(trainer=GONE, events=beat(5, done={"type": "done", "exit_code": 1})), RunState.FAILED),
    (obs(trainer=GONE, events=beat(5, done={"type": "done", "exit_code": 0}), error_count=1), RunState.FAILED),
    (obs(trainer=GONE, events=beat(5, done={"type": "done", "exit_code": 143}), stop_requested=True), RunState.STOPPED),
    # exit.json, when there, wins over the trainer's own record.
    (obs(trainer=GONE, exit={"exit_code": None, "signal": "SIGKILL"},
         events=beat(5, done={"type": "done", "exit_code": 0})), RunState.FAILED),
    (obs(events=beat(1, done={"type": "done", "exit_code": 0})), RunState.RUNNING),  # about to exit
    (obs(), RunState.STARTING),
    (obs(events=EventSummary(last_event_ts=NOW - 1, last_phase="startup", last_phase_ts=NOW - 1)), RunState.STARTING),
    # Start-up has a limit of its own (a working one says so with its `alive` events).
    (obs(started_at=NOW - 100), RunState.STALLED),  # start-up silent for longer than startup_stall_after
    (obs(started_at=NOW - 80), RunState.STARTING),  # longer than stall_after, not than startup_stall_after
    # a "ready" or "alive" event
    (obs(started_at=NOW - 100, events=EventSummary(last_event_ts=NOW - 5)), RunState.STARTING),
    (obs(events=EventSummary(last_event_ts=NOW - 2, last_phase="train", last_phase_ts=NOW - 2)), RunState.RUNNING),
    (obs(events=beat(1)), RunState.RUNNING),
    (obs(events=beat(61)), RunState.STALLED),
    (obs(events=beat(61), error_count=1), RunState.DEGRADED),
    (obs(events=beat(1), error_count=1), RunState.DEGRADED),
    (obs(events=beat(1), stop_requested=True), RunState.RUNNING),  # stop in progress
    (obs(trainer=ENDING, events=beat(1)), RunState.RUNNING),  # exit.json is being written
    (obs(trainer=ENDING, events=beat(1), error_count=1), RunState.DEGRADED),
    # A process stopped by a signal (SIGSTOP) or a debugger makes no progress, however
    # fresh its last heartbeat; a failure recorded meanwhile is still seen once it ends.
    (obs(events=beat(1), frozen=True), RunState.STALLED),
    (obs(frozen=True), RunState.STALLED),
    (obs(events=beat(1), frozen=True, error_count=1), RunState.STALLED),
])
def test_derive_state(observation, expected):
    assert derive_state(observation) == expected


def naive_tail_start(data: bytes, n: int) -> int:
    lines = data.splitlines(keepends=True)
    if n <= 0:
        return len(data)
    return len(b"".join(lines[:max(0, len(lines) - n)]))


def test_tail_start_and_lines_backwards_match_a_naive_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonio, "BLOCK", 7)  # many block boundaries inside lines
    rng = random.Random(4)
    path = tmp_path / "f"
    for case in range(200):
        parts = [b"x" * rng.randint(0, 20) for _ in range(rng.randint(0, 12))]
        data = b"\n".join(parts) + (b"\n" if rng.random() < 0.5 else b"")
        path.write_bytes(data)
        for n in (0, 1, 2, 5, 50):
            assert jsonio.tail_start(str(path), n) == naive_tail_start(data, n), (case, data, n)
        complete = data[:data.rfind(b"\n") + 1].split(b"\n")[:-1] if b"\n" in data else []
        assert list(jsonio.lines_backwards(str(path))) == complete[::-1], (case, data)


def test_summarize_events_reads_back_to_the_last_heartbeat(tmp_path):
    path = tmp_path / "events.jsonl"
    events = [{"ts": 1.0, "type": "phase", "phase": "startup"}, {"ts": 2.0, "type": "ready"},
              {"ts": 3.0, "type": "phase", "phase": "train"}, {"ts": 4.0, "type": "step", "step": 1},
              {"ts": 5.0, "type": "heartbeat", "step": 2}, {"ts": 6.0, "type": "phase", "phase": "eval"},
              {"ts": 7.0, "type": "eval", "step": 2}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"ts": 8.0, "type": "hea')
    assert summarize_events(str(path)) == EventSummary(
        last_event_ts=7.0, last_phase="eval", last_phase_ts=6.0, last_heartbeat=5.0, step=2)
    path.write_text("".join(json.dumps(e) + "\n" for e in events[:3]))
    assert summarize_events(str(path)) == EventSummary(last_event_ts=3.0, last_phase="train", last_phase_ts=3.0)
    done = {"ts": 8.0, "type": "done", "exit_code": 0}
    path.write_text("".join(json.dumps(e) + "\n" for e in events + [done]))
    assert summarize_events(str(path)) == EventSummary(
        last_event_ts=8.0, last_phase="eval", last_phase_ts=6.0, last_heartbeat=5.0, step=2, done=done)
    assert summarize_events(str(tmp_path / "missing")) == EventSummary()


def test_summarize_events_names_the_start_up_phase_under_way(tmp_path):
    path = tmp_path / "events.jsonl"
    compiling = {"ts": 3.0, "type": "startup", "phase": "build train step", "state": "started",
                 "label": "build train step drafter 0 (cold)", "drafter": 0}
    events = [{"ts": 1.0, "type": "phase", "phase": "startup"},
              {"ts": 2.0, "type": "startup", "phase": "load target", "state": "done", "label": "load target"},
              compiling]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert summarize_events(str(path)).startup == "build train step drafter 0 (cold)"
    ended = {**compiling, "ts": 4.0, "state": "done", "duration_s": 1.0}
    path.write_text("".join(json.dumps(e) + "\n" for e in events + [ended]))
    assert summarize_events(str(path)).startup is None  # between phases: none under way
    path.write_text("".join(json.dumps(e) + "\n" for e in [compiling, {"ts": 5.0, "type": "step", "step": 1}]))
    assert summarize_events(str(path)).startup is None


def test_summarize_events_stops_at_the_latest_attempts_marker(tmp_path):
    # Attempt 0 ran, failed and wrote `done`; attempt 1 has started but reported nothing yet.
    path = tmp_path / "events.jsonl"
    events = [{"ts": 1.0, "type": "phase", "phase": "train"}, {"ts": 2.0, "type": "step", "step": 30},
              {"ts": 3.0, "type": "done", "exit_code": 1},
              {"ts": 4.0, "type": "attempt", "attempt": 1, "reason": "restart", "resume_step": 20}]
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert summarize_events(str(path)) == EventSummary(last_event_ts=4.0)  # no done, no heartbeat of attempt 0
    path.write_text("".join(json.dumps(e) + "\n" for e in events + [{"ts": 5.0, "type": "step", "step": 21}]))
    assert summarize_events(str(path)) == EventSummary(last_event_ts=5.0, last_heartbeat=5.0, step=21)


def test_an_attempt_marker_after_a_torn_last_line_still_counts(tmp_path):
    run = RunDir("r", str(tmp_path))
    (tmp_path / "events.jsonl").write_text('{"ts": 1.0, "type": "heartbeat", "step": 4}\n{"ts": 2.0, "type": "hea')
    (tmp_path / "train.log").write_text("2026-11-30T00:00:00.000 [drafter-0] step 4/9 lo")
    attempts.append_markers(run, 1, "resume", 4, "rel")
    summary = summarize_events(str(tmp_path / "events.jsonl"))
    assert summary.last_heartbeat is None and summary.last_event_ts is not None
    last = (tmp_path / "train.log").read_text().splitlines()[-1]
    assert last.endswith("[supervisor] === attempt 1 (resume): from its checkpoint at step 4, release rel ===")


@pytest.mark.timeout(20)
def test_summarize_events_cost_does_not_depend_on_the_file_size(tmp_path):
    # 256 GiB of holes before the last events: reading it from the start would take minutes.
    path = tmp_path / "events.jsonl"
    with open(path, "wb") as handle:
        handle.truncate(256 << 30)
        handle.seek(0, os.SEEK_END)
        handle.write(b'\n{"ts": 9.0, "type": "heartbeat", "step": 77}\n')
    assert summarize_events(str(path)).step == 77


def test_lost_when_pid_is_gone_or_reused_or_the_host_rebooted(agent):
    gone = dead_pid()
    agent.fabricate_run("gone", pid=gone, pgid=gone, supervisor={"pid": gone, "start_time": 1})
    # Our own pid stands in for a reused one: alive, but not the process that was started.
    agent.fabricate_run("reused", start_time=procfs.start_time(os.getpid()) - 1)
    agent.fabricate_run("rebooted", boot_id="00000000-0000-0000-0000-000000000000")
    agent.fabricate_run("alive")  # control: the very process, same boot
    states = {r["run_id"]: r["state"] for r in agent.ok("status")["runs"]}
    assert states == {"gone": RunState.LOST, "reused": RunState.LOST, "rebooted": RunState.LOST,
                      "alive": RunState.STARTING}


def test_starting_running_stalled_and_back(agent):
    # stall_after 2 s (startup_stall_after 3 s): each state outlasts a few `status` polls
    # (a Python start each) on a loaded machine, so none is missed.
    agent.launch("s", [{"wait_file": "go1"}, {"event": {"type": "phase", "phase": "startup"}},
                       {"wait_file": "go2"}, {"heartbeat": 1}, {"wait_file": "go3"},
                       {"heartbeat": 2}, {"wait_file": "go4"}], "--stall-after", "2", "--startup-stall-after", "3")
    assert agent.status("s")["state"] == RunState.STARTING  # no event yet
    agent.touch("s", "go1")
    # Start-up silent beyond startup_stall_after counts as stalled (a hang at start-up).
    agent.wait_state("s", RunState.STALLED)
    agent.touch("s", "go2")
    status = agent.wait_state("s", RunState.RUNNING)
    assert status["step"] == 1 and status["last_heartbeat"] is not None
    status = agent.wait_state("s", RunState.STALLED)
    assert status["step"] == 1
    agent.touch("s", "go3")
    assert agent.wait_state("s", RunState.RUNNING)["step"] == 2
    agent.touch("s", "go4")
    assert agent.wait_state("s", RunState.SUCCEEDED)["exit"]["exit_code"] == 0


def test_degraded_then_failed_although_the_process_exited_0(agent):
    agent.launch("d", [{"heartbeat": 1}, {"error": {"thread": "drafter-1"}}, {"wait_file": "go"}])
    status = agent.wait_state("d", RunState.DEGRADED)
    assert status["errors"] == 1 and status["exit"] is None
    agent.touch("d", "go")
    status = agent.wait_state("d", RunState.FAILED)
    assert status["exit"]["exit_code"] == 0 and status["errors"] == 1


def kill_supervisor(agent, run_id):
    supervisor = agent.read(run_id, "run.json")["supervisor"]
    assert procfs.identity_alive(supervisor["pid"], supervisor["start_time"])
    os.kill(supervisor["pid"], signal.SIGKILL)
    wait_until(lambda: not procfs.identity_alive(supervisor["pid"], supervisor["start_time"]))


DONE_0 = {"event": {"type": "done", "exit_code": 0}}  # as the real trainer's last act


def test_a_run_whose_supervisor_died_ends_as_the_trainer_recorded(agent):
    agent.launch("ok", [{"heartbeat": 1}, {"touch": "beat"}, {"wait_file": "go"}, DONE_0])
    agent.launch("failed", [{"heartbeat": 1}, {"touch": "beat"}, {"wait_file": "go"},
                            {"error": {"thread": "drafter-0"}},
                            {"event": {"type": "done", "exit_code": 1}}, {"exit": 1}])
    agent.launch("crashed", [{"heartbeat": 1}, {"touch": "beat"}, {"wait_file": "go"},
                             {"error": {"thread": "drafter-0"}}, {"kill_self": "SIGKILL"}])
    for run_id in ("ok", "failed", "crashed"):
        wait_until(lambda: (agent.run_dir(run_id) / "beat").exists())
        kill_supervisor(agent, run_id)
        assert agent.status(run_id)["state"] == RunState.RUNNING  # the trainer goes on
    follow = agent.follow("ok", "--gpu-interval", "0")
    for run_id in ("ok", "failed", "crashed"):
        agent.touch(run_id, "go")
    status = agent.wait_state("ok", RunState.SUCCEEDED, RunState.FAILED, RunState.LOST)
    assert (status["state"], status["exit"]) == (RunState.SUCCEEDED, None)
    assert status["ended_at"] is not None  # from the trainer's own record
    ended = (RunState.SUCCEEDED, RunState.FAILED, RunState.LOST)
    assert agent.wait_state("failed", *ended)["state"] == RunState.FAILED
    # Killed without a word of its own, but a thread had recorded its failure.
    assert agent.wait_state("crashed", *ended)["state"] == RunState.FAILED
    # follow ends although no supervisor is left to write exit.json.
    end = follow.rest()[-1]
    assert (end["t"], end["state"], end["exit"]) == ("end", RunState.SUCCEEDED, None)
    assert not any((agent.run_dir(r) / "exit.json").exists() for r in ("ok", "failed", "crashed"))


def test_stop_works_when_the_supervisor_is_gone(agent):
    answer = agent.launch("orphan", [{"heartbeat": 1}, {"touch": "beat"}, {"wait_file": "never"}])
    wait_until(lambda: (agent.run_dir("orphan") / "beat").exists())
    kill_supervisor(agent, "orphan")
    assert agent.ok("stop", "--run-id", "orphan", "--grace", "5") == {
        "run_id": "orphan", "state": RunState.STOPPED, "killed": False}
    assert procfs.group_members(answer["pgid"]) == []


def test_trainer_outliving_its_supervisor_is_running_then_lost(agent):
    agent.launch("orphan", [{"heartbeat": 1}, {"touch": "beat"}, {"wait_file": "go"}])
    wait_until(lambda: (agent.run_dir("orphan") / "beat").exists())
    supervisor = agent.read("orphan", "run.json")["supervisor"]
    assert procfs.identity_alive(supervisor["pid"], supervisor["start_time"])
    os.kill(supervisor["pid"], signal.SIGKILL)
    wait_until(lambda: not procfs.identity_alive(supervisor["pid"], supervisor["start_time"]))
    assert agent.status("orphan")["state"] == RunState.RUNNING
    agent.touch("orphan", "go")  # the trainer ends without a record; nobody writes exit.json
    status = agent.wait_state("orphan", RunState.LOST)
    assert status["exit"] is None
    assert not (agent.run_dir("orphan") / "exit.json").exists()


def test_a_resume_that_started_nothing_knows_run_json_as_it_read_it_even_of_an_older_release(agent):
    # The keys of the first release only: a failed resume must still see its run.json as
    # unchanged (and drop the locks it took), though this release would write more keys.
    run_dir = agent.fabricate_run("old")
    run = RunDir("old", str(run_dir))
    record = read_record(run)
    assert resume.still_recorded(run, record)
    written = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**written, "pid": dead_pid(), "attempt": 1}))  # a new attempt's
    assert not resume.still_recorded(run, record)
    (run_dir / "run.json").write_text(json.dumps(written)[:40])  # torn: whose it is cannot be told
    assert not resume.still_recorded(run, record)
    (run_dir / "run.json").unlink()
    assert not resume.still_recorded(run, record)
