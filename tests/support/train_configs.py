"""Training configs for tests and benchmarks: the tiny CPU config, made smaller."""
from __future__ import annotations

from pathlib import Path

import yaml

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "train" / "tiny-cpu.yaml"


def small_config(path: Path, **changes) -> Path:
    """Write to `path` the tiny CPU config shrunk to seconds per run; each keyword
    replaces a top-level key, or with a dict value updates that section."""
    config = yaml.safe_load(TINY_CPU.read_text())
    config["data"]["synthetic"].update(num_train=32, num_eval=2, response_tokens=24)
    config["optim"]["max_steps"] = 12
    config["eval"].update(num_prompts=2, max_new_tokens=16)
    config["checkpoint"]["every"] = 0
    for key, value in changes.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path
