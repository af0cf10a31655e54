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

from dflash_contract.events import TS

from .scalars import History, Scalars


class RunBoard:
    """Appends a run's scalars to TensorBoard event files in `folder`, as its history
    (scalars.History, given as the events before this watch left it) says.

    A session-start record at a step makes TensorBoard's readers drop every value an
    earlier record holds from that step on. Each writer (one per `watch`) starts its file
    with one at the step of its first value: a step written by a watch killed before it
    saved its cursor, and received again by its successor, shows once. And where the
    history is rewound (a resume replaces the steps after its checkpoint, or a value of
    its own replaces an earlier attempt's), one at that step is written, then the
    history's values from there on: the attempt that continued the run is what shows."""

    def __init__(self, folder: Path, history: History):
        self._folder = folder
        self._history = history
        self._writer = None
        self._event_pb2: Any = None  # TensorBoard's protobuf modules, imported with the writer
        self._summary_pb2: Any = None

    def add(self, events: Iterable[dict]) -> None:
        for event in events:
            change = self._history.add(event)
            if change is None:
                continue
            if change.new is not None:
                self._write(change.new)
                continue
            self._restart(change.rewind, float(event.get(TS) or 0.0))
            for found in self._history.values(change.rewind):
                self._write(found)

    def _write(self, found: Scalars) -> None:
        if self._writer is None:
            self._open(found.step, found.wall_time)
        summary = self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
                                                   for tag, value in found.values])
        self._writer.add_event(self._event_pb2.Event(wall_time=found.wall_time, step=found.step, summary=summary))

    def _open(self, step: int, wall_time: float) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self._folder))
        self._restart(step, wall_time)

    def _restart(self, step: int, wall_time: float) -> None:
        """A session-start record at `step`: the readers drop what is before it from there on."""
        if self._writer is None:
            self._open(step, wall_time)  # which writes it
            return
        start = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
        self._writer.add_event(self._event_pb2.Event(wall_time=wall_time, step=step, session_log=start))

    def flush(self) -> None:
        """On disk before the cursor that accounts for these events is saved."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
