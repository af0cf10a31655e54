"""The `trackers:` section of dflash.yaml (docs/cli.md "Trackers"): which experiment
trackers `watch` sends a run's scalars to, and where. Read by the strict loader."""
from __future__ import annotations

import dataclasses
import string
from typing import Literal

RUN_NAME_FIELDS = ("run_id", "name", "host")


def _check_run_name(template: str) -> None:
    """A run name template names only the run's id, name and host: `{name}-{run_id}`."""
    if not template.strip():
        raise ValueError("'run_name' must not be empty")
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as exc:
        raise ValueError(f"'run_name' {template!r}: {exc}") from None
    known = ", ".join("{" + f + "}" for f in RUN_NAME_FIELDS)
    for field in fields:
        if field not in RUN_NAME_FIELDS:
            raise ValueError(f"'run_name' {template!r}: unknown placeholder {{{field}}} (known: {known})")


def _not_empty(**values: str | None) -> None:
    for key, value in values.items():
        if value is not None and not value.strip():
            raise ValueError(f"{key!r} must not be empty")


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    mode: Literal["online", "offline"] = "online"  # offline: files that `wandb sync` uploads later
    project: str = "dflash"
    entity: str | None = None  # default: the W&B account's default entity
    dir: str | None = None  # wandb's files go to DIR/wandb/ (default: WANDB_DIR, else the current folder)
    run_name: str = "{run_id}"  # the display name; the W&B run id is the run id's
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _not_empty(project=self.project, entity=self.entity, dir=self.dir)
        _check_run_name(self.run_name)


@dataclasses.dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str  # file:./mlruns, sqlite:///mlflow.db, http://host:5000, ...
    experiment: str = "dflash"
    run_name: str = "{run_id}"

    def __post_init__(self) -> None:
        _not_empty(tracking_uri=self.tracking_uri, experiment=self.experiment)
        _check_run_name(self.run_name)


@dataclasses.dataclass(frozen=True)
class TrackioSettings:
    project: str = "dflash"  # stored where TRACKIO_DIR says (trackio's default: ~/.cache/huggingface/trackio)

    def __post_init__(self) -> None:
        _not_empty(project=self.project)


@dataclasses.dataclass(frozen=True)
class TrackerSettings:
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None
    trackio: TrackioSettings | None = None

    @property
    def named(self) -> list[str]:
        """The trackers configured, in this order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]


@dataclasses.dataclass(frozen=True)
class Package:
    module: str  # what the sink imports
    pip: str  # what installs it
    extra: str  # dflash's extra that installs it


PACKAGES = {
    "wandb": Package("wandb", "wandb", "wandb"),
    "mlflow": Package("mlflow", "mlflow-skinny", "mlflow"),
    "trackio": Package("trackio", "trackio", "trackio"),
}
