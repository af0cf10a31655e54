"""Runs that survive: `dflash resume` continues a stopped, failed or lost run as a new
attempt of the same run id, and the supervisor restarts a failed run under the config's
`restart` policy (docs/runs.md "Attempts"). On the `local` host, with the real trainer."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import dflash_contract.events
import pytest
import yaml
from dflash_agent import attempts
from dflash_contract.records import AttemptEntry, RestartPolicy
from dflash_contract.states import RunState
from dflash_files import checksums, procfs
from dflash_files.checkpoint_files import LOADED_FILES
from dflash_run import dflash_in_process
from support.events import read_events
from support.train_configs import small_config
from support.wait import wait_until

pytestmark = pytest.mark.timeout(600)
HOST = "local"
STEPS = 6  # the small config: 32 samples make 12 micro-batches, 2 drafters take 2 a step


class Bed:
    def __init__(self, make_inventory, tmp_path: Path):
        self.tmp = tmp_path
        self.hosts = make_inventory(tmp_path)
        self.logs = tmp_path / "logs"
        self.workspace = Path(yaml.safe_load(self.hosts.read_text())["hosts"][HOST]["workspace"])

    def dflash(self, *args: str, **kwargs):
        """The CLI in this process: these tests check the run, not the CLI's process."""
        return dflash_in_process("--logs-dir", str(self.logs), *args, hosts=self.hosts, **kwargs)

    def launch(self, name: str, **changes) -> str:
        config = small_config(self.tmp / f"{name}.yaml", **changes)
        done = self.dflash("launch", HOST, "--config", str(config))
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()[0]

    def run_dir(self, run_id: str) -> Path:
        return self.workspace / "runs" / run_id

    def run_json(self, run_id: str) -> dict:
        return json.loads((self.run_dir(run_id) / "run.json").read_text())

    def events(self, run_id: str) -> list[dict]:
        return read_events(self.run_dir(run_id) / "events.jsonl")

    def log_has(self, run_id: str, text: str) -> bool:
        return text.encode() in (self.run_dir(run_id) / "train.log").read_bytes()


@pytest.fixture
def bed(make_inventory, tmp_path):
    return Bed(make_inventory, tmp_path)


def steps_of(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["type"] == "step"]


def losses_of(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["type"] == "step"]


def checkpoints_of(events: list[dict]) -> list[int]:
    """The steps of the checkpoints written (each event is sent once its write is complete)."""
    return [e["step"] for e in events if e["type"] == "checkpoint"]


