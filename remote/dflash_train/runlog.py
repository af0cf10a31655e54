"""What the trainer writes for others to read: train.log lines, events.jsonl, errors.jsonl,
threads.json and the headers of its own stack dumps in faulthandler.log.

train.log: every line is `2026-11-29T16:00:00.123 [thread-name] text` (UTC, ms). sys.stdout
and sys.stderr are replaced by line-assembling writers: each thread's partial output is
held until its newline, and whole lines go out in one os.write under one lock, so lines
of different threads never mix inside a line, and library prints and warnings get the
prefix too.

events.jsonl and errors.jsonl follow DESIGN.md; an error record is flushed and fsynced
by the failing thread before anything is torn down.
"""
from __future__ import annotations

import datetime
import io
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from . import memory_ledger

_WRITE_LOCK = threading.Lock()  # one lock for stdout and stderr: both usually land in train.log


def utc_stamp() -> str:
    moment = datetime.datetime.now(datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def prefix_lines(text: str, thread_name: str) -> str:
    """Prefix every line of `text` (which ends with a newline) with time and thread name."""
    stamp = utc_stamp()
    return "".join(f"{stamp} [{thread_name}] {line}\n" for line in text[:-1].split("\n"))


class LineWriter(io.TextIOBase):
    """A text stream that writes whole, prefixed lines to a file descriptor."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._partial = threading.local()  # each thread assembles its own line
        self._orphans: dict[int, tuple[str, str]] = {}  # partial text of threads, for flush_all
        self._orphan_lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> int:
        if not text:
            return 0
        pending = getattr(self._partial, "text", "") + text
        cut = pending.rfind("\n") + 1
        self._partial.text = pending[cut:]
        name = threading.current_thread().name
        with self._orphan_lock:
            if self._partial.text:
                self._orphans[threading.get_ident()] = (name, self._partial.text)
            else:
                self._orphans.pop(threading.get_ident(), None)
        if cut:
            self._emit(prefix_lines(pending[:cut], name))
        return len(text)

    def flush(self) -> None:
        """Partial lines stay held: writing them now would split a line in two."""

    def flush_all(self) -> None:
        """At exit: write out every thread's unfinished line."""
        with self._orphan_lock:
            orphans, self._orphans = list(self._orphans.values()), {}
        for name, text in orphans:
            self._emit(prefix_lines(text + "\n", name))

    def _emit(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        with _WRITE_LOCK:
            while data:
                data = data[os.write(self._fd, data):]


def install_line_writers() -> tuple[LineWriter, LineWriter]:
    """Replace sys.stdout/sys.stderr; call before importing torch or transformers so
    their loggers pick up the prefixed stream."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    out, err = LineWriter(1), LineWriter(2)
    sys.stdout, sys.stderr = out, err
    return out, err


def say(text: str) -> None:
    """One log line (or several) from the calling thread, to train.log via stdout."""
    import sys

    sys.stdout.write(text.rstrip("\n") + "\n")


class JsonLines:
    """Append-only JSON-lines file; every record is one whole line, flushed."""

    def __init__(self, path: Path, fsync: bool):
        self._fsync = fsync
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())


class EventLog(JsonLines):
    def __init__(self, path: Path):
        super().__init__(path, fsync=False)

    def emit(self, type_: str, **fields: Any) -> None:
        self.append({"ts": time.time(), "type": type_,
                     "thread": threading.current_thread().name, **fields})


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (explicit cause first, then implicit context)."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def attempt_number() -> int:
    """Which attempt of its run this process is (DFLASH_ATTEMPT, set by the agent's
    supervisor; 0, the launch, when run by hand)."""
    return int(os.environ.get("DFLASH_ATTEMPT") or 0)


def error_record(exc: BaseException, *, thread: str, thread_ident: int | None,
                 phase: str, step: int | None) -> dict[str, Any]:
    """DESIGN.md's errors.jsonl record for `exc`; `detail` when the root cause carries one
    (a dict of facts beyond the message, e.g. the values of a non-finite step); `memory`
    for a CUDA out-of-memory error (who held what, memory_ledger)."""
    cause = root_cause(exc)
    frames = [{"file": f.filename, "line": f.lineno, "func": f.name, "code": f.line or ""}
              for f in traceback.extract_tb(cause.__traceback__)]
    detail = getattr(cause, "detail", None)
    record = {
        "ts": time.time(),
        "run_id": os.environ.get("DFLASH_RUN_ID"),
        "thread": thread,
        "thread_ident": thread_ident,
        "phase": phase,
        "step": step,
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "frames": frames,
        "release_id": os.environ.get("DFLASH_RELEASE_ID"),
        "attempt": attempt_number(),
    }
    if isinstance(detail, dict):
        record["detail"] = detail
    memory = memory_ledger.after_oom(exc)
    if memory is not None:
        record["memory"] = memory
    return record


class ThreadNames:
    """threads.json: {ident: name} of every thread the trainer started, rewritten whole
    (temp file + os.replace) as each one starts. faulthandler names threads only by
    ident, since it writes without the GIL (which is what lets it dump a run whose hung
    thread holds the GIL); the agent labels its dumps with these names."""

    def __init__(self, path: Path):
        self._path = path
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}

    def add(self, thread: threading.Thread) -> None:
        with self._lock:
            self._names[str(thread.ident)] = thread.name
            tmp = self._path.with_name(f".{self._path.name}.tmp")  # one writer at a time: the lock
            tmp.write_text(json.dumps(self._names, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, self._path)


def dump_header(reason: str) -> str:
    """The line that starts a stack dump in faulthandler.log (DESIGN.md "Remote layout")."""
    return f"=== stacks of every thread: {reason} at {utc_stamp()}Z ===\n"


class ErrorLog(JsonLines):
    def __init__(self, path: Path):
        super().__init__(path, fsync=True)
