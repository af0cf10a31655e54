"""A disk that fills up under a run (docs/layout.md: the reserves; errors.jsonl:
DiskFull): the run is FAILED with a record naming the full disk, not LOST; what it had
checkpointed stays whole and resumes once space is freed. On real tmpfs filesystems, with
the real trainer and torch's own writers."""
from __future__ import annotations

import hashlib
import json
import os
import re
import traceback
from pathlib import Path

import pytest
import torch
from dflash_contract.records import ErrorRecord
from dflash_files.checkpoint_files import LATEST
from dflash_files.diskspace import RESERVE_BYTES, DiskFull, free_bytes
from dflash_run import dflash_in_process
from dflash_train.checkpoint.folders import CheckpointSnapshot, write_checkpoint
from dflash_train.checkpoint.state import TrainingState
from dflash_train.runlog import ErrorLog, LineWriter
from support.disk import fill, tmpfs
from support.events import read_events
from support.train_configs import small_config
from support.wait import wait_until
from support_agent.harness import kill_run

pytestmark = pytest.mark.timeout(300)
HOST = "local"
STEPS = 12  # the small config, an epoch a step, 12 epochs


def steps_of(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["type"] == "step"]


def intact(folder: Path) -> bool:
    """Whether every file SHA256SUMS lists holds the bytes it names (`sha256sum -c`)."""
    lines = (folder / "SHA256SUMS").read_text().splitlines()
    return bool(lines) and all(hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
                               for digest, name in (line.split("  ", 1) for line in lines))


@pytest.mark.slow(seconds=17, why="a trainer run on a tmpfs filled to its last byte, then its resume")
def test_a_disk_full_to_its_last_byte_fails_the_run_naming_it_and_the_checkpoint_resumes(make_inventory, tmp_path):
    with tmpfs(tmp_path / "disk", size_mib=96) as disk:
        workspace = disk / "ws"
        hosts = make_inventory(tmp_path, local={"workspace": str(workspace)})

        def dflash(*args: str):
            return dflash_in_process("--logs-dir", str(tmp_path / "logs"), *args, hosts=hosts)

        config = small_config(tmp_path / "full.yaml", optim={"epochs": STEPS}, checkpoint={"every": 2})
        launched = dflash("launch", HOST, "--config", str(config))
        assert launched.returncode == 0, launched.stderr
        run_id = launched.stdout.split()[0]
        run_dir = workspace / "runs" / run_id
        try:
            wait_until(lambda: any(e["type"] == "checkpoint" for e in read_events(run_dir / "events.jsonl")), 240,
                       "the first checkpoint")
            filler = fill(disk)  # to the last byte, while the run trains on

            def ended():
                status = dflash("status", run_id, "--host", HOST)
                return status if status.stdout.strip() in ("FAILED", "LOST", "SUCCEEDED") else None

            status = wait_until(ended, 120, "the run's end", interval=0.5)
            assert (status.returncode, status.stdout) == (1, "FAILED\n"), status.stderr
            full = re.escape(f"DiskFull: no space left on device writing {run_dir}/") + r"\S+" + re.escape(" (") + \
                r"\d+" + re.escape(f" bytes free on {disk}")
            assert re.search("reason: " + full, status.stderr), status.stderr
            first = json.loads((run_dir / "errors.jsonl").read_text().splitlines()[0])
            assert first["exc_type"] == "DiskFull" and first["detail"]["mount"] == str(disk)
            assert first["detail"]["path"].startswith(f"{run_dir}/")
            exit_record = json.loads((run_dir / "exit.json").read_text())
            assert (exit_record["exit_code"], exit_record["signal"]) == (1, None)  # the trainer ended itself
            watch = dflash("watch", run_id, "--host", HOST)
            assert watch.returncode == 1
            assert re.search(full, watch.stdout + watch.stderr), watch.stdout[-3000:]

            newest = json.loads(dflash("status", run_id, "--host", HOST, "--json").stdout)["checkpoint_step"]
            assert newest is not None and newest >= 2
            assert (run_dir / "checkpoints" / LATEST).resolve().name == f"step_{newest:06d}"
            assert intact(run_dir / "checkpoints" / f"step_{newest:06d}")

            filler.unlink()
            resumed = dflash("resume", run_id, "--host", HOST, "--follow")
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            assert f"resumed as attempt 1 from its checkpoint at step {newest}" in resumed.stderr
            events = read_events(run_dir / "events.jsonl")
            marker = next(i for i, e in enumerate(events) if e["type"] == "attempt")
            assert steps_of(events[marker:]) == list(range(newest + 1, STEPS + 1))
        finally:
            kill_run(run_dir)  # whatever a run that did not end left running on the lazily unmounted disk