@pytest.mark.slow(seconds=33, why="trainer runs over pct: a stopped attempt, its resume and one at its end")
def test_a_stopped_run_resumes_as_attempt_1_with_every_step_once_and_its_loss_curve_continued(bed):
    # Attempt 0 hangs before step 4's batch; the stop's checkpoint is at step 3.
    hang = [{"thread": "prefetch", "at": "step:4", "kind": "hang", "attempt": 0}]
    run_id = bed.launch("stopped", faults=hang)
    wait_until(lambda: 3 in steps_of(bed.events(run_id)), 240, "step 3, the last before the hang")
    stopped = bed.dflash("stop", run_id, "--host", HOST, "--grace", "20")
    assert stopped.stdout.strip() == "STOPPED", stopped.stderr
    status = bed.dflash("status", run_id, "--host", HOST)
    assert status.returncode == 4, status.stderr
    assert "newest checkpoint at step 3: a resume would redo 0 steps" in status.stderr

    resumed = bed.dflash("resume", run_id, "--host", HOST, "--follow")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"run {run_id} (STOPPED) resumed as attempt 1 from its checkpoint at step 3" in resumed.stderr
    assert "the run's own" in resumed.stderr
    assert "=== attempt 1 (resume): from its checkpoint at step 3" in resumed.stdout  # watch shows the marker
    assert "ended: SUCCEEDED" in resumed.stderr

    events = bed.events(run_id)
    assert steps_of(events) == list(range(1, STEPS + 1))
    markers = [e for e in events if e["type"] == "attempt"]
    assert [(m["attempt"], m["reason"], m["resume_step"]) for m in markers] == [(1, "resume", 3)]
    for event in events:  # both attempts' events and the marker between them
        dflash_contract.events.check(event)
    record = bed.run_json(run_id)
    assert record["attempt"] == 1
    assert [(a["attempt"], a["reason"], a.get("state")) for a in record["attempts"]] == [
        (0, "launch", "STOPPED"), (1, "resume", None)]
    assert record["attempts"][1]["resume_from"]["step"] == 3
    assert record["release_id"] == record["attempts"][0]["release_id"]
    # The checkpoint carried the loss curve on: the final one is the curve of the events.
    final = json.loads((bed.run_dir(run_id) / "checkpoints" / f"step_{STEPS:06d}" / "state.json").read_text())
    assert final["losses"] == pytest.approx(losses_of(events), abs=1e-6)

    # Succeeded: nothing to resume, and nothing changes; `--step` names a checkpoint to train again from.
    export = bed.run_dir(run_id) / "export"
    exported = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in export.iterdir()}
    finished = bed.dflash("resume", run_id, "--host", HOST)
    assert finished.returncode == 2, finished.stderr
    assert f"run '{run_id}' succeeded at step {STEPS}; nothing to resume" in finished.stderr
    assert f"hint: to train again from one of its checkpoints (steps 3, {STEPS}): dflash resume {run_id} --step N" \
        in finished.stderr
    assert bed.run_json(run_id) == record
    # From the last step's checkpoint an attempt has nothing left to do: it succeeds (not 143,
    # as if stopped), and the finished export stays as it was.
    at_end = bed.dflash("resume", run_id, "--host", HOST, "--step", str(STEPS), "--follow")
    assert at_end.returncode == 0, at_end.stderr[-3000:]
    assert f"(SUCCEEDED) resumed as attempt 2 from its checkpoint at step {STEPS}" in at_end.stderr
    assert "ended: SUCCEEDED" in at_end.stderr
    assert json.loads((bed.run_dir(run_id) / "exit.json").read_text())["exit_code"] == 0
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in export.iterdir()} == exported
    assert bed.log_has(run_id, f"nothing left to train after step {STEPS}: the export in {export} is kept")
    status = bed.dflash("status", run_id, "--host", HOST, "--json")
    assert (status.returncode, json.loads(status.stdout)["step"]) == (0, STEPS), status.stderr



@pytest.mark.slow(seconds=27, why="trainer runs over pct: a failed attempt and its restart")
def test_a_raise_in_attempt_0_is_restarted_once_from_the_timed_checkpoint_and_its_traceback_kept(bed):
    # No checkpoint by steps (every: 0); every_minutes makes one after each step here.
    run_id = bed.launch("restarted", checkpoint={"every": 0, "every_minutes": 0.0001},
                        restart={"max": 1, "backoff_s": 0.5},
                        faults=[{"thread": "drafter-1", "at": "step:3", "kind": "raise", "attempt": 0}])
    watch = bed.dflash("watch", run_id, "--host", HOST)  # follows the run across the restart
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert "attempt 0 ended (failure at step 3); restarting in 0.5 s (restart 1 of 1)" in watch.stdout
    assert "=== attempt 1 (restart): from its checkpoint at step 2" in watch.stdout

    events = bed.events(run_id)
    checkpoints = checkpoints_of(events)
    assert checkpoints[:2] == [1, 2] and checkpoints[-1] == STEPS
    marker = next(i for i, e in enumerate(events) if e["type"] == "attempt")
    assert steps_of(events[marker:]) == list(range(3, STEPS + 1))
    record = bed.run_json(run_id)
    assert [(a["attempt"], a["reason"], a.get("state"), a.get("step")) for a in record["attempts"]] == [
        (0, "launch", "FAILED", 3), (1, "restart", None, None)]
    assert record["attempts"][0]["exit"]["exit_code"] == 1
    assert json.loads((bed.run_dir(run_id) / "exit.json").read_text())["exit_code"] == 0

    latest = bed.dflash("fetch-traceback", run_id, "--host", HOST)
    assert latest.returncode == 0 and latest.stdout == ""
    assert "no error recorded (state SUCCEEDED)" in latest.stderr
    every = bed.dflash("fetch-traceback", run_id, "--host", HOST, "--all")
    assert every.returncode == 0, every.stderr
    assert "thread drafter-1 failed in train at step 3 of attempt 0" in every.stdout
    assert "InjectedRootCause: injected root cause in drafter-1 at step 3" in every.stdout


