"""Start-up as progress: each phase of a run's start-up (import, build data, load target,
compile cache, each drafter's train step, ...) as `startup` events in events.jsonl and a
line in train.log, so `watch` shows where a starting run is instead of a silent minute.

    with phase("load target", devices=["cuda:0"]):
        ...
    with phase("build data") as detail:
        detail["samples"] = 512        # facts known only at the end go into the done event

Any module calls `phase` without being handed the event log: the coordinator names the
run's log once (`record_to`); before that, and in code run outside a trainer (benchmarks,
tests), phases only time their body. A phase and its detail fields are declared in
dflash_contract.events (STARTUP), which every event is checked against.

A phase can be long and still working (a cold compile, a target read from a network
disk): `start_pulse` adds, until the job leaves its start-up (`end_pulse`), an `alive`
event every STARTUP_PULSE_S while the process's own threads used the CPU or moved bytes,
so the agent tells a long start-up from a stuck one (docs/runs.md "Run states").
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator

from dflash_contract.events import STARTUP, StartupState

from .config import STARTUP_PULSE_S
from .runlog import EventLog, say

# Threads whose activity is no start-up work: the pulse itself, and the peer watchdog's
# store traffic (training/distributed.py), which goes on while the main thread is stuck.
_NOT_WORK = ("startup-pulse", "watchdog")
_events: EventLog | None = None
_lock = threading.Lock()
# The phases begun and not ended, oldest first: (name, label, monotonic start). Before the
# first one, the process is importing torch and transformers ("import" has no started event).
_under_way: list[tuple[str, str, float]] = [("import", "import", time.monotonic())]
_between_since = time.monotonic()  # when the last phase under way ended: the work between phases
_pulse_stop = threading.Event()
# Set in a trainer forked by the warm interpreter (warm.py): how long its imports took,
# paid once when it started, not by this run.
warm_import_s: float | None = None


def forked_from_warm(import_s: float) -> None:
    """This process was forked from the warm interpreter just now: its start-up clock
    starts here, and its import phase says it paid none."""
    global _between_since, warm_import_s
    now = time.monotonic()
    _under_way[:] = [("import", "import", now)]
    _between_since = now
    warm_import_s = import_s


def record_to(events: EventLog | None) -> None:
    """Where phases are recorded from now on (None: nowhere)."""
    global _events
    _events = events


def label(name: str, detail: dict[str, Any]) -> str:
    """How a phase reads on screen: "build train step drafter 0 (cold)"."""
    text = name if detail.get("drafter") is None else f"{name} drafter {detail['drafter']}"
    if detail.get("since") == "warm interpreter":
        return f"{text} (warm interpreter)"
    return f"{text} ({detail['cache']})" if detail.get("cache") else text


def record(name: str, duration_s: float, state: str = StartupState.DONE, **detail: Any) -> None:
    """A phase measured by its caller: one `startup` event and one log line."""
    global _between_since
    duration_s = round(max(0.0, duration_s), 3)  # the event's figure, which the log line shows rounded again
    with _lock:
        ended = [entry for entry in _under_way if entry[:2] == (name, label(name, detail))]
        if ended:
            _under_way.remove(ended[-1])
            _between_since = time.monotonic()
    if _events is not None:
        _events.emit(STARTUP, phase=name, state=state, label=label(name, detail), duration_s=duration_s,
                     **detail)
    failed = "failed after " if state == StartupState.FAILED else ""
    say(f"start-up: {label(name, detail)} {failed}{duration_s:.1f} s")


@contextlib.contextmanager
def phase(name: str, **detail: Any) -> Iterator[dict[str, Any]]:
    """Time the body as start-up phase `name`: a `started` event now, a `done` (or
    `failed`, then the exception goes on) event with its duration at the end. The
    yielded dict is the event's detail: the body may add to it."""
    if _events is not None:
        _events.emit(STARTUP, phase=name, state=StartupState.STARTED, label=label(name, detail), **detail)
    began = time.monotonic()
    with _lock:
        _under_way.append((name, label(name, detail), began))
    try:
        yield detail
    except BaseException:
        record(name, time.monotonic() - began, state=StartupState.FAILED, **detail)
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


def start_pulse() -> None:
    """Emit `startup` events with state `alive` ({phase, label, elapsed_s: in that phase,
    cpu_s and io_bytes: the work since the last pulse}) every STARTUP_PULSE_S while
    this process's threads (but the pulse's and the peer watchdog's) used the CPU or
    read or wrote bytes (a network disk, a pipe from the tokenizing workers), until
    `end_pulse`."""
    threading.Thread(target=_pulse, name="startup-pulse", daemon=True).start()


def end_pulse() -> None:
    """The start-up is over (the job's phase leaves "startup"): no more pulses."""
    _pulse_stop.set()


def _pulse() -> None:
    last = _work_by_thread()
    while not _pulse_stop.wait(STARTUP_PULSE_S):
        now = _work_by_thread()
        # Per thread: one that ended takes its counts along, which is no work undone.
        ticks = sum(max(0, t - last.get(tid, (0, 0))[0]) for tid, (t, _) in now.items())
        moved = sum(max(0, b - last.get(tid, (0, 0))[1]) for tid, (_, b) in now.items())
        last = now
        if not (ticks or moved) or _events is None or _pulse_stop.is_set():
            continue
        with _lock:
            name, text, began = _under_way[-1] if _under_way else ("startup", "start-up", _between_since)
        _events.emit(STARTUP, phase=name, state=StartupState.ALIVE, label=text,
                     elapsed_s=round(time.monotonic() - began, 1), cpu_s=round(ticks / os.sysconf("SC_CLK_TCK"), 2),
                     io_bytes=moved)


def _work_by_thread() -> dict[int, tuple[int, int]]:
    """thread id -> (CPU clock ticks, bytes read + written) of this process's threads but
    those of _NOT_WORK, from /proc/self/task (empty without it: no pulse)."""
    idle = {t.native_id for t in threading.enumerate() if t.name in _NOT_WORK}
    work = {}
    try:
        tasks = [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        return work
    for task in tasks:
        if task in idle:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/self/task/{task}/io", "rb") as handle:
                counters = dict(line.split(b": ", 1) for line in handle.read().splitlines() if b": " in line)
            work[task] = (int(fields[11]) + int(fields[12]),  # utime + stime
                          int(counters.get(b"rchar", 0)) + int(counters.get(b"wchar", 0)))
        except (OSError, ValueError, IndexError):
            continue  # the thread ended while we read
    return work
