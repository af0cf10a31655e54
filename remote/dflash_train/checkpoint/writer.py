"""Checkpoints written in the background: training is held only while the state is copied
off the device (`take_snapshot`, into CPU buffers made once and reused); a worker thread
named `checkpoint-writer` writes it.

One write at a time: a checkpoint due while the previous one is still being written
waits for it (and says so) before its copy, which reuses that one's buffers. The run's
exit waits for the last one, also on a stop, so the on-stop checkpoint is complete before
exit 143. The writer is a `JobThread`: a failed write (disk full) is its errors.jsonl record
and the run's failure, never a silent loss.
A plain thread over a CPU snapshot rather than torch.distributed.checkpoint's async save:
the checkpoint stays the same files (safetensors, optimizer.pt, SHA256SUMS) that resume,
export and `dflash pull` read, written by the same atomic replace_dir, with no process
group to set up in a single-process trainer.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dflash_contract.events import CHECKPOINT

from ..runlog import EventLog, say
from ..threads import StopLatch, StopRequested, JobThread
from .folders import CheckpointSnapshot, SnapshotBuffers, write_checkpoint

if TYPE_CHECKING:
    import torch

WRITER = "checkpoint-writer"


class CheckpointWriter:
    def __init__(self, root: Path, keep: int, config_yaml: str, events: EventLog, latch: StopLatch):
        self.root, self.keep, self.config_yaml = root, keep, config_yaml
        self.events, self.latch = events, latch
        self._worker: JobThread | None = None
        self._work = ""  # what the writer thread does or did last, for a checkpoint that waits for it
        self.buffers = SnapshotBuffers()  # where every snapshot of this run is copied

    def save(self, take: Callable[[SnapshotBuffers], CheckpointSnapshot]) -> None:
        """Once the previous write is complete, `take` the snapshot into the buffers (the
        time training is held), then write it in the background."""
        waited_for = self._work
        waited_s = self.wait()
        start = time.perf_counter()
        snapshot = take(self.buffers)
        held_s = time.perf_counter() - start
        step = snapshot.state.step
        if waited_s >= 0.01:
            say(f"checkpoint at step {step} waited {waited_s:.2f}s for {waited_for}")

        def body(worker: JobThread) -> None:
            worker.phase, worker.step = "checkpoint", step
            start = time.perf_counter()
            path = write_checkpoint(self.root, snapshot, self.keep, self.config_yaml)
            write_s = time.perf_counter() - start
            self.events.emit(CHECKPOINT, step=step, path=str(path), held_s=round(held_s, 4),
                             write_s=round(write_s, 4), waited_s=round(waited_s, 4))
            say(f"checkpoint at step {step}: {path} (training held {held_s:.2f}s, written in {write_s:.2f}s)")

        self._in_background("the previous one to be written", body)

    def reserve(self, layout: list[tuple[str, torch.Size, torch.dtype, bool]]) -> None:
        """Make the snapshot buffers of `layout` in the background, in the writer's slot:
        the first checkpoint waits for them instead of pinning them itself while
        training is held."""
        self.wait()

        def body(worker: JobThread) -> None:
            worker.phase = "checkpoint buffers"
            start = time.perf_counter()
            made = self.buffers.reserve(layout)
            if made and any(pinned for *_, pinned in layout):  # on a CPU run: instant, not worth a line
                say(f"checkpoint buffers: {made / 1e9:.2f} GB pinned in {time.perf_counter() - start:.2f}s, "
                    "while training")

        self._in_background("the checkpoint buffers to be made", body)

    def _in_background(self, work: str, body: Callable[[JobThread], None]) -> None:
        """Start `body` as the writer thread (the slot is free: the callers waited)."""
        self._work = work
        self._worker = JobThread(WRITER, self.latch, body)
        self._worker.start()

    @property
    def writing(self) -> bool:
        """Whether a checkpoint is being written now."""
        return self._worker is not None and self._worker.is_alive()

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
