"""Weights & Biases: online, or offline files that `wandb sync` uploads later.

The W&B run id is the dflash run id (made safe for W&B), so every watch of a run, and
every attempt's, resumes one W&B run (offline: one folder per watch, which `wandb sync`
uploads in order as one run). Rows carry `train/global_step`, the x-axis of every
metric (as transformers' WandbCallback does): an eval measured in the background may
arrive after later steps, and W&B's own step must only grow, so it numbers rows.

Rows reach the run's files through W&B's service process: they are held once the run
finished. Rows sent again (after a watch or the service died) carry the numbers they had;
an online run resumed says how many it holds, and those are not sent again.

Row 0 of every W&B run holds `train/global_step` 0 only. Where a resume replaces values
the W&B run holds, the run is rewound to it (W&B's rewind, `resume_from="ID?_step=0"`:
the rows after it are dropped) and the run's history sent again from row 1: a rewind
needs the rows it keeps to be untouched by the replacement, which row 0 always is."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Any


from dflash_contract.states import RunState

from ..scalars import Scalars
from .config import WandbSettings
from .sink import Sink, TrackedRun

STEP_METRIC = "train/global_step"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_ID = 64


def wandb_run_id(run_id: str) -> str:
    """`run_id` if W&B takes it as it is, else a safe prefix and a hash of the whole."""
    safe = _UNSAFE.sub("-", run_id)
    if safe == run_id and len(run_id) <= MAX_ID:
        return run_id
    return f"{safe[:MAX_ID - 17]}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


class WandbSink(Sink):
    name = "wandb"
    holds_when_closed = True

    def __init__(self, settings: WandbSettings):
        self.settings = settings
        self.run: Any = None
        self._id = ""
        self._held_rows = 0  # rows the resumed run holds already (online; offline it cannot tell)
        self._tracked: TrackedRun | None = None

    @property
    def destination(self) -> str:
        s = self.settings
        where = f" in {Path(s.dir or os.environ.get('WANDB_DIR') or '.').resolve()}" if s.mode == "offline" else ""
        return f"{s.mode} {s.entity or ''}/{s.project}{where}"

    @property
    def run_id(self) -> str:
        return self._id

    def open(self, run: TrackedRun, known: str | None) -> None:
        self._id, self._tracked = wandb_run_id(run.run_id), run
        if self.settings.dir:
            Path(self.settings.dir).mkdir(parents=True, exist_ok=True)
        self._start(resume="allow")
        self._held_rows = int(self.run.step)

    def _start(self, **how: str) -> None:
        """wandb.init of this run: `resume="allow"`, or `resume_from` for a rewind."""
        import wandb

        s, run = self.settings, self._tracked
        # This machine only relays the run: its console, system metrics, code, packages
        # and checkout are not the run's; the commit is the deployed tree's.
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_machine_info=True,
                                  save_code=False, x_save_requirements=False, git_commit=run.git_commit,
                                  disable_git=run.git_commit is None)
        self.run = wandb.init(project=s.project, entity=s.entity, dir=s.dir, id=self._id,
                              name=run.run_name(s.run_name), tags=list(s.tags) or None, mode=s.mode,
                              settings=settings, **how)
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        # An attempt on another release (resume --release current) updates the record.
        self.run.config.update({**run.config, "dflash": run.provenance}, allow_val_change=True)

    def where(self) -> str:
        if self.settings.mode == "online":
            return f"W&B run {self._id}: {self.run.url}"
        folder = Path(self.run.dir).parent
        return (f"W&B offline run {self._id} in {folder} (upload: wandb sync "
                f"{folder.parent / ('offline-run-*-' + self._id + '*')})")

    def send(self, batch: list[Scalars], first_row: int) -> int:
        rows = [{STEP_METRIC: found.step, **dict(found.values)} for found in batch]
        if first_row == 0:
            rows.insert(0, {STEP_METRIC: 0})  # the row a rebuild rewinds to
        for row, data in enumerate(rows, first_row):
            if row >= self._held_rows:
                self.run.log(data, step=row)
        return first_row + len(rows)

    def rebuild(self, history: list[Scalars]) -> int:
        self.run.finish()  # its rows are written before the rewind drops them
        self._start(resume_from=f"{self._id}?_step=0")
        self._held_rows = 1
        return self.send(history, 1)

    def close(self, outcome: RunState | None) -> None:
        import wandb

        try:
            self.run.finish(exit_code=1 if outcome is not None and outcome.failed else 0)
        except Exception:
            # Its service is gone or broken: let go of it now, or W&B's exit hook prints
            # the same failure again as a traceback when watch exits.
            with contextlib.suppress(Exception, SystemExit):
                wandb.teardown()
            raise
