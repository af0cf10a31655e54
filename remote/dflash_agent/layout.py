"""Where things live under a workspace (docs/layout.md)."""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple


from dflash_contract.names import (AGENT_LOG, ERRORS_JSONL, EVENTS_JSONL, EXIT_JSON, MAX_RUN_ID, RUN_CONFIG, RUN_JSON,
                                   STOP_REQUESTED_JSON, TRAIN_LOG)

from .jsonio import AgentError


@dataclasses.dataclass(frozen=True)
class Workspace:
    root: str

    @classmethod
    def at(cls, path: str) -> "Workspace":
        return cls(os.path.abspath(os.path.expanduser(path)))

    @property
    def runs(self) -> str:
        return os.path.join(self.root, "runs")

    @property
    def locks(self) -> str:
        return os.path.join(self.root, "locks")

    @property
    def warm(self) -> str:
        """The warm interpreters' folders (warm.py)."""
        return os.path.join(self.root, "warm")

    @property
    def current(self) -> str:
        return os.path.join(self.root, "current")

    def run(self, run_id: str) -> "RunDir":
        check_run_id(run_id)
        return RunDir(run_id, os.path.join(self.runs, run_id))

    def existing_run(self, run_id: str) -> "RunDir":
        """The run, which must have started (run.json written)."""
        run = self.run(run_id)
        if not os.path.exists(run.run_json):
            raise AgentError("no run %r in %s" % (run_id, self.runs), "not_found")
        return run

    def all_runs(self) -> List["RunDir"]:
        """Every run that started (has run.json); a launch that failed before run.json
        was reported to its caller and never became a run."""
        try:
            names = os.listdir(self.runs)
        except FileNotFoundError:
            return []
        runs = [RunDir(name, os.path.join(self.runs, name)) for name in names]
        return [run for run in runs if os.path.exists(run.run_json)]

    def current_release(self) -> Tuple[str, str]:
        """(release id, release root) of `current`, resolved now: a run keeps the release
        it started from even when `current` moves on."""
        if not os.path.islink(self.current) and not os.path.isdir(self.current):
            raise AgentError("no release deployed in %s (no 'current')" % self.root, "not_found")
        root = os.path.realpath(self.current)
        if not os.path.isdir(root):
            raise AgentError("%s points to a missing release %s" % (self.current, root), "not_found")
        return os.path.basename(root), root

    def switch_current(self, release_id: Optional[str]) -> Optional[str]:
        """Point `current` at releases/<release_id> in one rename (None: remove it), as a
        deploy does; the id it named before (None: there was none)."""
        before = os.path.basename(os.readlink(self.current)) if os.path.islink(self.current) else None
        if release_id == before:
            return before
        if release_id is None:
            os.unlink(self.current)
            return before
        staging = os.path.join(self.root, ".current.%d" % os.getpid())
        if os.path.lexists(staging):
            os.unlink(staging)
        os.symlink(os.path.join("releases", release_id), staging)
        os.replace(staging, self.current)
        return before


@dataclasses.dataclass(frozen=True)
class RunDir:
    run_id: str
    path: str

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def run_json(self) -> str:
        return self.file(RUN_JSON)

    @property
    def exit_json(self) -> str:
        return self.file(EXIT_JSON)

    @property
    def stop_requested(self) -> str:
        return self.file(STOP_REQUESTED_JSON)

    @property
    def config(self) -> str:
        return self.file(RUN_CONFIG)

    @property
    def train_log(self) -> str:
        return self.file(TRAIN_LOG)

    @property
    def agent_log(self) -> str:
        return self.file(AGENT_LOG)

    @property
    def events(self) -> str:
        return self.file(EVENTS_JSONL)

    @property
    def errors(self) -> str:
        return self.file(ERRORS_JSONL)

    @property
    def faulthandler(self) -> str:
        return self.file("faulthandler.log")

    @property
    def threads_json(self) -> str:
        return self.file("threads.json")


def check_run_id(run_id: str) -> None:
    """Run ids become one path component: spaces and quotes are fine, separators not."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\0" in run_id or len(run_id) > MAX_RUN_ID:
        raise AgentError("invalid run id %r: one path component of at most %d characters, "
                         "without '/'" % (run_id, MAX_RUN_ID), "usage")
