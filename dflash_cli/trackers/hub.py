"""The sinks of one watch, and trackers.json (the package's docstring says how).

Imported by a watch only (watching.py, `dflash watch`, `--follow`): the other verbs do
not pay for it."""
from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any, Callable, Iterable

import yaml


from dflash_contract.records import parse_json_line
from dflash_contract.replies import RunStatus
from dflash_contract.states import RunState

from .. import DISTRIBUTION, console
from ..errors import DflashError, ExitCode
from ..local_state import RunLogs, RunRef, write_atomic
from ..scalars import History, history_of
from .config import PACKAGES, TrackerSettings
from .sink import Sink, TrackedRun

STATE_FILE = "trackers.json"  # logs/<host>/<run>/


def require_packages(settings: TrackerSettings, source: str) -> None:
    """Every configured tracker's package imports, or a DflashError (exit 2) naming it
    and the extra that installs it: said before a watch follows anything."""
    for name in settings.named:
        package = PACKAGES[name]
        try:
            importlib.import_module(package.module)
        except ImportError as exc:
            missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == package.module
            problem = "is not installed here" if missing else f"cannot be imported ({type(exc).__name__}: {exc})"
            raise DflashError(f"{source}: trackers.{name}: the Python package {package.pip} {problem}: "
                              f"pip install '{DISTRIBUTION}[{package.extra}]'", ExitCode.USAGE,
                              hint="or follow without trackers: dflash watch --no-trackers") from exc


def checked_settings(settings: TrackerSettings, source: str) -> TrackerSettings:
    """The trackers a watch feeds (dflash.yaml's, read from `source`), their packages
    checked (require_packages)."""
    require_packages(settings, source)
    return settings


def make_sink(name: str, settings: TrackerSettings) -> Sink:
    if name == "wandb":
        from .wandb_sink import WandbSink
        return WandbSink(settings.wandb)
    if name == "mlflow":
        from .mlflow_sink import MlflowSink
        return MlflowSink(settings.mlflow)
    from .trackio_sink import TrackioSink
    return TrackioSink(settings.trackio)


@dataclasses.dataclass(frozen=True)
class SinkState:
    """One record of trackers.json: a tracker and where it sent (its destination: a
    project, a tracking URI); `run`: the tracker's run id; `offset`: it was given every
    event of the local events.jsonl up to this byte; `steps`: the last step sent of
    each event kind; `rows`: how many scalar rows it was sent (W&B's step numbers, so a
    row sent again carries the number it had)."""
    tracker: str
    destination: str
    run: str | None = None
    offset: int = 0
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    rows: int = 0


def tracked_run(status: RunStatus, ref: RunRef, hosts: tuple[str, ...]) -> TrackedRun:
    """What the tracker run records of the run: its resolved config (config.yaml) and
    where its code came from (run.json's source)."""
    try:
        config = yaml.safe_load(status.config) if status.config else None
    except yaml.YAMLError:
        config = None
    provenance = {
        "run_id": ref.run_id, "name": status.name, "host": ref.host, "hosts": list(hosts) or [ref.host],
        "release_id": status.release_id, "attempt": status.attempt, "overrides": list(status.overrides),
        "source": {key: getattr(status.source, key, None) for key in (
            "kind", "path", "git_commit", "dirty", "diff_sha256", "modified_count", "dflash_version", "git_problem")},
    }
    return TrackedRun(ref.run_id, ref.host, status.name, config if isinstance(config, dict) else {}, provenance,
                      status.source.git_commit if status.source else None)


