"""dflash plot: one PNG of runs' loss, acceptance length and throughput over steps,
drawn from the events `watch` mirrored under logs/<host>/<run>/events.jsonl (nothing is
asked of the hosts: a run never watched has no events here, and is an error naming the
command that brings them)."""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import matplotlib
from dflash_contract.events import EVAL, STEP, EventType
from matplotlib.figure import Figure

from ..errors import DflashError, ExitCode
from ..local_state import RunLogs, RunRef, write_atomic
from ..scalars import history_of

matplotlib.use("Agg")  # files only: no display needed, none opened

# (title, event type, field) of each panel, top to bottom.
PANELS = [("loss", STEP, STEP.loss), ("acceptance length", EVAL, EVAL.acceptance_length),
          ("throughput (tokens/s)", STEP, STEP.tokens_per_s)]


def series(events: list[dict], kind: EventType, field: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one figure: the events of that type that have both."""
    points = [(e[kind.step], e[field]) for e in events if kind.matches(e)
              and isinstance(e.get(kind.step), int) and isinstance(e.get(field), (int, float))]
    return [step for step, _ in points], [value for _, value in points]


def load(logs_dir: Path, refs: list[RunRef]) -> dict[str, list[dict]]:
    """{legend label: events} of each run, as its attempts left them (a step a resume
    trained again is drawn once, with the value of the attempt that continued the run:
    scalars.History, the rule of every sink); the label is the run id, with its host
    when the runs come from several hosts."""
    several_hosts = len({ref.host for ref in refs}) > 1
    runs = {}
    for ref in refs:
        logs = RunLogs(logs_dir, ref)
        try:
            events = logs.load_events()
        except FileNotFoundError:
            raise DflashError(f"no events of run {ref.run_id} on {ref.host} here ({logs.events} is missing)",
                              ExitCode.USAGE, hint=f"dflash watch {ref.run_id} --host {ref.host} brings them") from None
        except ValueError as exc:
            raise DflashError(f"{logs.events}: not JSON lines ({exc})", ExitCode.USAGE) from None
        runs[f"{ref.host}/{ref.run_id}" if several_hosts else ref.run_id] = history_of(events).events()
    return runs


def figure(runs: dict[str, list[dict]]):
    """The matplotlib Figure: one panel per PANELS entry, one line per run in each."""
    fig = Figure(figsize=(8, 9), layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (title, kind, field) in zip(axes, PANELS):
        for label, events in runs.items():
            steps, values = series(events, kind, field)
            ax.plot(steps, values, label=label, marker="o" if kind is EVAL else None)
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel("step")
    return fig


@dataclasses.dataclass(frozen=True)
class Plotted:
    """The PNG written and the runs drawn in it."""
    path: Path
    refs: tuple[RunRef, ...]


def plot(logs_dir: Path, refs: list[RunRef], *, output: Path | None = None) -> Plotted:
    """The PNG written to `output` (default: ./<first run>.png)."""
    runs = load(logs_dir, refs)
    path = output or Path(f"{refs[0].run_id}.png")
    png = io.BytesIO()
    figure(runs).savefig(png, format="png", dpi=100)
    write_atomic(path, png.getvalue())
    return Plotted(path, tuple(refs))
