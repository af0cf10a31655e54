"""End to end over the `pct` transport with the real trainer: deploy, launch, watch,
fetch-traceback, status, stop — as a user runs them, through sshd and the fake pct. The CLI
runs in the test's process, and as a process of its own where that is what is checked."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_files import procfs
from dflash_run import dflash_in_process, popen_dflash
from support import kill_ssh_sessions, workspace_on_node
from support.events import read_events
from support.train_configs import small_config as write_small_config
from support.wait import wait_until
from test_watch_events import tensorboard_scalars

from dflash_cli.commands import plot
from dflash_cli.local_state import RunRef

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
        """The CLI in this process; `popen_dflash` where the process is what a test checks
        (a Ctrl-C, a watch that outlives a dropped connection)."""
        return dflash_in_process("--logs-dir", str(self.logs), *args, hosts=self.hosts, **kwargs)

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


CUDA_OOM = ("CUDA out of memory. Tried to allocate 34.80 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "7.12 GiB is free. Including non-PyTorch memory, this process has 131.50 GiB memory in use. Of the "
            "allocated memory 126.31 GiB is allocated by PyTorch, and 4.02 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


@pytest.mark.slow(seconds=17, why="a trainer run over pct that fails at a drafter's start-up")
def test_a_known_failure_ends_watch_and_fetch_traceback_with_its_diagnosis(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-0", "at": "startup", "kind": "raise",
                                             "exception": "torch.OutOfMemoryError", "message": CUDA_OOM}])
    run_id = bed.launch(config)
    diagnosis = ("diagnosis: CUDA out of memory on GPU 0 (cuda:0) allocating 34.80 GiB: 131.50 GiB of its 139.81 GiB "
                 "in use by this process, 7.12 GiB free; lower data.token_budget or data.block_token_budget (the "
                 "step's activations grow with them); `dflash launch --dry-run` prints the memory estimate")

    watch = bed.dflash("watch", run_id, "--host", "ct200")
    assert watch.returncode == 1, watch.stderr
    root_cause = bed.error_records(run_id)[0]
    assert root_cause["exc_type"] == "OutOfMemoryError" and root_cause["message"] == CUDA_OOM
    assert root_cause["memory"] == {"devices": {}, "parts": []}  # a CPU run: nothing held on a GPU
    assert root_cause["traceback"] in watch.stdout and "diagnosis" not in watch.stdout
    assert watch.stderr.splitlines()[-2:] == [f"run {run_id} on ct200 ended: FAILED", diagnosis]

    for mode in ([], ["--all"], ["--thread", "coordinator"]):  # the coordinator's record is chained from it
        fetched = bed.dflash("fetch-traceback", run_id, "--host", "ct200", *mode)
        assert fetched.returncode == 0, fetched.stderr
        assert fetched.stderr.splitlines()[-1] == diagnosis and "diagnosis" not in fetched.stdout
    to_file = bed.dflash("fetch-traceback", run_id, "--host", "ct200", "-o", str(tmp_path / "tb.txt"))
    assert to_file.stderr.splitlines()[-1] == diagnosis and "diagnosis" not in (tmp_path / "tb.txt").read_text()

    elsewhere = dflash_in_process("--logs-dir", str(tmp_path / "other-logs"), "watch", run_id, "--host", "ct200",
                                  "--json", hosts=bed.hosts)  # another checkout's watch: every message again
    errors = [m for m in map(json.loads, elsewhere.stdout.splitlines()) if m["t"] == "error"]
    assert errors[0]["diagnosis"] == diagnosis.removeprefix("diagnosis: ")
    assert all(m["diagnosis"] == errors[0]["diagnosis"] for m in errors)  # each record chained from the OOM


@pytest.mark.slow(seconds=15, why="a 40-step trainer run over pct, watched through two dropped connections")
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
    # The events came home once each too, and TensorBoard's reader finds every figure of
    # every step of the real trainer's events; plot draws the same.
    mirror = bed.logs / "ct200" / run_id
    host_events = [json.loads(line) for line in (bed.run_dir(run_id) / "events.jsonl").read_text().splitlines()]
    sent = [e for e in host_events if e["type"] != "heartbeat"]
    assert [json.loads(line) for line in (mirror / "events.jsonl").read_text().splitlines()] == sent
    steps = [e for e in sent if e["type"] == "step"]
    scalars = tensorboard_scalars(mirror)
    tags = ["train/loss", "train/acc@1", "train/lr", "train/grad_norm", "train/epoch", "throughput/samples_per_s",
            "throughput/tokens_per_s"] + [f"train/acc_by_position/{k}" for k in range(1, len(steps[0]["acc"]) + 1)]
    for tag in tags:
        assert [step for step, _ in scalars[tag]] == [e["step"] for e in steps], tag
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([e["loss"] for e in steps])
    evals = [e for e in sent if e["type"] == "eval"]
    assert evals and scalars["eval/acceptance_length"] == [
        (e["step"], pytest.approx(e["acceptance_length"])) for e in evals]
    assert not [tag for tag in scalars if tag.startswith("memory/")]  # CPU drafters: no memory counter
    [loss_line] = plot.figure(plot.load(bed.logs, [RunRef("ct200", run_id)])).axes[0].get_lines()
    assert list(loss_line.get_ydata()) == [e["loss"] for e in steps]


def cpu_lock_holders(bed: Bed) -> list[str]:
    lock = json.loads((bed.workspace_on_node / "locks" / "cpu.json").read_text())
    return [holder["run_id"] for holder in lock["holders"]]


def kill_supervisor(bed: Bed, run_id: str) -> None:
    """SIGKILL the run's supervisor (checked by its start time, pids are reused)."""
    supervisor = json.loads((bed.run_dir(run_id) / "run.json").read_text())["supervisor"]
    assert procfs.identity_alive(supervisor["pid"], supervisor["start_time"])
    os.kill(supervisor["pid"], signal.SIGKILL)
    wait_until(lambda: not procfs.identity_alive(supervisor["pid"], supervisor["start_time"]))


