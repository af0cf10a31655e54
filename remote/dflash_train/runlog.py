"""What the trainer writes for others to read: train.log lines, events.jsonl, errors.jsonl,
threads.json and the headers of its own stack dumps in faulthandler.log.

train.log: every line is `2026-11-29T16:00:00.123 [thread-name] text` (UTC, ms). sys.stdout
and sys.stderr are replaced by line-assembling writers: each thread's partial output is
held until its newline, and whole lines go out in one os.write under one lock, so lines
of different threads never mix inside a line, and library prints and warnings get the
prefix too.

events.jsonl follows dflash_contract.events (docs/events.md), errors.jsonl docs/errors.md; an
error record is flushed and fsynced by the failing thread before anything is torn down.
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

from dflash_contract.names import ATTEMPT_ENV, RELEASE_ID_ENV, RUN_ID_ENV
from dflash_contract.events import DONE, EventType
from dflash_contract.records import ErrorFrame, ErrorRecord
from dflash_files.diskspace import NO_SPACE, DiskFull, Reserve

from .memory import ledger

_WRITE_LOCK = threading.Lock()  # one lock for stdout and stderr: both usually land in train.log
# A record's longest text fields, in characters: a record always fits its reserve
# (diskspace.RESERVE_BYTES), at up to 4 bytes a character.
MAX_TRACEBACK_CHARS = 32 * 1024
MAX_MESSAGE_CHARS = 8 * 1024
MAX_FRAMES = 64


def utc_stamp() -> str:
    moment = datetime.datetime.now(datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def prefix_lines(text: str, thread_name: str) -> str:
    """Prefix every line of `text` (which ends with a newline) with time and thread name."""
    stamp = utc_stamp()
    return "".join(f"{stamp} [{thread_name}] {line}\n" for line in text[:-1].split("\n"))


class _LostLines:
    """train.log lines dropped for want of space, shared by both writers (one file,
    guarded by _WRITE_LOCK): how many since the last line that fit, and whether a
    failed write cut the file's last line."""

    def __init__(self) -> None:
        self.lines = 0
        self.torn = False


_LOST = _LostLines()


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
        with _WRITE_LOCK:
            if _LOST.lines:
                cut = "\n" if _LOST.torn else ""  # ends the line a failed write cut
                note = prefix_lines(f"({_LOST.lines} log line(s) lost here: no space left on device)\n",
                                    threading.current_thread().name)
                if not self._write_whole((cut + note).encode("utf-8")):
                    _LOST.lines += text.count("\n")
                    return
                _LOST.lines = 0
            if not self._write_whole(text.encode("utf-8", "replace")):
                _LOST.lines += text.count("\n")

    def _write_whole(self, data: bytes) -> bool:
        """Write all of `data` (under _WRITE_LOCK); False when the disk is full, with
        _LOST.torn saying whether the file now ends inside a line."""
        written = 0
        while written < len(data):
            try:
                written += os.write(self._fd, data[written:])
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                _LOST.torn = _LOST.torn or written > 0
                return False
        _LOST.torn = False
        return True


def install_line_writers() -> tuple[LineWriter, LineWriter]:
    """Replace sys.stdout/sys.stderr, and the stream of every logging handler already
    writing to them: a trainer forked from the warm interpreter finds torch's and
    transformers' loggers made by its imports, holding the streams it had then; their
    lines are prefixed as an exec'd trainer's are."""
    import logging
    import sys

    old_out, old_err = sys.stdout, sys.stderr
    for stream in (old_out, old_err):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    out, err = LineWriter(1), LineWriter(2)
    sys.stdout, sys.stderr = out, err
    loggers = [logging.getLogger()] + [logger for logger in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(logger, logging.Logger)]
    for handler in [h for logger in loggers for h in logger.handlers]:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if handler.stream is old_out or handler.stream is sys.__stdout__:
                handler.setStream(out)
            elif handler.stream is old_err or handler.stream is sys.__stderr__:
                handler.setStream(err)
    return out, err


def say(text: str) -> None:
    """One log line (or several) from the calling thread, to train.log via stdout."""
    import sys

    sys.stdout.write(text.rstrip("\n") + "\n")


