"""Following a run live: the core of `dflash watch` and of `dflash.watch()`.

One streaming channel to the agent per host (its `follow`): what arrives is kept here
(the log mirrored under logs/<host>/<run>/, one file per segment, since the host's log
may be truncated or replaced under it; the run's events beside it, as events.jsonl and
TensorBoard files, and sent on to the trackers of dflash.yaml, dflash_cli/trackers; the
error records and the root cause's traceback) behind a cursor,
so that a dropped connection resumes with no gap and no duplicated line or event, and
is handed on as typed items, one per message of the stream plus a few of this side's
(docs/api.md "watch"). One watch of a run at a time keeps that local state; another
started meanwhile gets the whole log (or its tail) and saves nothing. The items are
handed on after what they carry is on disk: a reader that stops after any item finds
it accounted for by the next watch.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Union

from dflash_contract import requests
from dflash_contract.follow import (EndMessage, ErrorMessage, EventsMessage, FollowMessage, GpuMessage, LogMessage,
                                    RotatedMessage, StateMessage)
from dflash_contract.records import ErrorRecord, attempt_errors
from dflash_contract.replies import Gpu, ReportReply
from dflash_contract.requests import FINGERPRINT_BYTES, fingerprint
from dflash_contract.states import RunState
from dflash_files.diskspace import NO_SPACE

from . import diagnosis, multihost, run_hosts
from .errors import DflashError, ExitCode, UnreachableError, exit_code_for_state
from .local_state import Cursor, RunLogs, RunRef, local_disk_full, local_writes
from .retry import Reconnects
from .session import Session
from .scalars import history_of
from .tensorboard import RunBoard
from .trackers.config import TrackerSettings
from .trackers.hub import Trackers, tracked_run

CURSOR_SAVE_EVERY_S = 0.5


# -- what a watch hands on ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Following:
    """The follow of `host`'s part has begun. `keeps_local_state`: this watch keeps the
    run's mirror and cursor in `local_dir` (False: another watch of the run does; this one
    gets the log from its start, or its tail, and saves nothing). `resumed_at`: the byte
    of the log a resumed watch goes on from (None: from the start, or the tail asked for).
    `recent_events`: the last events an earlier watch received (where the run was)."""
    host: str
    run_id: str
    local_dir: Path
    keeps_local_state: bool
    resumed_at: int | None
    recent_events: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Log:
    """train.log's text from byte `offset`: whole lines (the last may lack its newline
    when the run ended or the log was cut mid-line). `message.data` encodes back to the
    exact bytes with surrogateescape; `lines` keeps each line's newline."""
    host: str
    message: LogMessage

    @property
    def text(self) -> str:
        return self.message.data

    @property
    def offset(self) -> int:
        return self.message.offset

    @property
    def lines(self) -> list[str]:
        return self.message.data.splitlines(keepends=True)


@dataclasses.dataclass(frozen=True)
class Rotated:
    """The host's train.log was truncated or replaced; what follows is its new content,
    mirrored to `saved_as` (None: this watch keeps no local state)."""
    host: str
    message: RotatedMessage
    saved_as: Path | None


@dataclasses.dataclass(frozen=True)
class Events:
    """The run's events of one stretch of its events.jsonl (every type but heartbeat), as
    the trainer wrote them: dicts of remote/dflash_contract/events' types (docs/events.md)."""
    host: str
    message: EventsMessage

    @property
    def events(self) -> tuple[dict[str, Any], ...]:
        return self.message.events


@dataclasses.dataclass(frozen=True)
class ErrorRecorded:
    """A thread of the run recorded an error: its errors.jsonl `record` (docs/errors.md;
    a line that is not JSON comes as a record of exc_type "unreadable errors.jsonl line"
    holding it), the diagnosis line of a failure dflash knows (else None), and where the
    root cause's traceback was saved (None: not this record, or no local state)."""
    host: str
    message: ErrorMessage
    record: ErrorRecord
    diagnosis: str | None
    traceback_saved: Path | None


@dataclasses.dataclass(frozen=True)
class Gpus:
    """An nvidia-smi sample of the host (none without nvidia-smi)."""
    host: str
    message: GpuMessage

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return self.message.gpus


@dataclasses.dataclass(frozen=True)
class StateChange:
    """The part's state: the first item of a follow, then one on every change."""
    host: str
    message: StateMessage

    @property
    def state(self) -> RunState:
        return self.message.state


