"""A checkpoint's training state (its state.json) and the one rule for whether a
checkpoint can go on under a config (`fits`), asked by the trainer at start-up and by
the agent's resume before it starts anything (resume_check.py).

Torch-free (the config and the standard library), so that resume_check answers in a
second; folders.py writes and loads the rest of a checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Protocol

from dflash_files.checkpoint_files import STATE_FILE

from ..config import JobConfig


@dataclasses.dataclass
class TrainingState:
    step: int  # optimizer steps completed
    epoch: int  # data cursor: the epoch and micro-batch index of the last batch used
    batch_index: int
    replicas: int  # drafter replicas in the whole run (every process's): the data order depends on it
    losses: list[float]  # loss per step so far, so a resumed run carries its curve on
    world_size: int = 1  # processes of the run that wrote it (absent in older checkpoints: 1)
    accumulate: int = 1  # optim.accumulate: micro-batches per step and replica (absent in older checkpoints: 1)

    @classmethod
    def read(cls, folder: Path) -> TrainingState:
        """The state.json of the checkpoint `folder`."""
        return cls(**json.loads((folder / STATE_FILE).read_text()))

    def write(self, folder: Path) -> None:
        """state.json into `folder`, a checkpoint being filled: the folder is moved into
        place whole once every file is written (folders.replace_dir)."""
        (folder / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self)) + "\n")


class DataPosition(Protocol):
    epoch: int
    index: int  # micro-batch index within the epoch


class DataOrder(Protocol):
    """Where a config's data puts every step (data.batches.BatchPlan)."""

    total_steps: int

    def last_entry(self, step: int) -> DataPosition:
        """The last micro-batch `step` uses: the data cursor a checkpoint of that step records."""


def fits(state: TrainingState, config: JobConfig, folder: Path, world_size: int,
         data: DataOrder | None = None) -> str | None:
    """Why the checkpoint `folder`, holding `state`, cannot go on under `config` run by
    `world_size` processes, or None when it can. `data`: the plan of the config's data;
    without it (it needs the data tokenized) what only the data tells is not checked:
    whether the data has the checkpoint's step, and whether the data cursor is where it
    puts that step."""
    if config.job != "train":
        return f"job: {config.job} does not train a drafter from checkpoints"
    local = len(config.devices.drafters)
    # Micro-batches go to replicas by their index in the run, so a checkpoint resumes with
    # as many replicas in all, however they are spread over processes (then the sum of the
    # gradients only runs in another order).
    if state.replicas != world_size * local:
        return (f"{folder} was trained with {state.replicas} drafter replica(s) in all ({state.world_size} "
                f"process(es)); this run has {world_size * local} ({world_size} process(es) x {local} drafters): "
                f"the data order depends on the number of replicas, so resume with {state.replicas} in all (e.g. "
                f"{state.world_size} process(es) x {state.replicas // state.world_size} drafters)")
    if state.accumulate != config.optim.accumulate:
        return (f"{folder} was trained with optim.accumulate {state.accumulate} (micro-batches per step and "
                f"drafter); this config has optim.accumulate {config.optim.accumulate}: which micro-batches make "
                f"a step depends on it, so resume with optim.accumulate {state.accumulate}")
    if config.optim.max_steps is not None and state.step > config.optim.max_steps:
        return f"{folder} is at step {state.step}, past this config's optim.max_steps {config.optim.max_steps}"
    if data is None:
        return None
    if state.step > data.total_steps:
        return f"{folder} is at step {state.step}, past this config's {data.total_steps} steps"
    # A cursor elsewhere: the data or its batching changed, and resuming would silently train on other batches.
    entry = data.last_entry(state.step)
    if (entry.epoch, entry.index) != (state.epoch, state.batch_index):
        return (f"{folder}: its data cursor (epoch {state.epoch}, batch {state.batch_index}) is not where this "
                f"config's data puts step {state.step} (epoch {entry.epoch}, batch {entry.index}); the data, "
                f"token_budget or seed changed since it was written")
    return None
