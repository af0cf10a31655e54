"""dflash.yaml: settings of the CLI on this machine that no host needs (docs/cli.md
"Trackers"). It lives beside configs/, not in it: configs/ is deployed with every
release, and a change of where this machine sends its metrics must not make a new one.

`--cli-config FILE` or DFLASH_CLI_CONFIG picks another file; otherwise ./dflash.yaml is
read when present.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import dflash_schema

from .errors import DflashError, ExitCode
from .project_tree import in_state_root
from .trackers.config import TrackerSettings

DEFAULT_LOCAL_CONFIG = Path("dflash.yaml")


@dataclasses.dataclass(frozen=True)
class LocalConfig:
    trackers: TrackerSettings = TrackerSettings()
    source: str = dataclasses.field(default="", metadata={"internal": True})  # the file read, or ""


def load_local_config(path: str | os.PathLike[str] | None = None) -> LocalConfig:
    """The file named by `path`, DFLASH_CLI_CONFIG or ./dflash.yaml. A file named
    explicitly must exist; without the default one nothing is configured."""
    explicit = path or os.environ.get("DFLASH_CLI_CONFIG")
    file = Path(explicit) if explicit else Path(in_state_root(str(DEFAULT_LOCAL_CONFIG)))
    if not file.exists():
        if explicit:
            raise DflashError(f"{file}: CLI config file not found", ExitCode.USAGE)
        return LocalConfig()
    try:
        data = dflash_schema.read_yaml(file)
        trackers = data.get("trackers") if isinstance(data, dict) else None
        if isinstance(trackers, dict):
            # A tracker named with nothing under it (`trackio:`) takes its defaults.
            data["trackers"] = {name: {} if value is None else value for name, value in trackers.items()}
        config = dflash_schema.load(LocalConfig, data, str(file))
    except dflash_schema.SchemaError as exc:
        raise DflashError(str(exc), ExitCode.USAGE) from exc
    return dataclasses.replace(config, source=str(file))