@dataclasses.dataclass(frozen=True)
class HostEnded:
    """`host`'s part ended and everything it wrote was received. `unexplained`: for a
    part that failed with no error record of its latest attempt, the agent's report of
    what is known (exit.json, the last stack dump, the last log lines); else None."""
    host: str
    run_id: str
    message: EndMessage
    unexplained: ReportReply | None

    @property
    def state(self) -> RunState:
        return self.message.state


@dataclasses.dataclass(frozen=True)
class Unfollowed:
    """A run on several hosts: `host`'s part is not followed (any more): it left the
    inventory, or it could not be followed (`error`); its state is unknown."""
    host: str
    error: DflashError
    left_inventory: bool


@dataclasses.dataclass(frozen=True)
class Ended:
    """The last item: the run ended (on every host). `state` is the whole run's (None:
    unknown, a host could not be followed), `states` each host's, `exit_code` what
    `dflash watch` exits with. `root_cause`: (host, record) of the latest attempt's root
    cause (docs/errors.md), `blamed` the host of a rank that failed without a record of
    its own, `exits` each host's exit.json, `diagnosis` the line of a failure dflash knows,
    `records` each host's error records of the latest attempt."""
    run_id: str
    hosts: tuple[str, ...]
    state: RunState | None
    states: dict[str, RunState | None]
    exit_code: ExitCode
    root_cause: tuple[str, ErrorRecord] | None
    blamed: str | None
    exits: dict[str, dict[str, Any] | None]
    diagnosis: str | None
    records: dict[str, tuple[ErrorRecord, ...]] = dataclasses.field(default_factory=dict)


WatchItem = Union[Following, Log, Rotated, Events, ErrorRecorded, Gpus, StateChange, HostEnded, Unfollowed, Ended]
#: the items carrying a message of the agent's follow stream, one each (`watch --json` prints them)
FROM_STREAM = (Log, Rotated, Events, ErrorRecorded, Gpus, StateChange, HostEnded)


# -- one host's part ------------------------------------------------------------------------