@pytest.mark.slow(seconds=20, why="three trainer runs over pct: two hung ones stopped, then one whole")
def test_stop_ends_every_process_of_the_run_and_watch_says_stopped(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    run_id = bed.launch(config)
    refused = bed.dflash("launch", "ct200", "--config", str(config))
    assert refused.returncode == 2
    assert run_id in refused.stderr  # names the run that holds the CPU
    forced_id = bed.launch(config, "--force")
    # --force put a second run next to the first; a third without --force is refused
    # while either lives, and the refusal names both.
    refused = bed.dflash("launch", "ct200", "--config", str(config))
    assert refused.returncode == 2, refused.stderr
    assert run_id in refused.stderr and forced_id in refused.stderr
    assert cpu_lock_holders(bed) == [run_id, forced_id]
    # Nobody will release the first run's lock: its supervisor dies before the run ends.
    kill_supervisor(bed, run_id)
    # A RUNNING run (stall_after is 300 s) shows its stacks on request, supervisor or not.
    train_log = bed.run_dir(run_id) / "train.log"
    wait_until(lambda: b"injecting fault: hang in drafter-0" in train_log.read_bytes(), 180, "the hang")
    stacks = bed.dflash("fetch-traceback", run_id, "--host", "ct200", "--stacks")
    assert stacks.returncode == 0, stacks.stderr
    assert "dumped now (state RUNNING)" in stacks.stdout
    assert "in _hang" in thread_block(stacks.stdout, "drafter-0")
    for rid in (forced_id, run_id):
        stopped = bed.dflash("stop", rid, "--host", "ct200", "--grace", "3")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == "STOPPED"
        pid = json.loads((bed.run_dir(rid) / "run.json").read_text())["pid"]
        # Exited. An orphan (its supervisor killed) is reaped by whatever adopted it, if
        # that reaps at all: a zombie may be left, which is no running process.
        assert not procfs.is_running(procfs.read_stat(pid))
    watch = bed.dflash("watch", run_id, "--host", "ct200")
    assert watch.returncode == 4
    runs = bed.dflash("runs", "--host", "ct200")
    assert sorted(runs.stdout.splitlines()) == sorted(f"ct200\t{r}\tSTOPPED" for r in (run_id, forced_id))
    assert cpu_lock_holders(bed) == [run_id]  # the dead holder is still listed...
    third_id = bed.launch(small_config(tmp_path, "third"))  # ...and reaped: no --force needed
    assert cpu_lock_holders(bed) == [third_id]
    assert bed.dflash("watch", third_id, "--host", "ct200").returncode == 0


@pytest.mark.slow(seconds=13, why="a whole trainer run over pct")
def test_a_run_that_outlives_its_supervisor_and_succeeds_is_succeeded(bed, tmp_path):
    run_id = bed.launch(small_config(tmp_path))
    kill_supervisor(bed, run_id)
    watch = bed.dflash("watch", run_id, "--host", "ct200")  # ends without exit.json
    assert watch.returncode == 0, watch.stderr
    assert "ended: SUCCEEDED" in watch.stderr
    assert not (bed.run_dir(run_id) / "exit.json").exists()
    assert (bed.run_dir(run_id) / "export" / "model.safetensors").exists()
    status = bed.dflash("status", run_id, "--host", "ct200", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "SUCCEEDED"


def thread_block(stacks: str, name: str) -> str:
    """The stack of thread `name` in a faulthandler dump (blocks end at a blank line)."""
    blocks = [b for b in stacks.split("\n\n") if re.search(rf"^(Current thread|Thread) 0x[0-9a-f]+ \[{name}\] ",
                                                            b, re.MULTILINE)]
    assert len(blocks) == 1, stacks
    return blocks[0]


@pytest.mark.slow(seconds=29, why="a trainer run over pct left hanging until it is STALLED")
def test_a_hung_run_is_stalled_and_its_stacks_show_the_hanging_thread_by_name(bed, tmp_path):
    config = small_config(tmp_path, stall_after=3,
                          faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    run_id = bed.launch(config)
    train_log = bed.run_dir(run_id) / "train.log"
    wait_until(lambda: b"injecting fault: hang in drafter-0 at step 2" in train_log.read_bytes(), 180,
             "the hang fault to fire")

    def stalled():
        done = bed.dflash("status", run_id, "--host", "ct200", "--json")
        return done if json.loads(done.stdout)["state"] == "STALLED" else None

    status = wait_until(stalled, 120, "the run to be STALLED")
    assert status.returncode == 1  # not fine
    shown = bed.dflash("status", run_id, "--host", "ct200")
    assert f"where its threads hang: dflash stacks {run_id} --host ct200" in shown.stderr

    stacks = bed.dflash("stacks", run_id, "--host", "ct200")
    assert stacks.returncode == 0, stacks.stderr
    assert "stacks of every thread, dumped now (state STALLED)" in stacks.stdout
    assert "in _hang" in thread_block(stacks.stdout, "drafter-0")
    thread_block(stacks.stdout, "coordinator")
    fetched = bed.dflash("fetch-traceback", run_id, "--host", "ct200")  # no error record: stacks, fresh
    assert fetched.returncode == 0, fetched.stderr
    assert "dumped now (state STALLED)" in fetched.stdout
    assert "in _hang" in thread_block(fetched.stdout, "drafter-0")
    fault_log = (bed.run_dir(run_id) / "faulthandler.log").read_text()
    assert fault_log.count("=== stacks of every thread: requested") == 2  # a new dump each time
    mixed = bed.dflash("fetch-traceback", run_id, "--host", "ct200", "--stacks", "--thread", "drafter-0")
    assert mixed.returncode == 2 and "--stacks" in mixed.stderr

    stopped = bed.dflash("stop", run_id, "--host", "ct200", "--grace", "60")
    assert stopped.stdout.strip() == "STOPPED", stopped.stderr
    after = bed.dflash("fetch-traceback", run_id, "--host", "ct200")
    assert after.returncode == 0, after.stderr
    # The trainer's own dump of the threads that outlived the stop: the hung one.
    assert "the last dump in faulthandler.log (state STOPPED)" in after.stdout
    assert "threads still running after the stop: drafter-0" in after.stdout
    assert "in _hang" in thread_block(after.stdout, "drafter-0")


@pytest.mark.slow(seconds=45, why="a trainer run over pct whose start-up works 20 s, then hangs until STALLED")
def test_a_long_start_up_that_works_is_starting_and_one_that_hangs_is_stalled(bed, tmp_path):
    """stall_after 3 s would call any start-up longer than that stalled; start-up has its
    own limit (startup_stall_after), which a start-up at work never reaches: 20 s of CPU
    work at start-up stay STARTING, then a hang (no work, no event) turns STALLED."""
    faults = [{"thread": "coordinator", "at": "startup", "kind": "busy", "seconds": 20},
              {"thread": "coordinator", "at": "startup", "kind": "hang"}]
    run_id = bed.launch(small_config(tmp_path, stall_after=3, startup_stall_after=15, faults=faults))
    try:
        train_log = bed.run_dir(run_id) / "train.log"
        wait_until(lambda: b"injecting fault: busy in coordinator" in train_log.read_bytes(), 120, "the busy fault")
        seen = []
        while b"injecting fault: hang in coordinator" not in train_log.read_bytes():
            status = json.loads(bed.dflash("status", run_id, "--host", "ct200", "--json").stdout)
            seen.append((status["state"], status["startup"], status["startup_elapsed_s"]))
            time.sleep(0.5)  # each status is a CLI run over SSH: twice a second shows 20 s of start-up
        assert len(seen) >= 5 and {state for state, _, _ in seen} == {"STARTING"}, seen
        assert seen[-1][1] == "start-up" and seen[-1][2] >= 10, seen  # the phase and how long, from its `alive` events

        def stalled():
            done = bed.dflash("status", run_id, "--host", "ct200", "--json")
            return done if json.loads(done.stdout)["state"] == "STALLED" else None

        status = wait_until(stalled, 60, "the hung start-up to be STALLED")
        assert status.returncode == 1
        assert json.loads(status.stdout)["startup"] == "start-up"  # the phase it stopped in
        alive = [e for e in read_events(bed.run_dir(run_id) / "events.jsonl", "startup") if e["state"] == "alive"]
        assert len(alive) >= 3 and all(e["cpu_s"] > 0 or e["io_bytes"] > 0 for e in alive)
    finally:  # the hang never ends by itself
        assert bed.dflash("stop", run_id, "--host", "ct200", "--grace", "5").stdout.strip() == "STOPPED"


def test_a_run_that_dies_without_a_record_is_explained(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-1", "at": "step:1", "kind": "abort"}])
    run_id = bed.launch(config)
    watch = bed.dflash("watch", "--tail", "5")
    assert watch.returncode == 1
    assert "SIGABRT" in watch.stdout
    fetched = bed.dflash("fetch-traceback", run_id, "--host", "ct200")
    assert fetched.returncode == 1
    assert "no error record" in fetched.stdout and "SIGABRT" in fetched.stdout
    faulthandler_part = fetched.stdout.split("--- faulthandler.log, the last dump ---\n")[1]
    assert faulthandler_part.startswith("Fatal Python error: Aborted")
    assert "[drafter-1]" in faulthandler_part.split("\n--- ")[0]  # threads named
    assert "--- train.log, last lines of drafter-1 ---" in fetched.stdout


def test_ctrl_c_detaches_and_the_run_keeps_going(bed, tmp_path):
    config = small_config(tmp_path, faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    run_id = bed.launch(config)
    watch = bed.popen_dflash("watch")
    assert watch.stdout.readline()  # attached: the log is flowing
    watch.send_signal(signal.SIGINT)
    try:
        _, stderr = watch.communicate(timeout=30)
    finally:  # a watch that did not detach must not outlive the test: it reconnects to the worker's sshd
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 130, stderr
    assert b"keeps running" in stderr
    status = bed.dflash("status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] in ("STARTING", "RUNNING")
    runs = bed.dflash("runs")  # the latest run's host by default
    assert runs.stdout.split("\t")[:2] == ["ct200", run_id]
    assert bed.dflash("stop", "--grace", "2").returncode == 0
