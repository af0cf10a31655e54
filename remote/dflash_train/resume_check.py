"""python -m dflash_train.resume_check --config FILE --checkpoint DIR: whether a checkpoint
fits a config, asked by the agent's `resume` before it starts anything (exit 0, or exit 2
with the reason on stdout). Torch-free, so it answers in a second.

What it can tell without the data: the job keeps checkpoints, the drafter count and
`optim.accumulate` (the data order depends on both) and `optim.max_steps`. The data cursor needs the tokenized data and
is checked by the trainer at start-up (startup._check_cursor).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import TrainConfig, load_train_config


def mismatch(config: TrainConfig, folder: Path, step: int, replicas: int, world_size: int = 1,
             accumulate: int = 1) -> str | None:
    """Why the checkpoint of `step` written with `replicas` drafters in all and
    `accumulate` micro-batches a step cannot go on under `config` run by `world_size`
    processes (hosts)."""
    if config.job != "train":
        return f"job: {config.job} does not train a drafter from checkpoints"
    drafters = len(config.devices.drafters) * world_size
    if replicas != drafters:
        return (f"{folder} was trained with {replicas} drafters; this config has {drafters} "
                "(the data order depends on it)")
    if accumulate != config.optim.accumulate:
        return (f"{folder} was trained with optim.accumulate {accumulate} (micro-batches per step and drafter); "
                f"this config has optim.accumulate {config.optim.accumulate}: which micro-batches make a step "
                f"depends on it, so resume with optim.accumulate {accumulate}")
    if config.optim.max_steps is not None and step > config.optim.max_steps:
        return f"{folder} is at step {step}, past this config's optim.max_steps {config.optim.max_steps}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.resume_check", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint", required=True)
    args = parser.parse_args(argv)
    folder = Path(args.checkpoint)
    try:
        config = load_train_config(args.config)
        state = json.loads((folder / "state.json").read_text())
        # A resume runs on the hosts the checkpoint's run had: as many processes as then.
        problem = mismatch(config, folder, int(state["step"]), int(state["replicas"]), int(state.get("world_size", 1)),
                           int(state.get("accumulate", 1)))
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is why the resume is refused
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        print(problem)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