class Watcher:
    """Follows one host's part of a run; `hosts`: all the run's hosts when it has several
    (its records are then diagnosed as a rank of the run). `trackers`: those to feed."""

    def __init__(self, session: Session, ref: RunRef, interval: float, hosts: tuple[str, ...] = (),
                 trackers: TrackerSettings = TrackerSettings()):
        self.ref = ref
        self.hosts = hosts
        self.agent = session.agent(ref.host)
        self.logs = RunLogs(session.logs_dir, ref)
        self.interval = interval
        with local_writes(self.logs.dir):
            self.claim = self.logs.claim()  # None: another watch keeps this run's local state
        self.cursor = self.logs.load_cursor() if self.claim else Cursor()
        self.records = self.logs.load_errors()[: self.cursor.errors_seen] if self.claim else []
        self.mirror = None
        self.events_mirror = None
        # The history the events mirrored here left: what the TensorBoard files hold.
        self.board = RunBoard(self.logs.dir, history_of(self.logs.mirrored_events(self.cursor))) if self.claim else None
        # Rank 0's part holds the run's step and eval events; the trackers go with the
        # local state, which records what they were sent.
        self.trackers = None
        if self.claim and trackers.named and (not hosts or hosts[0] == ref.host):
            self.trackers = Trackers(trackers, self.logs, f"{ref.host}| " if len(hosts) > 1 else "")
        self.recent = b""  # the last bytes received before cursor.offset (its fingerprint)
        self.last_saved = 0.0
        self.end: EndMessage | None = None
        self.messages = 0  # received so far; tells a reconnect that made progress
        self.disk_full: Path | None = None  # what `close` could not write for want of space here

    # -- one connection's worth of messages ---------------------------------------
    def follow_once(self, tail_lines: int | None) -> Iterator[WatchItem]:
        cursor = self.cursor
        request = requests.Follow(self.ref.run_id, errors_seen=cursor.errors_seen, gpu_interval=self.interval,
                                  offset=cursor.offset, segment=cursor.segment, events_offset=cursor.events_offset,
                                  inode=cursor.inode, fingerprint=cursor.fingerprint, tail_lines=tail_lines)
        if self.trackers is not None and not self.trackers.started:
            self.start_trackers()
        for message in self.agent.follow(request):
            self.messages += 1
            item = self.take(message)
            if self.end is not None:
                return
            if item is not None:
                yield item
        raise UnreachableError(f"host {self.ref.host}: follow stream ended before the run did")

    def take(self, message: FollowMessage) -> WatchItem | None:
        """Keep what `message` carries; the item it makes (None: nothing new)."""
        host = self.ref.host
        if isinstance(message, LogMessage):
            self.on_log(message)
            return Log(host, message)
        if isinstance(message, RotatedMessage):
            return Rotated(host, message, self.on_rotated(message))
        if isinstance(message, ErrorMessage):
            return self.on_error(message)
        if isinstance(message, EventsMessage):
            return Events(host, message) if self.on_events(message) else None
        if isinstance(message, GpuMessage):
            return Gpus(host, message)
        if isinstance(message, StateMessage):
            return StateChange(host, message)
        if isinstance(message, EndMessage):
            self.end = message
        return None

    def start_trackers(self) -> None:
        """Open the trackers in the run's tracker runs, with its config and provenance
        (one round trip; a dropped connection here is one like any other)."""
        status = self.agent.run_status(self.ref.run_id, config=True)
        self.trackers.start(tracked_run(status, self.ref, self.hosts), self.cursor.events_mirrored)

    def on_log(self, message: LogMessage) -> None:
        data = message.data.encode("utf-8", "surrogateescape")
        start = message.offset
        end = start + len(data)
        # Only a stream's and a segment's first message names the file.
        inode = self.cursor.inode if message.inode is None else message.inode
        if inode != self.cursor.inode or start > self.cursor.offset:
            # A new log file, or --tail skipped ahead: this segment's mirror starts over there.
            self.cursor = dataclasses.replace(self.cursor, inode=inode, offset=start, mirror_start=start,
                                              fingerprint=None)
            self.recent = b""
            self._close_mirror()
            if self.claim:
                self.logs.segment_log(self.cursor.segment).unlink(missing_ok=True)
        fresh = data[max(0, self.cursor.offset - start):]  # --tail may resend mirrored bytes
        if fresh:
            if self.claim:
                if self.mirror is None:
                    self.mirror = self.logs.open_mirror(self.cursor)
                self.mirror.write(fresh)
                self.mirror.flush()
            self.recent = (self.recent + fresh[-FINGERPRINT_BYTES:])[-FINGERPRINT_BYTES:]
            self.cursor = dataclasses.replace(self.cursor, offset=end, fingerprint=fingerprint(self.recent))
        self.save_cursor(force=False)

    def on_rotated(self, message: RotatedMessage) -> Path | None:
        """The host's log was cut or replaced: what the stream sends next is new content,
        and goes to a new mirror file (returned; None without local state)."""
        self._close_mirror()
        start = message.offset
        self.cursor = dataclasses.replace(self.cursor, segment=message.segment, inode=message.inode,
                                          offset=start, mirror_start=start, fingerprint=None)
        self.recent = b""
        self.save_cursor(force=True)
        return self.logs.segment_log(self.cursor.segment) if self.claim else None

    def on_error(self, message: ErrorMessage) -> ErrorRecorded | None:
        index, record = message.index, message.record
        if index < len(self.records):
            return None
        if record is None:  # a line of errors.jsonl that is no record: shown as it is
            record = ErrorRecord(thread="?", phase="?", exc_type="unreadable errors.jsonl line",
                                 traceback=message.raw or "")
        self.records.append(record)
        saved = None
        if self.claim:
            self.logs.save_errors(self.records)
            if multihost.root_cause([(self.ref.host, r) for r in self.records])[1] is record:
                saved = self.logs.save_traceback(record.traceback or "")
        self.cursor = dataclasses.replace(self.cursor, errors_seen=len(self.records))
        self.save_cursor(force=True)
        diagnosed = None if message.record is None else diagnosis.diagnose(
            diagnosis.Failure(message.record, self.ref.run_id, self.ref.host, self.hosts))
        return ErrorRecorded(self.ref.host, message, record, diagnosed, saved)

    def on_events(self, message: EventsMessage) -> bool:
        """The run's events (all but heartbeats) from the cursor's events offset on, to
        events.jsonl, the TensorBoard files and the trackers (for the watch that keeps the
        local state), each once; False for a stretch received before."""
        if message.next <= self.cursor.events_offset:
            return False  # a stream never resends, but a cursor is cheap to trust
        events = list(message.events)
        mirrored = self.cursor.events_mirrored
        if self.claim:
            if self.events_mirror is None:
                self.events_mirror = self.logs.open_events_mirror(self.cursor)
            lines = [(json.dumps(event) + "\n").encode() for event in events]
            self.events_mirror.write(b"".join(lines))
            self.events_mirror.flush()
            self.board.add(events)
            if self.trackers is not None:  # each event with the byte of events.jsonl its line ends at
                ends = [mirrored + length for length in itertools.accumulate(map(len, lines))]
                self.trackers.add(zip(ends, events))
            mirrored += sum(map(len, lines))
        self.cursor = dataclasses.replace(self.cursor, events_offset=message.next, events_mirrored=mirrored)
        self.save_cursor(force=False)
        return True

    def save_cursor(self, force: bool) -> None:
        now = time.monotonic()
        if not self.claim:
            return  # another watch keeps the local state; this one's cursor lives in memory
        if force or now - self.last_saved >= CURSOR_SAVE_EVERY_S:
            # What the cursor accounts for is on disk first: a kill in between makes the
            # next watch cut the mirrors back and receive it again, never skip it.
            for mirror in (self.mirror, self.events_mirror):
                if mirror is not None:
                    mirror.flush()
            self.board.flush()
            self.logs.save_cursor(self.cursor)
            self.last_saved = now

    def _close_mirror(self) -> None:
        if self.mirror is not None:
            mirror, self.mirror = self.mirror, None
            mirror.close()

    def close(self) -> None:
        """Save the cursor and let go of the local state. A full local disk stops no step
        of it: what could not be written is left to the next watch (the cursor on disk
        accounts only for what is), and the file is kept in `disk_full`."""
        for step in (lambda: self.save_cursor(force=True), self._close_mirror, self._close_events_mirror,
                     self._close_trackers, self._let_go):
            try:
                step()
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                self.disk_full = self.disk_full or Path(exc.filename or self.logs.dir)

    def _close_events_mirror(self) -> None:
        if self.events_mirror is not None:
            mirror, self.events_mirror = self.events_mirror, None
            mirror.close()

    def _close_trackers(self) -> None:
        if self.trackers is not None and self.trackers.started:
            # before the claim goes: the next watch goes on from what they record
            self.trackers.close(self.end.state if self.end else None)

    def _let_go(self) -> None:
        if self.claim:
            try:
                self.board.close()
            finally:
                self.claim.close()

    # -- the outcome -----------------------------------------------------------------
    @property
    def latest_records(self) -> list[dict]:
        """The error records of the attempt that ended (earlier attempts' are history)."""
        return attempt_errors(self.records, self.end.attempt if self.end else 0)

    def ended(self) -> HostEnded:
        assert self.end is not None  # the stream ended with it
        unexplained = None
        if exit_code_for_state(self.end.state) == ExitCode.RUN_FAILED and not self.latest_records:
            unexplained = self.agent.call(requests.Report(self.ref.run_id))
        return HostEnded(self.ref.host, self.ref.run_id, self.end, unexplained)

    def follow_to_end(self, tail: int | None, retry_for: float) -> Iterator[WatchItem]:
        """Follow until the part ends, reconnecting after dropped connections. A full
        local disk ends it (`local_disk_full`): the run goes on."""
        with local_writes(self.logs.dir):
            yield from self._follow_to_end(tail, retry_for)

    def _follow_to_end(self, tail: int | None, retry_for: float) -> Iterator[WatchItem]:
        resumed_at = self.cursor.offset if self.claim and tail is None and self.cursor.offset else None
        yield Following(self.ref.host, self.ref.run_id, self.logs.dir, self.claim is not None, resumed_at,
                        tuple(self.logs.recent_events(self.cursor)) if self.claim else ())
        tail_lines = tail
        reconnects = Reconnects(retry_for)
        while True:
            seen = self.messages
            try:
                yield from self.follow_once(tail_lines)
                yield self.ended()
                return
            except UnreachableError as exc:
                self.save_cursor(force=True)
                tail_lines = None  # from now on resume exactly at the cursor
                if self.messages > seen:  # the last connection worked for a while
                    reconnects.progressed()
                reconnects.wait(exc, "the run may still be going: dflash watch resumes it")