class Trackers:
    """The configured sinks of one watch of a run."""

    def __init__(self, settings: TrackerSettings, logs: RunLogs, label: str = ""):
        self.logs, self.label = logs, label
        self.sinks = [make_sink(name, settings) for name in settings.named]
        saved = self._load()
        self.states: dict[str, SinkState] = {}
        for sink in self.sinks:
            mine = [s for s in saved if (s.tracker, s.destination) == (sink.name, sink.destination)]
            self.states[sink.name] = mine[0] if mine else SinkState(sink.name, sink.destination)
        # Records of other trackers or destinations (a tracker configured elsewhere a
        # while) are kept as they are, for when they are configured again.
        self.others = [s for s in saved if s not in self.states.values()]
        # What trackers.json says each holds: the progress of a sink that holds what it
        # was sent only once closed (W&B) is recorded when it closed.
        self.held = dict(self.states)
        self.failures: dict[str, str] = {}  # sink name -> what it raised
        self.histories: dict[str, History] = {}  # sink name -> the history it holds (as of its offset)
        self.opened: list[Sink] = []
        self.started = False
        self._saved: list | None = None

    @property
    def path(self):
        return self.logs.dir / STATE_FILE

    def _load(self) -> list[SinkState]:
        """The records of trackers.json; one that cannot be read counts as none (its
        sinks start again, the trackers that can say what they hold from there)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        records = [_state_from(record) for record in data] if isinstance(data, list) else []
        return [record for record in records if record is not None]

    def _live(self) -> list[Sink]:
        return [sink for sink in self.opened if sink.name not in self.failures]

    def _guard(self, sink: Sink, work: Callable[[], Any]) -> bool:
        """`work` done, or the sink failed: said once, and nothing more is sent to it."""
        try:
            work()
            return True
        except Exception as exc:  # a tracker's own errors are many and undocumented
            if sink.name not in self.failures:
                self.failures[sink.name] = f"{type(exc).__name__}: {exc}".strip()
                console.warn(f"{self.label}tracker {sink.name} failed ({self.failures[sink.name]}): this watch "
                             f"goes on without it; the next `dflash watch {self.logs.ref.run_id}` sends it the "
                             "steps it lacks")
            return False

    def start(self, run: TrackedRun, mirrored: int) -> None:
        """Open every sink in the tracker run of this run (made or resumed), then give
        each what the local events.jsonl holds up to byte `mirrored` that it lacks."""
        self.started = True
        events = self._mirrored_events(0, mirrored)
        for sink in self.sinks:
            if self._guard(sink, lambda: self._open(sink, run, events)):
                self.opened.append(sink)
                console.say(f"{self.label}tracker {sink.name}: {sink.where()}")
        live = self._live()
        if live:
            start = min(self.states[s.name].offset for s in live)
            self.add([(end, event) for end, event in events if end > start])

    def _open(self, sink: Sink, run: TrackedRun, events: list[tuple[int, dict]]) -> None:
        """The sink opened in its tracker run, and the history it holds: that of the events
        up to its offset. Where the tracker says it holds other steps than those (a watch
        killed after sending and before recording, or one whose tracker lost what it
        buffered, or a rebuild cut short), it is rebuilt from every event mirrored."""
        state = self.states[sink.name]
        sink.open(run, state.run)
        history = history_of(event for end, event in events if end <= state.offset)
        held = sink.last_steps()
        if held is not None and held != history.last_steps():
            history = history_of(event for _, event in events)
            rows = sink.rebuild(history.values())
            state = dataclasses.replace(state, offset=events[-1][0] if events else 0, rows=rows)
        self.histories[sink.name] = history
        self.states[sink.name] = dataclasses.replace(state, run=sink.run_id, steps=history.last_steps())
        if not sink.holds_when_closed:
            self.held[sink.name] = self.states[sink.name]

    def _mirrored_events(self, start: int, end: int) -> list[tuple[int, dict]]:
        """(end offset, event) of each whole line of the local events.jsonl in [start, end)."""
        if start >= end:
            return []
        with open(self.logs.events, "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        found, offset = [], start
        for line in data.splitlines(keepends=True):
            offset += len(line)
            event = parse_json_line(line.rstrip(b"\n"))
            if line.endswith(b"\n") and isinstance(event, dict):
                found.append((offset, event))
        return found

    def add(self, events: Iterable[tuple[int, dict]]) -> None:
        """Events as mirrored: each with the byte of the local events.jsonl its line ends
        at. trackers.json is saved after each call (`follow` sends events at most once a
        second), so it never lags what the trackers got by more than one batch."""
        events = list(events)
        for sink in self._live():
            state, history = self.states[sink.name], self.histories[sink.name]
            offset, batch, rewound = state.offset, [], False
            for end, event in events:
                if end <= offset:
                    continue
                offset = end
                change = history.add(event)
                if change is not None and change.new is not None:
                    batch.append(change.new)
                rewound = rewound or (change is not None and change.rewind is not None)
            rows = state.rows
            # A rewind has the tracker run rebuilt from the history, which holds the
            # batch's other values too; a tracker run that holds nothing yet is sent it.
            if rewound:
                batch = history.values()
            work = (lambda: sink.rebuild(batch)) if rewound and state.rows else \
                (lambda: sink.send(batch, state.rows)) if batch else None
            if work is not None:
                done: list[int] = []
                if not self._guard(sink, lambda: done.append(work())):
                    continue
                rows = done[0]
            self.states[sink.name] = dataclasses.replace(state, offset=offset, steps=history.last_steps(),
                                                         rows=rows)
            if not sink.holds_when_closed:
                self.held[sink.name] = self.states[sink.name]
        self.save()

    def save(self) -> None:
        """trackers.json, when it changed."""
        if not self.started:
            return
        data = [dataclasses.asdict(state) for state in [*self.held.values(), *self.others]]
        if data != self._saved:
            write_atomic(self.path, json.dumps(data).encode())
            self._saved = data

    def close(self, outcome: RunState | None) -> None:
        """End this watch's part of each tracker run (`outcome`: the run's end state, or
        None when it goes on), then say which sinks failed and what they lack."""
        for sink in self._live():
            if self._guard(sink, lambda: sink.close(outcome)):
                self.held[sink.name] = self.states[sink.name]
        for sink in self.opened:
            if sink.name in self.failures:
                try:
                    sink.close(None)  # what it still holds may get through
                except Exception:
                    pass
        self.save()
        for sink in self.sinks:
            if sink.name in self.failures:
                step = self.held[sink.name].steps.get("step")
                rest = f"every step after {step}" if step is not None else "every step"
                console.warn(f"{self.label}tracker {sink.name} failed during this watch "
                             f"({self.failures[sink.name]}): the next `dflash watch {self.logs.ref.run_id}` "
                             f"sends it {rest}")


def _state_from(record: Any) -> SinkState | None:
    try:
        state = SinkState(**record)
    except TypeError:
        return None
    valid = (isinstance(state.tracker, str) and isinstance(state.destination, str) and isinstance(state.offset, int)
             and isinstance(state.rows, int) and isinstance(state.steps, dict)
             and all(isinstance(v, int) for v in state.steps.values())
             and (state.run is None or isinstance(state.run, str)))
    return state if valid else None
