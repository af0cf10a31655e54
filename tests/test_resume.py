"""Runs that survive: `dflash resume` continues a stopped, failed or lost run as a new
attempt of the same run id, and the supervisor restarts a failed run under the config's
`restart` policy (DESIGN.md "Attempts"). On the `local` host, with the real trainer."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from dflash_agent import procfs
from dflash_run import dflash
from support.train_configs import small_config
from support_agent.harness import wait_for

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
        return dflash("--logs-dir", str(self.logs), *args, hosts=self.hosts, **kwargs)

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
        """The whole lines of events.jsonl (none before the trainer made it)."""
        path = self.run_dir(run_id) / "events.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def log_has(self, run_id: str, text: str) -> bool:
        return text.encode() in (self.run_dir(run_id) / "train.log").read_bytes()


@pytest.fixture
def bed(make_inventory, tmp_path):
    return Bed(make_inventory, tmp_path)


def steps_of(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["type"] == "step"]


def losses_of(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["type"] == "step"]


def test_a_stopped_run_resumes_as_attempt_1_with_every_step_once_and_the_same_losses(bed):
    # Attempt 0 hangs before step 4's batch; the stop's checkpoint is at step 3.
    hang = [{"thread": "prefetch", "at": "step:4", "kind": "hang", "attempt": 0}]
    run_id = bed.launch("stopped", faults=hang)
    wait_for(lambda: 3 in steps_of(bed.events(run_id)), 240, "step 3, the last before the hang")
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
    record = bed.run_json(run_id)
    assert record["attempt"] == 1
    assert [(a["attempt"], a["reason"], a.get("state")) for a in record["attempts"]] == [
        (0, "launch", "STOPPED"), (1, "resume", None)]
    assert record["attempts"][1]["resume_from"]["step"] == 3
    assert record["release_id"] == record["attempts"][0]["release_id"]
    # The checkpoint carried the loss curve on: the final one is the curve of the events.
    final = json.loads((bed.run_dir(run_id) / "checkpoints" / f"step_{STEPS:06d}" / "state.json").read_text())
    assert final["losses"] == pytest.approx(losses_of(events), abs=1e-6)

    # Exact resume: an unbroken run of the same config has the same losses, step for step.
    unbroken = bed.launch("unbroken")
    assert bed.dflash("watch", unbroken, "--host", HOST).returncode == 0
    assert losses_of(bed.events(unbroken)) == losses_of(events)
