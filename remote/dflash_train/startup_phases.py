"""Start-up as progress: each phase of a run's start-up (import, build data, load target,
compile cache, each drafter's train step, ...) as `startup` events in events.jsonl and a
line in train.log, so `watch` shows where a starting run is instead of a silent minute.

    with phase("load target", device="cuda:0"):
        ...
    with phase("build train step", drafter=0, cache="cold") as detail:
        detail["buckets"] = 4          # facts known only at the end go into the done event

Any module calls `phase` without being handed the event log: the coordinator names the
run's log once (`record_to`); before that, and in code run outside a trainer (benchmarks,
tests), phases only time their body. Event fields are listed in DESIGN.md ("events.jsonl").
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

from .runlog import EventLog, say

EVENT = "startup"
_events: EventLog | None = None


def record_to(events: EventLog | None) -> None:
    """Where phases are recorded from now on (None: nowhere)."""
    global _events
    _events = events


def label(name: str, detail: dict[str, Any]) -> str:
    """How a phase reads on screen: "build train step drafter 0 (cold)"."""
    text = name if detail.get("drafter") is None else f"{name} drafter {detail['drafter']}"
    return f"{text} ({detail['cache']})" if detail.get("cache") else text


def record(name: str, duration_s: float, state: str = "done", **detail: Any) -> None:
    """A phase measured by its caller: one `startup` event and one log line."""
    duration_s = max(0.0, duration_s)
    if _events is not None:
        _events.emit(EVENT, phase=name, state=state, label=label(name, detail), duration_s=round(duration_s, 3),
                     **detail)
    say(f"start-up: {label(name, detail)} {'failed after ' if state == 'failed' else ''}{duration_s:.1f} s")


@contextlib.contextmanager
def phase(name: str, **detail: Any) -> Iterator[dict[str, Any]]:
    """Time the body as start-up phase `name`: a `started` event now, a `done` (or
    `failed`, then the exception goes on) event with its duration at the end. The
    yielded dict is the event's detail: the body may add to it."""
    if _events is not None:
        _events.emit(EVENT, phase=name, state="started", label=label(name, detail), **detail)
    began = time.monotonic()
    try:
        yield detail
    except BaseException:
        record(name, time.monotonic() - began, state="failed", **detail)
        raise
    record(name, time.monotonic() - began, **detail)


def process_age_s() -> float | None:
    """Seconds since this process started (/proc: its start time after boot against the
    uptime now), so the import phase counts the interpreter's own start too; None
    without /proc."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            # the command name (field 2) may hold spaces: fields are counted after its ")"
            start_ticks = int(handle.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as handle:
            uptime = float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