@pytest.mark.slow(seconds=24, why="trainer runs over pct: a lost attempt and its resume")
def test_a_lost_run_resumes_by_hand_and_resume_refuses_a_live_run_and_a_mismatched_config(bed):
    hang = [{"thread": "prefetch", "at": "step:4", "kind": "hang", "attempt": 0}]
    run_id = bed.launch("lost", checkpoint={"every": 2}, faults=hang)

    def step_3_done_and_checkpoint_2_written() -> bool:
        # step 3's event can come before the step-2 checkpoint, written in the background, is
        events = bed.events(run_id)
        return 3 in steps_of(events) and 2 in checkpoints_of(events)

    wait_until(step_3_done_and_checkpoint_2_written, 240, "step 3, the last before the hang, and step 2's checkpoint")
    live = bed.dflash("resume", run_id, "--host", HOST)
    assert live.returncode == 2
    assert f"run '{run_id}' is still live (RUNNING): stop it first" in live.stderr

    # The host's agent goes (the supervisor killed), then the trainer: nobody records an end.
    record = bed.run_json(run_id)
    os.kill(record["supervisor"]["pid"], signal.SIGKILL)
    wait_until(lambda: not procfs.identity_alive(record["supervisor"]["pid"], record["supervisor"]["start_time"]),
             30, "the supervisor's end")
    os.killpg(record["pgid"], signal.SIGKILL)
    wait_until(lambda: not procfs.identity_alive(record["pid"], record["start_time"]), 30, "the trainer's end")
    status = bed.dflash("status", run_id, "--host", HOST)
    assert status.stdout.strip() == "LOST" and status.returncode == 1, status.stderr
    assert "newest checkpoint at step 2: a resume would redo 1 step" in status.stderr

    config = bed.run_dir(run_id) / "config.yaml"
    good = config.read_text()
    config.write_text(good.replace("drafters:\n  - cpu\n  - cpu\n", "drafters:\n  - cpu\n"))
    assert config.read_text() != good
    mismatched = bed.dflash("resume", run_id, "--host", HOST)
    assert mismatched.returncode == 2
    assert "was trained with 2 drafter replica(s) in all (1 process(es)); this run has 1 (1 process(es) x 1 drafters)" \
        in mismatched.stderr
    assert bed.run_json(run_id) == record  # nothing started
    config.write_text(good)

    resumed = bed.dflash("resume", run_id, "--host", HOST, "--follow", "--release", "current")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(LOST) resumed as attempt 1 from its checkpoint at step 2" in resumed.stderr
    assert "the host's current, the same as the run's" in resumed.stderr
    events = bed.events(run_id)
    marker = next(i for i, e in enumerate(events) if e["type"] == "attempt")
    assert steps_of(events[:marker]) == [1, 2, 3] and steps_of(events[marker:]) == list(range(3, STEPS + 1))
    # Exact resume: step 3 redone from the checkpoint of step 2 has the loss it had unbroken.
    assert losses_of(events[:marker])[2] == losses_of(events[marker:])[0]
    assert bed.run_json(run_id)["attempts"][0]["state"] == "LOST"


@pytest.mark.slow(seconds=8, why="a trainer run over pct that fails at start-up")
def test_resume_refuses_a_run_without_a_checkpoint(bed):
    run_id = bed.launch("early", faults=[{"thread": "coordinator", "at": "startup", "kind": "raise"}])
    assert bed.dflash("watch", run_id, "--host", HOST).returncode == 1
    refused = bed.dflash("resume", run_id, "--host", HOST)
    assert refused.returncode == 2
    assert f"run '{run_id}' (FAILED) has no complete checkpoint to resume from" in refused.stderr
    assert bed.run_json(run_id)["attempt"] == 0 and len(bed.run_json(run_id)["attempts"]) == 1  # untouched