# -- the run --------------------------------------------------------------------------------

def follow(session: Session, ref: RunRef, *, tail: int | None, interval: float, retry_for: float,
           trackers: TrackerSettings = TrackerSettings()) -> Iterator[WatchItem]:
    """The run's items until it ends on every host, then one `Ended`. A host that stays
    unreachable raises UnreachableError (a run on one host) or is an `Unfollowed` item (on
    several). Closing the iterator detaches: the run keeps going, and the next watch
    resumes after the last item handed on. `trackers` (trackers.hub.checked_settings) are
    fed rank 0's scalars by the watch that keeps the local state."""
    if ref.multihost:
        yield from _follow_hosts(session, ref, tail, interval, retry_for, trackers)
        return
    watcher = Watcher(session, ref, interval, trackers=trackers)
    try:
        yield from watcher.follow_to_end(tail, retry_for)
    finally:
        watcher.close()
    if watcher.disk_full is not None:
        raise local_disk_full(watcher.disk_full)
    state = watcher.end.state
    records = watcher.latest_records
    code = exit_code_for_state(state)
    cause = multihost.root_cause([(ref.host, r) for r in records])
    line = None
    if code == ExitCode.RUN_FAILED and cause is not None:
        line = diagnosis.diagnose(diagnosis.Failure(cause[1], ref.run_id, ref.host))
    yield Ended(ref.run_id, (ref.host,), state, {ref.host: state}, code, cause, None,
                {ref.host: watcher.end.exit}, line, {ref.host: tuple(records)})


