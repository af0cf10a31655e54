"""TensorBoard event files of a run, written here from the events `watch` receives
(docs/cli.md "Local state"): the hosts need nothing new, and `tensorboard --logdir logs`
shows every run of every host, one run per logs/<host>/<run-id>/.

The writer is TensorBoard's own EventFileWriter (the one torch.utils.tensorboard uses),
imported only when a run has something to write: tensorboardX's SummaryWriter imports
torch whenever torch is installed, which the CLI must not pay for.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from .scalars import scalars


class RunBoard:
    """Appends a run's scalars to TensorBoard event files in `folder`.

    Each writer (one per `watch`) starts its file with a session-start record at the
    step of its first event: TensorBoard's readers then drop whatever an earlier file
    holds from that step on. That covers the one window where a step could be written
    twice: a watch killed after writing here and before saving its cursor, whose
    successor receives those events again."""

    def __init__(self, folder: Path):
        self._folder = folder
        self._writer = None
        self._event_pb2: Any = None  # TensorBoard's protobuf modules, imported with the writer
        self._summary_pb2: Any = None

    def add(self, events: Iterable[dict]) -> None:
        for event in events:
            found = scalars(event)
            if found is None:
                continue
            if self._writer is None:
                self._open(found.step, found.wall_time)
            summary = self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
                                                       for tag, value in found.values])
            self._writer.add_event(self._event_pb2.Event(wall_time=found.wall_time, step=found.step,
                                                         summary=summary))

    def _open(self, step: int, wall_time: float) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self._folder))
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._writer.add_event(event_pb2.Event(wall_time=wall_time, step=step, session_log=start))

    def flush(self) -> None:
        """On disk before the cursor that accounts for these events is saved."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
