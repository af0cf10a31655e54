"""Checkpoints written in the background: training is held only while the state is copied
off the device (`take_snapshot`); a worker thread named `checkpoint-writer` writes it.

One write at a time: a checkpoint due while the previous one is still being written
waits for it (and says so). The run's exit waits for the last one, also on a stop, so
the on-stop checkpoint is complete before exit 143. The writer is a `JobThread`: a failed
write (disk full) is its errors.jsonl record and the run's failure, never a silent loss.
A plain thread over a CPU snapshot rather than torch.distributed.checkpoint's async save:
the checkpoint stays the same files (safetensors, optimizer.pt, SHA256SUMS) that resume,
export and `dflash pull` read, written by the same atomic replace_dir, with no process
group to set up in a single-process trainer.
"""
from __future__ import annotations

import time
from pathlib import Path

from .checkpoint import CheckpointSnapshot, write_checkpoint
from .runlog import EventLog, say
from .threads import StopLatch, StopRequested, JobThread

WRITER = "checkpoint-writer"


class CheckpointWriter:
    def __init__(self, root: Path, keep: int, config_yaml: str, events: EventLog, latch: StopLatch):
        self.root, self.keep, self.config_yaml = root, keep, config_yaml
        self.events, self.latch = events, latch
        self._worker: JobThread | None = None

    def submit(self, snapshot: CheckpointSnapshot, held_s: float) -> None:
        """Write `snapshot` in the background, once the previous write is complete."""
        step = snapshot.state.step
        waited_s = self.wait()
        if waited_s >= 0.01:
            say(f"checkpoint at step {step} waited {waited_s:.2f}s for the previous one to be written")

        def body(worker: JobThread) -> None:
            worker.phase, worker.step = "checkpoint", step
            start = time.perf_counter()
            path = write_checkpoint(self.root, snapshot, self.keep, self.config_yaml)
            write_s = time.perf_counter() - start
            self.events.emit("checkpoint", step=step, path=str(path), held_s=round(held_s, 4),
                             write_s=round(write_s, 4), waited_s=round(waited_s, 4))
            say(f"checkpoint at step {step}: {path} (training held {held_s:.2f}s, written in {write_s:.2f}s)")

        self._worker = JobThread(WRITER, self.latch, body)
        self._worker.start()

    def wait(self) -> float:
        """Block until the checkpoint being written is complete; the seconds waited. A
        failed write was recorded by the writer and stopped the run: StopRequested."""
        worker, start = self._worker, time.perf_counter()
        if worker is None:
            return 0.0
        worker.join()  # a write must finish, however long the disk takes: it is the run's state
        if worker.failed is not None:
            raise StopRequested(f"{WRITER} failed")
        return time.perf_counter() - start
