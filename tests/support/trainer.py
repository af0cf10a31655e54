"""The real trainer as the agent starts it: `python -m dflash_train` in its run dir, stdout and
stderr appended to train.log, the agent's environment; and what tests read of such a run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .events import read_events
from .wait import DEFAULT_TIMEOUT_S, wait_until

REPO = Path(__file__).resolve().parents[2]


class Launched:
    def __init__(self, run_dir: Path, proc: subprocess.Popen):
        self.run_dir, self.proc = run_dir, proc

    def events(self, type_: str | None = None) -> list[dict]:
        return read_events(self.run_dir / "events.jsonl", type_)

    def errors(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "errors.jsonl").read_text().splitlines()]

    def log(self) -> str:
        return (self.run_dir / "train.log").read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the trainer did not exit within {timeout}s; log tail:\n{self.log()[-3000:]}")

    def wait_for(self, what: str, predicate, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            wait_until(predicate, timeout, what,
                       give_up=lambda: None if self.proc.poll() is None else f"exit {self.proc.returncode}")
        except AssertionError as exc:
            pytest.fail(f"{exc}; log tail:\n{self.log()[-3000:]}")


def start_trainer(workspace: Path, run_dir: Path, config_text: str, run_id: str,
                  env: dict[str, str] | None = None) -> Launched:
    """`python -m dflash_train` on `config_text` in `run_dir`, as the agent starts it.
    `env`: more variables (e.g. a rank's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_text)
    env = {**os.environ, "PYTHONPATH": str(REPO / "remote"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "DFLASH_RUN_ID": run_id, "DFLASH_RELEASE_ID": "rel-test", "DFLASH_RELEASE_DIR": str(REPO),
           "DFLASH_WORKSPACE": str(workspace), **(env or {})}
    with open(run_dir / "train.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train", "--config", str(run_dir / "config.yaml"),
                                 "--run-dir", str(run_dir)], cwd=run_dir, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Launched(run_dir, proc)


def end(launched: Launched) -> None:
    if launched.proc.poll() is None:
        launched.proc.kill()
        launched.proc.wait()
