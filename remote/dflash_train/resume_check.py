"""python -m dflash_train.resume_check --config FILE --checkpoint DIR: whether a checkpoint
fits a config, asked by the agent's `resume` before it starts anything (exit 0, or exit 2
with the reason on stdout). Torch-free, so it answers in a second.

It asks checkpoint.state.fits without the data: the job keeps checkpoints, the drafter
count and `optim.accumulate` (the data order depends on both) and `optim.max_steps`.
Whether the data has the step and the data cursor need the tokenized data: the trainer
asks those at start-up.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .checkpoint.state import TrainingState, fits
from .config import load_job_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.resume_check", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True)
    args = parser.parse_args(argv)
    folder = Path(args.checkpoint)
    try:
        config = load_job_config(args.config)
        state = TrainingState.read(folder)
        # A resume runs on the hosts the checkpoint's run had: as many processes as then.
        problem = fits(state, config, folder, state.world_size)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is why the resume is refused
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        print(problem)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