def snapshot(step: int, optimizer_floats: int, weight_floats: int = 16) -> CheckpointSnapshot:
    """A checkpoint's content: weights of `weight_floats` float32s, which safetensors
    writes (by default small: model.safetensors fits anywhere here), and an optimizer
    state of `optimizer_floats` float32s, which torch.save writes."""
    state = TrainingState(step=step, epoch=0, batch_index=step, replicas=1, losses=[1.0] * step)
    return CheckpointSnapshot(state, {"w": torch.ones(weight_floats)},
                              {"optimizer": {"state": {0: {"exp_avg": torch.ones(optimizer_floats)}}},
                               "scheduler": {"last_epoch": step}})


def test_a_checkpoint_the_disk_cannot_hold_names_the_full_disk_and_leaves_the_previous_one(tmp_path):
    with tmpfs(tmp_path / "disk", size_mib=8) as disk:
        root = disk / "checkpoints"
        write_checkpoint(root, snapshot(1, 1 << 18), keep=2, config_yaml="seed: 0\n")  # 1 MiB of state
        filler = fill(disk)
        os.truncate(filler, filler.stat().st_size - 350 * 1024)  # 350 KiB free: the writers start, then fail
        free = free_bytes(str(disk))
        second = snapshot(2, 1 << 18)
        with pytest.raises(DiskFull) as raised:
            write_checkpoint(root, second, keep=2, config_yaml="seed: 0\n")
        assert str(raised.value) == (f"no space left on device writing {root}/step_000002 ({free} bytes free on "
                                     f"{disk}; it needs at least {second.nbytes()} bytes)")
        assert "unexpected pos" in str(raised.value.__cause__)  # what torch.save itself says
        assert (root / LATEST).resolve().name == "step_000001" and intact(root / "step_000001")
        assert sorted(p.name for p in root.iterdir()) == [LATEST, "step_000001"]  # no staging folder left


@pytest.mark.parametrize("writer,weights,optimizer_floats", [
    ("save_torch", 16, 1 << 18),  # the optimizer state's file (torch.save) fails
    ("save_file", (1 << 18) - 16, 16),  # the weights' file (safetensors) fails
])
def test_a_disk_that_fills_while_a_checkpoint_is_written_is_named_full(tmp_path, writer, weights, optimizer_floats):
    """At the start there is room for the checkpoint's tensors, as when another writer
    takes it from under the checkpoint: the free space then said nothing, the writer's
    own error must."""
    page = 4096
    with tmpfs(tmp_path / "disk", size_mib=4) as disk:
        root = disk / "checkpoints"
        second = snapshot(2, optimizer_floats, weights)
        filler = fill(disk)
        pages = -(-second.nbytes() // page)  # the tensors' bytes in whole pages: less than their files take
        os.truncate(filler, (-(-filler.stat().st_size // page) - pages) * page)
        assert free_bytes(str(disk)) == pages * page >= second.nbytes()
        with pytest.raises(DiskFull) as raised:
            write_checkpoint(root, second, keep=2, config_yaml="seed: 0\n")
        assert re.fullmatch(re.escape(f"no space left on device writing {root}/step_000002 (") + r"\d+"
                            + re.escape(f" bytes free on {disk})"), str(raised.value))
        assert writer in [frame.name for frame in traceback.extract_tb(raised.value.__cause__.__traceback__)]
        assert list(root.iterdir()) == []  # no staging folder left


def test_the_error_record_is_written_into_its_reserve_on_a_disk_full_to_its_last_byte(tmp_path):
    with tmpfs(tmp_path / "disk", size_mib=2) as disk:
        errors = ErrorLog(disk / "errors.jsonl")
        fill(disk)
        errors.append(ErrorRecord(exc_type="DiskFull", message="the first failure"))
        with pytest.raises(DiskFull, match=re.escape(f"writing {disk}/errors.jsonl (")):
            errors.append(ErrorRecord(exc_type="DiskFull", message="x" * RESERVE_BYTES))  # the reserve is gone
        assert [json.loads(line)["message"] for line in (disk / "errors.jsonl").read_text().splitlines()] == [
            "the first failure"]  # whole lines only: the failed one left nothing behind


def test_log_lines_the_disk_has_no_room_for_are_dropped_and_counted_once_it_has(tmp_path):
    with tmpfs(tmp_path / "disk", size_mib=2) as disk:
        fd = os.open(disk / "train.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            writer = LineWriter(fd)
            writer.write("before\n")
            filler = fill(disk)
            # The first fills what is left of the log's last block, and is cut: no exception,
            # the trainer lives on.
            writer.write("x" * 8192 + "\n" + "lost\n")
            filler.unlink()
            writer.write("after\n")
        finally:
            os.close(fd)
        lines = [line.split("] ", 1)[1] for line in (disk / "train.log").read_text().splitlines()]
        assert lines[0] == "before" and set(lines[1]) == {"x"} and len(lines[1]) < 8192
        assert lines[2:] == ["(2 log line(s) lost here: no space left on device)", "after"]