_DONE = object()  # a host's thread has handed on its last item


def _follow_hosts(session: Session, ref: RunRef, tail: int | None, interval: float, retry_for: float,
                  trackers: TrackerSettings) -> Iterator[WatchItem]:
    """Every host's part followed at once, one thread each, their items handed on one at
    a time (a traceback is never cut by another host's lines). A host that left the
    inventory is named and not followed; its part's state is unknown."""
    hosts, left = run_hosts.members(session, ref)
    outcomes: dict[str, DflashError] = dict(left)
    for name, exc in left.items():
        yield Unfollowed(name, exc, left_inventory=True)
    watchers = [Watcher(session, RunRef(host.name, ref.run_id), interval, ref.hosts, trackers) for host in hosts]
    items: queue.Queue = queue.Queue()
    detached = threading.Event()

    def follow_part(watcher: Watcher) -> None:
        try:
            for item in watcher.follow_to_end(tail, retry_for):
                items.put(item)
                if detached.is_set():
                    return
        except DflashError as exc:
            if not detached.is_set():
                outcomes[watcher.ref.host] = exc
                items.put(Unfollowed(watcher.ref.host, exc, left_inventory=False))
        finally:
            watcher.close()
            items.put(_DONE)

    # Daemons: a reader that stops leaves while they wait on their hosts (the cursors are
    # saved as they go, so the next watch resumes).
    threads = [threading.Thread(target=follow_part, args=(w,), name=f"watch-{w.ref.host}", daemon=True)
               for w in watchers]
    for thread in threads:
        thread.start()
    running = len(threads)
    try:
        while running:
            try:
                item = items.get(timeout=0.2)  # a timeout: Ctrl-C reaches a waiting main thread
            except queue.Empty:
                continue
            if item is _DONE:
                running -= 1
            else:
                yield item
    finally:
        detached.set()
    # this machine's disk is every part's: a full one is the watch's outcome, whatever the run's
    full = [exc for exc in outcomes.values() if exc.exit_code == ExitCode.LOCAL_DISK_FULL]
    if full:
        raise full[0]
    for watcher in watchers:
        if watcher.disk_full is not None:
            raise local_disk_full(watcher.disk_full)
    yield _ended(ref, watchers, outcomes)


def _ended(ref: RunRef, watchers: list[Watcher], outcomes: dict[str, DflashError]) -> Ended:
    ends = {w.ref.host: w.end for w in watchers if w.end}
    states = {host: ends[host].state if host in ends else None for host in ref.hosts}
    state = multihost.aggregate_state(states)
    cause = multihost.root_cause(multihost.in_time_order({w.ref.host: w.latest_records for w in watchers}))
    blamed = multihost.blamed_host(cause, ref.hosts) if cause is not None else None
    line = None
    if cause is not None and state == RunState.FAILED:
        line = diagnosis.diagnose(diagnosis.Failure(cause[1], ref.run_id, cause[0], ref.hosts))
    if state is None:
        code = max((exc.exit_code for exc in outcomes.values()), default=ExitCode.UNREACHABLE)
    else:
        code = exit_code_for_state(state)
    return Ended(ref.run_id, ref.hosts, state, states, code, cause, blamed,
                 {host: end.exit for host, end in ends.items()}, line,
                 {w.ref.host: tuple(w.latest_records) for w in watchers})