@pytest.mark.slow(seconds=7, why="a trainer run over pct that fails, then a stop")
def test_a_stop_during_the_restart_back_off_ends_the_run_stopped_with_no_new_attempt(bed):
    run_id = bed.launch("backoff", restart={"max": 3, "backoff_s": 600},
                        faults=[{"thread": "coordinator", "at": "startup", "kind": "raise", "attempt": 0}])
    wait_until(lambda: bed.log_has(run_id, "attempt 0 ended (failure); restarting in 600.0 s"), 240, "the back-off")
    assert bed.dflash("status", run_id, "--host", HOST).stdout.strip() == "DEGRADED"  # not ended: restarting
    stopped = bed.dflash("stop", run_id, "--host", HOST)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "STOPPED", stopped.stderr
    record = bed.run_json(run_id)
    assert record["attempt"] == 0 and len(record["attempts"]) == 1
    assert json.loads((bed.run_dir(run_id) / "exit.json").read_text())["exit_code"] == 1
    assert bed.log_has(run_id, "attempt 0 ended (failure): not restarting: it was stopped")
    wait_until(lambda: not procfs.identity_alive(record["supervisor"]["pid"], record["supervisor"]["start_time"]),
             30, "the supervisor's end")
    assert bed.run_json(run_id)["attempt"] == 0