class JsonLines:
    """Append-only JSON-lines file; every record is one whole line, written at once. A
    write the disk has no room for is undone (the file cut back to where the line
    began, so no torn line is glued to the next) and raised as DiskFull."""

    def __init__(self, path: Path, fsync: bool):
        self.path = path
        self._fsync = fsync
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        with self._lock:
            start = os.fstat(self._fd).st_size  # the one writer of this file: its lock held
            try:
                written = 0
                while written < len(data):
                    written += os.write(self._fd, data[written:])
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                os.ftruncate(self._fd, start)  # frees blocks, needs none
                if exc.errno in NO_SPACE:
                    raise DiskFull(str(self.path)) from exc
                raise


class EventLog(JsonLines):
    """events.jsonl: every event is checked against its type in dflash_contract.events before it is
    written (an EventError names the type and the field); the check costs about what the
    JSON encoding does, so it is always on."""

    def __init__(self, path: Path):
        super().__init__(path, fsync=False)
        self._order = threading.Lock()  # the `done` check and the write, as one
        self._done = False

    def emit(self, kind: EventType, **fields: Any) -> None:
        """Write one event; after `done`, the process's last, none is written (a thread that
        outlived the stop, the start-up pulse waking as the run ends): said in the log."""
        record = kind.record(time.time(), fields, thread=threading.current_thread().name)
        with self._order:
            if self._done:
                say(f"{kind.name} event not written: it came after the done event")
                return
            self.append(record)
            self._done = kind is DONE


def emit_done(events: EventLog, code: int, alive: list[str]) -> None:
    """The trainer's last event, `done`: how it ended. A disk with no room for it does not
    keep the process from exiting with `code` (exit.json says it too)."""
    try:
        events.emit(DONE, exit_code=code, threads_alive=alive)
    except DiskFull as exc:
        say(f"no done event: {exc}")


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
    return int(os.environ.get(ATTEMPT_ENV) or 0)


def _innermost_detail(exc: BaseException) -> dict[str, Any] | None:
    """The `detail` dict of the innermost exception of the chain that has one: the root
    cause's (a non-finite step's values), or a DiskFull's raised from an OSError."""
    found, seen = None, set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(getattr(current, "detail", None), dict):
            found = current.detail
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return found


def _bounded(text: str, limit: int) -> str:
    """`text`, its middle left out when it is longer than `limit` characters."""
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters left out ...]\n{text[-keep:]}"


def error_record(exc: BaseException, *, thread: str, thread_ident: int | None,
                 phase: str, step: int | None) -> ErrorRecord:
    """docs/errors.md's errors.jsonl record for `exc`, its message and traceback bounded;
    `detail` when an exception of its chain carries one (a dict of facts beyond the
    message: a non-finite step's values, a full disk's path and free bytes); `memory`
    for a CUDA out-of-memory error (who held what, memory/ledger.py)."""
    cause = root_cause(exc)
    frames = tuple(ErrorFrame(file=f.filename, line=f.lineno, func=f.name, code=f.line or "")
                   for f in traceback.extract_tb(cause.__traceback__))[-MAX_FRAMES:]
    return ErrorRecord(
        ts=time.time(),
        run_id=os.environ.get(RUN_ID_ENV),
        thread=thread,
        thread_ident=thread_ident,
        phase=phase,
        step=step,
        exc_type=type(exc).__name__,
        message=_bounded(str(exc), MAX_MESSAGE_CHARS),
        traceback=_bounded("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                           MAX_TRACEBACK_CHARS),
        frames=frames,
        release_id=os.environ.get(RELEASE_ID_ENV),
        attempt=attempt_number(),
        detail=_innermost_detail(exc),
        memory=ledger.after_oom(exc),
    )


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
            try:
                tmp.write_text(json.dumps(self._names, ensure_ascii=False), encoding="utf-8")
                os.replace(tmp, self._path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                if exc.errno in NO_SPACE:
                    raise DiskFull(str(self._path)) from exc
                raise


def dump_header(reason: str) -> str:
    """The line that starts a stack dump in faulthandler.log (docs/layout.md)."""
    return f"=== stacks of every thread: {reason} at {utc_stamp()}Z ===\n"


class ErrorLog:
    """errors.jsonl, with its reserve (`errors.jsonl.reserve` beside it) made at start:
    a record the disk has no room for is written again once the reserve is given back,
    so the first failure of a run on a full disk is recorded all the same."""

    def __init__(self, path: Path):
        self._lines = JsonLines(path, fsync=True)
        self.reserve = Reserve(f"{path}.reserve")
        self.reserve.make()

    def append(self, record: ErrorRecord) -> None:
        try:
            self._lines.append(record.to_json())
        except DiskFull:
            if not self.reserve.release():
                raise
            self._lines.append(record.to_json())
