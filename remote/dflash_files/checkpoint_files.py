"""The names of a run's checkpoints and export (docs/layout.md): the trainer writes them
(dflash_train/checkpoint/folders.py), the agent finds, checks and sends them.

checkpoints/step_NNNNNN/ is one checkpoint, `latest` a symlink to the newest; export/
is the trained drafter. Each such folder is filled beside its place and renamed into it
whole; SHA256SUMS, written after its other files, lists them.
"""
from __future__ import annotations

import re

CHECKPOINTS_DIR = "checkpoints"  # in the run directory
LATEST = "latest"  # in CHECKPOINTS_DIR: the symlink to the newest step folder
EXPORT_DIR = "export"  # in the run directory
STATE_FILE = "state.json"  # step, data cursor, loss history, replicas, world size, accumulate
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"  # the optimizer's and the scheduler's states
CONFIG_FILE = "config.yaml"  # the resolved config of the run that wrote it
SHA256SUMS = "SHA256SUMS"
# What a resume loads: SHA256SUMS must list them (dflash_files.checksums.verify).
LOADED_FILES = (STATE_FILE, WEIGHTS_FILE, OPTIMIZER_FILE)
# A step folder holding these is complete (SHA256SUMS is written last); it is intact
# when its files hold what SHA256SUMS lists.
CHECKPOINT_FILES = LOADED_FILES + (SHA256SUMS,)
STEP_FOLDER = re.compile(r"^step_(\d+)$")


def step_folder(step: int) -> str:
    """The folder name of the checkpoint of `step`, in CHECKPOINTS_DIR."""
    return "step_%06d" % step
