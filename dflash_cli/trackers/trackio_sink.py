"""trackio, in its local project storage (TRACKIO_DIR; trackio's default
~/.cache/huggingface/trackio), which `trackio show` serves.

The trackio run is named by the run id and resumed by that name; its group is the
run's name. Where a resume replaces values it holds, the trackio run is deleted and made
again with the run's history (trackio's logs are rows of a project database). trackio prints its notices on stdout, which is `watch`'s log: they are
dropped (`watch` says where the run is; trackio's warnings go to stderr as warnings).
Only the calling thread's output is dropped: of a run on several hosts, rank 0's part is
followed in a thread of its own while the others' lines are printed."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator


from dflash_contract.states import RunState

from ..scalars import Scalars
from .config import TrackioSettings
from .sink import KIND_MARKERS, Sink, TrackedRun


class _DropThisThread:
    """sys.stdout, but for what the thread that made it writes (dropped)."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._thread = threading.get_ident()

    def write(self, text: str) -> int:
        if threading.get_ident() == self._thread:
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_this_thread() -> Iterator[None]:
    """Meanwhile, what this thread writes to stdout is dropped."""
    with contextlib.redirect_stdout(_DropThisThread(sys.stdout)):
        yield


class TrackioSink(Sink):
    name = "trackio"

    def __init__(self, settings: TrackioSettings):
        self.settings = settings
        self.run: Any = None
        self._id = ""
        self._dir = ""
        self._tracked: TrackedRun | None = None

    @property
    def destination(self) -> str:
        return f"project {self.settings.project} in {os.environ.get('TRACKIO_DIR', 'the default folder')}"

    @property
    def run_id(self) -> str:
        return self._id

    def open(self, run: TrackedRun, known: str | None) -> None:
        self._id, self._tracked = run.run_id, run
        self._start()

    def _start(self) -> None:
        run = self._tracked
        with quiet_this_thread():
            import trackio

            self.run = trackio.init(project=self.settings.project, name=run.run_id, group=run.name,
                                    config={**run.config, "dflash": run.provenance}, resume="allow", embed=False,
                                    auto_log_gpu=False, auto_log_cpu=False)
        self._dir = str(trackio.utils.TRACKIO_DIR)

    def where(self) -> str:
        return (f"trackio run {self._id} of project {self.settings.project} in {self._dir} "
                f"(trackio show --project {self.settings.project!r})")

    def last_steps(self) -> dict[str, int]:
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs(self.settings.project, self._id)
        held = {}
        for kind, tag in KIND_MARKERS.items():
            steps = [row["step"] for row in rows if tag in row]
            if steps:
                held[kind] = max(steps)
        return held

    def send(self, batch: list[Scalars], first_row: int) -> int:
        for found in batch:
            self.run.log(dict(found.values), step=found.step)
        return first_row + len(batch)

    def rebuild(self, history: list[Scalars]) -> int:
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        with quiet_this_thread():
            trackio.finish()  # what it buffered is written before the run goes
        SQLiteStorage.delete_run(self.settings.project, self._id)
        self._start()
        return self.send(history, 0)

    def close(self, outcome: RunState | None) -> None:
        import trackio

        with quiet_this_thread():
            trackio.finish()  # also forgets it as trackio's current run, which it would finish again at exit