def flip_16_bytes(path: Path) -> None:
    """16 bytes of the file's middle inverted in place: the same size, and in a
    model.safetensors a header that still loads (the tensors' data is what changed)."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        data = handle.read(16)
        handle.seek(-len(data), os.SEEK_CUR)
        handle.write(bytes(b ^ 0xFF for b in data))


def truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


CORRUPTIONS = {"model.safetensors": flip_16_bytes, "optimizer.pt": truncate_to_half}


@pytest.mark.slow(seconds=30, why="trainer runs over pct: a failed attempt, its checkpoint corrupted, its resume")
@pytest.mark.parametrize("damaged", sorted(CORRUPTIONS))
def test_a_corrupt_newest_checkpoint_is_named_and_the_newest_intact_one_resumed(bed, damaged):
    run_id = bed.launch("corrupt", checkpoint={"every": 2},
                        faults=[{"thread": "drafter-1", "at": "step:5", "kind": "raise", "attempt": 0}])
    assert bed.dflash("watch", run_id, "--host", HOST).returncode == 1
    newest = bed.run_dir(run_id) / "checkpoints" / "step_000004"
    assert (newest / "SHA256SUMS").is_file()  # complete: every file there
    CORRUPTIONS[damaged](newest / damaged)

    status = bed.dflash("status", run_id, "--host", HOST)
    assert status.returncode == 1, status.stderr
    assert f"the checkpoint at step 4 is corrupt, a resume passes over it: {damaged} (" in status.stderr
    assert "newest intact checkpoint at step 2: a resume would redo 2 steps" in status.stderr
    found = json.loads(bed.dflash("status", run_id, "--host", HOST, "--json").stdout)
    assert found["checkpoint_step"] == 2 and [c["step"] for c in found["corrupt_checkpoints"]] == [4]
    assert found["corrupt_checkpoints"][0]["problem"].startswith(f"{damaged} (")

    record = bed.run_json(run_id)
    picked = bed.dflash("resume", run_id, "--host", HOST, "--step", "4")
    assert picked.returncode == 2
    assert f"the checkpoint at step 4 is corrupt, not resumed from: {damaged} (" in picked.stderr
    named = small_config(bed.tmp / "from-corrupt.yaml", checkpoint={"resume": str(newest)})
    launched = bed.dflash("launch", HOST, "--config", str(named))
    assert launched.returncode == 2
    assert f"checkpoint.resume: {newest} is corrupt: {damaged} (" in launched.stderr
    assert bed.run_json(run_id) == record  # nothing started

    resumed = bed.dflash("resume", run_id, "--host", HOST, "--follow")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{HOST}: the checkpoint at step 4 is corrupt, not resumed from: {damaged} (" in resumed.stderr
    assert "resumed as attempt 1 from its checkpoint at step 2 (the newest intact one)" in resumed.stderr
    assert "ended: SUCCEEDED" in resumed.stderr
    events = bed.events(run_id)
    marker = next(i for i, e in enumerate(events) if e["type"] == "attempt")
    assert steps_of(events[marker:]) == list(range(3, STEPS + 1))
    assert bed.run_json(run_id)["attempts"][1]["resume_from"]["step"] == 2


@pytest.mark.slow(seconds=25, why="a trainer run over pct, killed with its newest checkpoint corrupted, and restarted")
def test_a_restart_passes_over_a_corrupt_newest_checkpoint_and_says_so(bed):
    hang = [{"thread": "prefetch", "at": "step:5", "kind": "hang", "attempt": 0}]
    run_id = bed.launch("restart-corrupt", checkpoint={"every": 2}, faults=hang,
                        restart={"max": 1, "on": ["killed"], "backoff_s": 0})
    wait_until(lambda: 4 in checkpoints_of(bed.events(run_id)), 240, "step 4's checkpoint")
    flip_16_bytes(bed.run_dir(run_id) / "checkpoints" / "step_000004" / "model.safetensors")
    os.killpg(bed.run_json(run_id)["pgid"], signal.SIGKILL)
    watch = bed.dflash("watch", run_id, "--host", HOST)
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert "the checkpoint at step 4 is corrupt, not restarted from: model.safetensors (" in watch.stdout
    assert "=== attempt 1 (restart): from its checkpoint at step 2" in watch.stdout
    assert bed.run_json(run_id)["attempts"][1]["resume_from"]["step"] == 2


def test_a_folder_is_intact_only_when_sha256sums_lists_every_loaded_file_with_its_bytes(tmp_path):
    for name, data in (("state.json", b"{}"), ("model.safetensors", os.urandom(3 << 20)), ("optimizer.pt", b"o")):
        (tmp_path / name).write_bytes(data)
    sums = checksums.sums_text(str(tmp_path), ["state.json", "model.safetensors", "optimizer.pt"])
    (tmp_path / "SHA256SUMS").write_text(sums)
    assert checksums.verify(str(tmp_path), LOADED_FILES).intact
    assert checksums.verify(str(tmp_path), LOADED_FILES).hashed_bytes == (3 << 20) + 3
    (tmp_path / "SHA256SUMS").write_text(sums.replace("optimizer.pt\n", "../optimizer.pt\n"))
    assert "SHA256SUMS line 2 is not `<sha256>  <path in the folder>`" in checksums.verify(str(tmp_path)).problem
    (tmp_path / "SHA256SUMS").write_text("".join(line + "\n" for line in sums.splitlines() if "optimizer" not in line))
    assert checksums.verify(str(tmp_path), LOADED_FILES).problem == "SHA256SUMS does not list optimizer.pt"
    (tmp_path / "SHA256SUMS").write_text(sums)
    (tmp_path / "optimizer.pt").unlink()
    assert checksums.verify(str(tmp_path)).problem == "optimizer.pt is missing (SHA256SUMS lists it)"
    (tmp_path / "SHA256SUMS").unlink()
    assert checksums.verify(str(tmp_path)).problem.startswith("SHA256SUMS is missing")


def test_the_restart_policy_stops_at_its_budget_at_a_stop_and_at_a_failure_repeated_at_one_step():
    policy = RestartPolicy(max=2, on=("failure",), backoff_s=4)

    def entry(attempt: int, reason: str) -> AttemptEntry:
        return AttemptEntry(attempt=attempt, reason=reason, started_at=0.0, pid=1, release_id="rel", resume_from=None)

    def ended(started: AttemptEntry, state: RunState, step: int) -> AttemptEntry:
        return dataclasses.replace(started, state=state, step=step, ended_at=1.0)

    launch = entry(0, "launch")
    assert attempts.restart_refusal(policy, [launch], "failure", 7, False) is None
    assert attempts.backoff(policy, [launch]) == 4
    assert attempts.restart_refusal(policy, [launch], None, 7, False) == "it succeeded"
    assert attempts.restart_refusal(policy, [launch], "failure", 7, True) == "it was stopped"
    assert attempts.restart_refusal(policy, [launch], "killed", 7, False) == "restart.on does not name 'killed'"
    assert attempts.restart_refusal(None, [launch], "failure", 7, False) == "the config sets no restart"
    failed_at_7 = ended(launch, RunState.FAILED, 7)
    restart = entry(1, "restart")
    assert attempts.backoff(policy, [failed_at_7, restart]) == 8  # doubled
    assert attempts.restart_refusal(policy, [failed_at_7, restart], "failure", 9, False) is None
    assert "failed at step 7 twice in a row" in attempts.restart_refusal(policy, [failed_at_7, restart], "failure",
                                                                         7, False)
    budget = [failed_at_7, ended(restart, RunState.FAILED, 9), entry(2, "restart")]
    assert attempts.restart_refusal(policy, budget, "failure", 11, False) == "restart.max (2) reached"
    # A resume by hand renews the budget.
    by_hand = budget[:2] + [ended(budget[2], RunState.STOPPED, 10), entry(3, "resume")]
    assert attempts.restart_refusal(policy, by_hand, "failure", 11, False) is None
