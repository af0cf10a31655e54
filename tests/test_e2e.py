"""End to end over the `pct` transport with the real trainer: deploy, launch, watch,
fetch-traceback, status, stop — as a user runs them, through sshd and the fake pct."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_run import dflash, popen_dflash
from support import kill_ssh_sessions, workspace_on_node
from support.train_configs import small_config as write_small_config

pytestmark = pytest.mark.timeout(300)


def small_config(tmp_path: Path, name: str = "small", **changes) -> Path:
    return write_small_config(tmp_path / f"{name}.yaml", **changes)


class Bed:
    """One test's inventory, logs folder and view of container 200's workspace."""

    def __init__(self, make_inventory, fake_pve, tmp_path: Path):
        self.hosts = make_inventory(tmp_path)
        self.logs = tmp_path / "logs"
        self.workspace_on_node = workspace_on_node(fake_pve, tmp_path)

    def dflash(self, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return dflash("--logs-dir", str(self.logs), *args, hosts=self.hosts, **kwargs)

    def popen_dflash(self, *args: str) -> subprocess.Popen[bytes]:
        return popen_dflash("--logs-dir", str(self.logs), *args, hosts=self.hosts)

    def launch(self, config: Path, *extra: str) -> str:
        done = self.dflash("launch", "ct200", "--config", str(config), *extra)
        assert done.returncode == 0, done.stderr
        (run_id,) = done.stdout.splitlines()
        return run_id

    def run_dir(self, run_id: str) -> Path:
        return self.workspace_on_node / "runs" / run_id

    def error_records(self, run_id: str) -> list[dict]:
        text = (self.run_dir(run_id) / "errors.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def bed(make_inventory, fake_pve, tmp_path):
    return Bed(make_inventory, fake_pve, tmp_path)


def test_startup_fault_in_drafter_1_is_shown_whole_by_watch_and_fetch_traceback(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-1", "at": "startup", "kind": "raise", "depth": 40}])
    run_id = bed.launch(config, "--name", "fault 'quoted' run")
    assert run_id.startswith("fault 'quoted' run-")

    watch = bed.dflash("watch")  # the latest run, found through logs/latest.json
    assert watch.returncode == 1, watch.stderr

    (root_cause, *later) = bed.error_records(run_id)
    assert root_cause["thread"] == "drafter-1" and root_cause["phase"] == "startup"
    traceback_text = root_cause["traceback"]
    assert traceback_text.count(", in _descend_") >= 40  # all `depth` frames, none cut
    assert "The above exception was the direct cause" in traceback_text
    assert any(r["thread"] == "coordinator" and "drafter-1" in r["message"] for r in later)
    # watch printed the whole root-cause traceback, byte for byte, and saved it.
    assert traceback_text in watch.stdout
    saved = bed.logs / "ct200" / run_id / "traceback.txt"
    assert saved.read_text() == traceback_text

    fetched = bed.dflash("fetch-traceback", run_id, "--host", "ct200")
    assert fetched.returncode == 0, fetched.stderr
    header, body = fetched.stdout.split("\n", 1)
    assert header.startswith(f"==> run {run_id} on ct200: thread drafter-1 failed in startup")
    assert body == traceback_text
    to_file = bed.dflash("fetch-traceback", "-o", str(tmp_path / "tb.txt"))
    assert to_file.stdout == "" and (tmp_path / "tb.txt").read_text() == fetched.stdout
    every = bed.dflash("fetch-traceback", "--all")
    assert every.stdout.count("==> run ") == 1 + len(later)
    coordinator = bed.dflash("fetch-traceback", "--thread", "coordinator")
    assert "drafter-1" in coordinator.stdout

    status = bed.dflash("status", "--json")
    assert status.returncode == 1
    assert json.loads(status.stdout)["state"] == "FAILED"


def test_watch_resumes_after_the_ssh_connection_dies_with_no_gap_and_no_duplicate(bed, ssh_node, tmp_path):
    config = small_config(tmp_path, optim={"max_steps": 40}, data={"synthetic": {
        "num_train": 256, "num_eval": 2, "prompt_words": 12, "response_tokens": 24}})  # ~40 steps
    run_id = bed.launch(config)
    watch = bed.popen_dflash("watch", run_id, "--host", "ct200", "--retry-for", "60")
    printed: list[bytes] = []
    said: list[bytes] = []
    readers = [threading.Thread(target=lambda: printed.extend(iter(watch.stdout.readline, b""))),
               threading.Thread(target=lambda: said.extend(iter(watch.stderr.readline, b"")))]
    for reader in readers:
        reader.start()

    def steps() -> int:
        return sum(b" step " in line for line in printed)

    kills, steps_at_kill = 0, 0
    deadline = time.monotonic() + 240
    while watch.poll() is None and time.monotonic() < deadline:
        reconnected = sum(b"reconnecting" in line for line in said) == kills
        # Kill once lines flow, and again only after the first reconnect delivered more.
        if kills < 2 and reconnected and steps() >= steps_at_kill + 3 and kill_ssh_sessions(ssh_node):
            kills, steps_at_kill = kills + 1, steps()
        time.sleep(0.05)
    watch.wait(timeout=10)
    for reader in readers:
        reader.join(timeout=10)
    stderr = b"".join(said).decode()
    assert kills == 2, "the run ended before both connection drops"
    assert watch.returncode == 0, stderr
    assert stderr.count("reconnecting") >= 2
    # The warning names what was cut off (the agent's follow), not the host's interpreter.
    warnings = [line for line in stderr.splitlines() if "reconnecting" in line]
    assert "agent follow" in stderr and not any(sys.executable in line for line in warnings), warnings
    remote_log = (bed.run_dir(run_id) / "train.log").read_bytes()
    assert b"".join(printed) == remote_log  # every line once, in order
    assert (bed.logs / "ct200" / run_id / "train.log").read_bytes() == remote_log


def test_stop_ends_every_process_of_the_run_and_watch_says_stopped(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    run_id = bed.launch(config)
    refused = bed.dflash("launch", "ct200", "--config", str(config))
    assert refused.returncode == 2
    assert run_id in refused.stderr  # names the run that holds the CPU
    forced_id = bed.launch(config, "--force")
    for rid in (forced_id, run_id):
        stopped = bed.dflash("stop", rid, "--host", "ct200", "--grace", "3")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == "STOPPED"
        pid = json.loads((bed.run_dir(rid) / "run.json").read_text())["pid"]
        assert not Path(f"/proc/{pid}").exists()
    watch = bed.dflash("watch", run_id, "--host", "ct200")
    assert watch.returncode == 4
    runs = bed.dflash("runs", "--host", "ct200")
    assert sorted(runs.stdout.splitlines()) == sorted(f"ct200\t{r}\tSTOPPED" for r in (run_id, forced_id))


def test_a_run_that_dies_without_a_record_is_explained(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-1", "at": "step:1", "kind": "abort"}])
    run_id = bed.launch(config)
    watch = bed.dflash("watch", "--tail", "5")
    assert watch.returncode == 1
    assert "SIGABRT" in watch.stdout
    fetched = bed.dflash("fetch-traceback", run_id, "--host", "ct200")
    assert fetched.returncode == 1
    assert "no error record" in fetched.stdout and "SIGABRT" in fetched.stdout
    assert "--- faulthandler.log ---" in fetched.stdout
    assert "--- train.log, last lines of drafter-1 ---" in fetched.stdout


def test_ctrl_c_detaches_and_the_run_keeps_going(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    run_id = bed.launch(config)
    watch = bed.popen_dflash("watch")
    assert watch.stdout.readline()  # attached: the log is flowing
    watch.send_signal(signal.SIGINT)
    _, stderr = watch.communicate(timeout=30)
    assert watch.returncode == 130, stderr
    assert b"keeps running" in stderr
    status = bed.dflash("status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] in ("STARTING", "RUNNING")
    runs = bed.dflash("runs")  # the latest run's host by default
    assert runs.stdout.split("\t")[:2] == ["ct200", run_id]
    assert bed.dflash("stop", "--grace", "2").returncode == 0
