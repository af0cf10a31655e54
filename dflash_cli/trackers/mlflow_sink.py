"""MLflow, through any tracking URI its client takes: a file store (`file:./mlruns`, a
plain path), `sqlite:///mlflow.db`, a tracking server.

The MLflow run is found again by its tag `dflash.run_id`, so every watch of a run and
every attempt's resume one MLflow run. Params are the resolved training config,
flattened (`optim.lr`); MLflow's params never change, so a watch adds only those the
run lacks. Tags hold the provenance (`mlflow.source.git.commit`, `dflash.*`), updated
by each watch.

MLflow cannot take back a metric's value: where a resume replaces values the MLflow run
holds, a new MLflow run is made with the run's history (and its params and tags), and
the old one deleted (MLflow's delete: `mlflow gc` removes it for good). The new one is
tagged with the id of the one it replaces until that is deleted, so a watch killed in
between finds the old one whole and deletes the half-made one."""
from __future__ import annotations

import json
import os
import time
import urllib.parse
from typing import Any, Iterator


from dflash_contract.states import RunState

from ..scalars import Scalars
from .config import MlflowSettings
from .sink import KIND_MARKERS, Sink, TrackedRun

RUN_TAG = "dflash.run_id"
REPLACES_TAG = "dflash.replaces"  # on a rebuilt MLflow run until the run it replaces is deleted
_NAME_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-. :/")


def metric_name(tag: str) -> str:
    """MLflow refuses '@' in a name: `train/acc@1` is `train/acc_at_1` there."""
    return tag.replace("@", "_at_")


def _safe_key(key: str) -> str:
    return "".join(c if c in _NAME_CHARACTERS else "_" for c in key)


def flatten(data: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every leaf: strings as they are, anything else as JSON."""
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from flatten(value, f"{prefix}{_safe_key(str(key))}.")
    elif prefix:
        yield prefix[:-1], data if isinstance(data, str) else json.dumps(data)


def is_file_store(uri: str) -> bool:
    return urllib.parse.urlparse(uri).scheme in ("", "file")


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, settings: MlflowSettings):
        self.settings = settings
        self.client: Any = None
        self._id = ""
        self._experiment_id = ""
        self._tags: dict[str, str] = {}
        self._params: list[tuple[str, str]] = []

    @property
    def destination(self) -> str:
        return f"{self.settings.tracking_uri} experiment {self.settings.experiment}"

    @property
    def run_id(self) -> str:
        return self._id

    def open(self, run: TrackedRun, known: str | None) -> None:
        s = self.settings
        if is_file_store(s.tracking_uri):
            # MLflow 3 keeps its file store only for those who ask: a file store named in
            # dflash.yaml is that request.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient
        from mlflow.utils import validation

        self.client = client = MlflowClient(tracking_uri=s.tracking_uri)
        experiment = client.get_experiment_by_name(s.experiment)
        self._experiment_id = experiment.experiment_id if experiment else client.create_experiment(s.experiment)
        found = self._find(run.run_id, known)
        self._tags = {"mlflow.runName": run.run_name(s.run_name), RUN_TAG: run.run_id,
                      **({"mlflow.source.git.commit": run.git_commit} if run.git_commit else {}),
                      **{f"dflash.{key}": value for key, value in flatten(
                          {k: v for k, v in run.provenance.items() if k != "run_id"}) if value != "null"}}
        self._params = [(key[:validation.MAX_ENTITY_KEY_LENGTH], value[:validation.MAX_PARAM_VAL_LENGTH])
                        for key, value in flatten(run.config)]
        if found is None:
            found = client.create_run(self._experiment_id, run_name=self._tags["mlflow.runName"])
        elif found.info.status != "RUNNING":
            client.update_run(found.info.run_id, status="RUNNING")
        self._id = found.info.run_id
        self._describe(self._id, held=found.data.params)

    def _describe(self, mlflow_run: str, held: dict[str, str]) -> None:
        """The params `mlflow_run` lacks (they never change) and every tag."""
        from mlflow.entities import Param, RunTag
        from mlflow.utils import validation

        params = [Param(key, value) for key, value in self._params if key not in held]
        for chunk in _chunks(params, validation.MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(mlflow_run, params=chunk)
        run_tags = [RunTag(key, value[:validation.MAX_TAG_VAL_LENGTH]) for key, value in self._tags.items()]
        for chunk in _chunks(run_tags, validation.MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(mlflow_run, tags=chunk)

    def _find(self, run_id: str, known: str | None) -> Any:
        """The MLflow run of `run_id`: the one trackers.json named, else the one tagged so.
        A rebuild cut short is settled first: a rebuilt run whose old one is still there
        is half made (deleted); one whose old one is gone is whole (its mark removed)."""
        from mlflow.exceptions import MlflowException

        quote = "'" if "'" not in run_id else '"'
        if quote in run_id:
            return None  # a filter cannot spell it; a new MLflow run it is
        runs = self.client.search_runs([self._experiment_id],
                                       filter_string=f"tags.`{RUN_TAG}` = {quote}{run_id}{quote}",
                                       order_by=["attributes.start_time ASC"])
        active = {run.info.run_id for run in runs}
        whole = []
        for run in runs:
            replaced = run.data.tags.get(REPLACES_TAG)
            if replaced in active:
                self.client.delete_run(run.info.run_id)
                continue
            if replaced is not None:
                self.client.delete_tag(run.info.run_id, REPLACES_TAG)
            whole.append(run)
        if known:
            try:
                run = self.client.get_run(known)
            except MlflowException:
                run = None
            if run is not None and run.info.run_id in {r.info.run_id for r in whole}:
                return run
        return whole[0] if whole else None

    def where(self) -> str:
        return f"MLflow run {self._id} in {self.settings.tracking_uri}, experiment {self.settings.experiment}"

    def last_steps(self) -> dict[str, int]:
        held = {}
        for kind, tag in KIND_MARKERS.items():
            history = self.client.get_metric_history(self._id, metric_name(tag))
            if history:
                held[kind] = max(metric.step for metric in history)
        return held

    def send(self, batch: list[Scalars], first_row: int) -> int:
        self._log(self._id, batch)
        return first_row + len(batch)

    def _log(self, mlflow_run: str, batch: list[Scalars]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils import validation

        metrics = [Metric(metric_name(tag), value, int(found.wall_time * 1000) or int(time.time() * 1000), found.step)
                   for found in batch for tag, value in found.values]
        for chunk in _chunks(metrics, validation.MAX_METRICS_PER_BATCH):
            self.client.log_batch(mlflow_run, metrics=chunk)

    def rebuild(self, history: list[Scalars]) -> int:
        old = self._id
        new = self.client.create_run(self._experiment_id, run_name=self._tags["mlflow.runName"],
                                     tags={REPLACES_TAG: old}).info.run_id
        self._describe(new, held={})
        self._log(new, history)
        self.client.delete_run(old)
        self.client.delete_tag(new, REPLACES_TAG)
        self._id = new
        return len(history)

    def close(self, outcome: RunState | None) -> None:
        if (status := end_status(outcome)) is not None:
            self.client.set_terminated(self._id, status)


def end_status(outcome: RunState | None) -> str | None:
    """How the run ended, as MLflow's run status; None: it goes on (and stays RUNNING)."""
    if outcome is None or not outcome.terminal:
        return None
    return "FAILED" if outcome.failed else "KILLED" if outcome is RunState.STOPPED else "FINISHED"
