"""dflash watch: follow a run live through one streaming channel to the agent.

The host does the following (the agent's `follow`); this side prints what arrives
(control characters escaped, unless --json), mirrors the log under logs/<host>/<run>/
(one file per segment: the host's log may be truncated or replaced under it) and the
run's events beside it (events.jsonl, and TensorBoard files made from them; the
trackers of dflash.yaml get the same scalars, dflash_cli/trackers), and keeps
a cursor so that a dropped connection resumes with no gap and no duplicated line or
event. One watch of a run at a time keeps that local state; another started meanwhile
shows the whole log (or --tail) and saves nothing. On a terminal a status line (step,
loss, acceptance length, ETA, GPUs) stays below the scrolling log.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import threading
import time

from rich.live import Live
from rich.text import Text

from dflash_agent.jsonio import FINGERPRINT_BYTES, fingerprint
from dflash_agent.protocol import (EndMessage, ErrorMessage, EventsMessage, FollowMessage, Gpu, GpuMessage,
                                   LogMessage, ReportReply, RotatedMessage, RunState, StateMessage)
from dflash_agent.state import attempt_errors

from .. import console, diagnosis, multihost, run_hosts
from ..errors import DflashError, ExitCode, UnreachableError, exit_code_for_state
from ..local_state import Cursor, RunLogs, RunRef
from ..retry import Reconnects
from ..session import Session
from ..status_line import RunProgress
from ..tensorboard import RunBoard
from ..trackers.hub import Trackers, require_packages, tracked_run
from ..trackers.config import TrackerSettings
from ..tracebacks import render_no_record, render_record, say_diagnosis

CURSOR_SAVE_EVERY_S = 0.5


def gpu_line(gpus: tuple[Gpu, ...]) -> str:
    """One compact line: index, memory used/total, utilisation, temperature, power."""
    def num(value, fmt):
        return "?" if value is None else format(value, fmt)
    parts = []
    for g in gpus:
        used, total = g.memory_used_mib, g.memory_total_mib
        memory = f"{num(used and used / 1024, '.1f')}/{num(total and total / 1024, '.0f')}GiB"
        parts.append(f"gpu{g.index} {memory} {num(g.utilization_pct, '.0f')}% "
                     f"{num(g.temperature_c, '.0f')}C {num(g.power_w, '.0f')}W")
    return "  ".join(parts)


class Watcher:
    """Follows one host's part of a run. `hosts`: all the run's hosts when it has
    several; then every line it prints starts with this host's name, and its messages
    are printed under one lock, whole, between those of the other hosts' watchers."""

    def __init__(self, session: Session, ref: RunRef, interval: float, as_json: bool,
                 hosts: tuple[str, ...] = (), trackers: TrackerSettings = TrackerSettings()):
        self.ref = ref
        self.hosts = hosts
        self.label = f"{ref.host}| " if len(hosts) > 1 else ""
        self.agent = session.agent(ref.host)
        self.logs = RunLogs(session.logs_dir, ref)
        self.interval = interval
        self.as_json = as_json
        self.claim = self.logs.claim()  # None: another watch keeps this run's local state
        self.cursor = self.logs.load_cursor() if self.claim else Cursor()
        self.records = self.logs.load_errors()[: self.cursor.errors_seen] if self.claim else []
        self.mirror = None
        self.events_mirror = None
        self.board = RunBoard(self.logs.dir) if self.claim else None
        # Rank 0's part holds the run's step and eval events; the trackers go with the
        # local state, which records what they were sent.
        rank_0 = not hosts or hosts[0] == ref.host
        self.trackers = Trackers(trackers, self.logs, self.label) if self.claim and rank_0 and trackers.named \
            else None
        self.progress = RunProgress(gpu_line)
        if self.claim:  # a resumed watch shows where the run was, not "no step yet"
            self.progress.update(self.logs.recent_events(self.cursor))
        self.live: Live | None = None  # the status line, on a terminal
        self.recent = b""  # the last bytes received before cursor.offset (its fingerprint)
        self.line_open = False  # the log text printed last did not end its line
        self.last_saved = 0.0
        self.end: EndMessage | None = None
        self.messages = 0  # handled so far; tells a reconnect that made progress

    # -- one connection's worth of messages ---------------------------------------
    def follow_once(self, tail_lines: int | None) -> None:
        cursor = self.cursor
        args = ["--run-id", self.ref.run_id, "--errors-seen", str(cursor.errors_seen),
                "--gpu-interval", str(self.interval), "--offset", str(cursor.offset),
                "--segment", str(cursor.segment), "--events-offset", str(cursor.events_offset)]
        if cursor.inode is not None:
            args += ["--inode", str(cursor.inode)]
        if cursor.fingerprint is not None:
            args += ["--fingerprint", cursor.fingerprint]
        if tail_lines is not None:
            args += ["--tail-lines", str(tail_lines)]
        if self.trackers is not None and not self.trackers.started:
            self.start_trackers()
        for message in self.agent.follow(*args):
            self.handle(message)
            if self.end is not None:
                return
        raise UnreachableError(f"host {self.ref.host}: follow stream ended before the run did")

    def handle(self, message: FollowMessage) -> None:
        with _PRINTING:
            self._handle(message)

    def _handle(self, message: FollowMessage) -> None:
        self.messages += 1
        if self.as_json:
            shown = message.to_json()
            if self.label:
                shown["host"] = self.ref.host
            if isinstance(message, ErrorMessage) and message.record is not None:  # a known failure's line, else null
                shown["diagnosis"] = diagnosis.diagnose(diagnosis.Failure(
                    message.record, self.ref.run_id, self.ref.host, self.hosts))
            console.data(json.dumps(shown) + "\n")
        if isinstance(message, LogMessage):
            self.on_log(message)
        elif isinstance(message, RotatedMessage):
            self.on_rotated(message)
        elif isinstance(message, ErrorMessage):
            self.on_error(message)
        elif isinstance(message, EventsMessage):
            self.on_events(message)
        elif isinstance(message, GpuMessage) and self.live is not None:
            self.progress.gpus = message.gpus
        elif isinstance(message, GpuMessage) and not self.as_json and message.gpus:
            console.human.print(self.label + gpu_line(message.gpus), style="dim", markup=False,
                                highlight=False)
        elif isinstance(message, StateMessage) and not self.as_json:
            console.say(f"{self.label}[{self.ref.run_id}] state {message.state}")
        elif isinstance(message, EndMessage):
            self.end = message

    def start_trackers(self) -> None:
        """Open the trackers in the run's tracker runs, with its config and provenance
        (one round trip; a dropped connection here is one like any other)."""
        status = self.agent.run_status(self.ref.run_id, "--config")
        with _PRINTING:  # trackio's notices on stdout are dropped meanwhile
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
        if not self.as_json:
            self.show_remote(self._labelled(message.data))
            self.line_open = not data.endswith(b"\n")
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

    def _labelled(self, text: str) -> str:
        """`text` with this host's name at the start of each of its lines (a line the
        last text left open goes on without one)."""
        if not self.label or not text:
            return text
        lines = text.split("\n")
        body = ("\n" + self.label).join(lines[:-1] + ([lines[-1]] if lines[-1] else []))
        return ("" if self.line_open else self.label) + body + ("\n" if not lines[-1] else "")

    def on_rotated(self, message: RotatedMessage) -> None:
        """The host's log was cut or replaced: what the stream sends next is new content,
        and goes to a new mirror file."""
        self._close_mirror()
        start = message.offset
        self.cursor = dataclasses.replace(self.cursor, segment=message.segment, inode=message.inode,
                                          offset=start, mirror_start=start, fingerprint=None)
        self.recent = b""
        if not self.as_json:
            if self.line_open:  # end the old content's last line: the new one must not continue it
                self.show_remote("\n")
                self.line_open = False
            missing = ("" if message.complete else
                       f"; lines written to the old file after byte {message.previous_end} "
                       "could not be read")
            saved = f", saved as {self.logs.segment_log(self.cursor.segment)}" if self.claim else ""
            console.say(f"{self.label}[{self.ref.run_id}] train.log was {message.reason} on {self.ref.host}"
                        f"{missing}: the new content follows from its start{saved}")
        self.save_cursor(force=True)

    def on_error(self, message: ErrorMessage) -> None:
        index, record = message.index, message.record
        if index < len(self.records):
            return
        if record is None:  # a line of errors.jsonl that is not JSON: show it as it is
            record = {"thread": "?", "phase": "?", "exc_type": "unreadable errors.jsonl line",
                      "traceback": message.raw or ""}
        self.records.append(record)
        peer_failed = record.get("exc_type") == multihost.PEER_FAILED
        if not self.as_json and peer_failed:
            console.say(console.printable(f"{self.label}thread {record.get('thread')}: "
                                          + multihost.peer_failed_line(record, self.hosts)))
        elif not self.as_json:
            text = render_record(record, self.ref)
            on = f" on {self.ref.host}" if self.label else ""
            console.human.rule(f"thread {record.get('thread')} failed{on}", style="red")
            self.show_remote(text)
        if self.claim:
            self.logs.save_errors(self.records)
            if multihost.root_cause([(self.ref.host, r) for r in self.records])[1] is record:
                path = self.logs.save_traceback(record.get("traceback", ""))
                console.say(f"{self.label}traceback saved to {path}")
        self.cursor = dataclasses.replace(self.cursor, errors_seen=len(self.records))
        self.save_cursor(force=True)

    def on_events(self, message: EventsMessage) -> None:
        """The run's events (all but heartbeats) from the cursor's events offset on:
        they feed the status line, and (for the watch that keeps the local state) go
        to events.jsonl, the TensorBoard files and the trackers, each once."""
        if message.next <= self.cursor.events_offset:
            return  # received before (a stream never resends, but a cursor is cheap to trust)
        events = list(message.events)
        self.progress.update(events)
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

    def show_remote(self, text: str) -> None:
        """Text from the host for people: above the status line when there is one."""
        if self.live is None:
            console.remote_text(text)
        else:
            console.human.print(Text(console.printable(text)), end="", soft_wrap=True)

    def start_status_line(self) -> None:
        self.live = Live(get_renderable=self.progress.render, console=console.human, refresh_per_second=2,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def stop_status_line(self) -> None:
        if self.live is not None:
            self.live.stop()  # the last status stays on screen, above what follows
            self.live = None

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
            self.mirror.close()
            self.mirror = None

    def close(self) -> None:
        self.stop_status_line()
        self.save_cursor(force=True)
        self._close_mirror()
        if self.events_mirror is not None:
            self.events_mirror.close()
        if self.trackers is not None and self.trackers.started:
            with _PRINTING:  # before the claim goes: the next watch goes on from what they record
                self.trackers.close(self.end.state if self.end else None)
        if self.claim:
            self.board.close()
            self.claim.close()

    # -- the outcome -----------------------------------------------------------------
    @property
    def latest_records(self) -> list[dict]:
        """The error records of the attempt that ended (earlier attempts' are history)."""
        return attempt_errors(self.records, self.end.attempt if self.end else 0)

    def finish(self) -> ExitCode:
        self.stop_status_line()
        assert self.end is not None  # the stream ended with it
        state = self.end.state
        code = exit_code_for_state(state)
        if code == ExitCode.RUN_FAILED and not self.latest_records and not self.as_json:
            report = self.agent.call(ReportReply, "--run-id", self.ref.run_id)
            with _PRINTING:
                console.remote_text(render_no_record(report, self.ref))
        console.say(f"run {self.ref.run_id} on {self.ref.host} ended: {state}")
        if code == ExitCode.RUN_FAILED and self.latest_records and not self.as_json and not self.label:
            # One host's part: its root cause's line ends the output (several: the run's, in _watch_hosts).
            say_diagnosis(multihost.root_cause([(self.ref.host, r) for r in self.latest_records])[1], self.ref,
                          self.hosts)
        return code

    def follow_to_end(self, tail: int | None, retry_for: float) -> ExitCode:
        """Follow until the run ends here, reconnecting after dropped connections."""
        if not self.claim:
            console.say(f"another watch of {self.ref.run_id} keeps {self.logs.dir}: this one shows "
                        "the log from its start (or --tail) and saves nothing")
        elif tail is None and self.cursor.offset:
            console.say(f"{self.label}resuming {self.ref.run_id} at byte {self.cursor.offset} "
                        "(--tail N shows earlier lines)")
        tail_lines = tail
        reconnects = Reconnects(retry_for)
        while True:
            seen = self.messages
            try:
                self.follow_once(tail_lines)
                return self.finish()
            except UnreachableError as exc:
                self.save_cursor(force=True)
                tail_lines = None  # from now on resume exactly at the cursor
                if self.messages > seen:  # the last connection worked for a while
                    reconnects.progressed()
                reconnects.wait(exc, "the run may still be going: dflash watch resumes it")


# Whole messages from the watchers of a run's hosts, one at a time: a traceback is
# never cut by another host's lines.
_PRINTING = threading.RLock()


def run(session: Session, ref: RunRef, *, tail: int | None, interval: float, as_json: bool,
        retry_for: float, use_trackers: bool = True) -> ExitCode:
    trackers = session.local_config.trackers if use_trackers else TrackerSettings()
    if trackers.named:
        require_packages(trackers, session.local_config.source)  # before anything is followed
    if ref.multihost:
        return _watch_hosts(session, ref, tail, interval, as_json, retry_for, trackers)
    watcher = Watcher(session, ref, interval, as_json, trackers=trackers)
    if not as_json and console.human.is_terminal and sys.stdout.isatty():
        watcher.start_status_line()
    try:
        return watcher.follow_to_end(tail, retry_for)
    except KeyboardInterrupt:
        console.say(f"\ndetached from {ref.run_id}; it keeps running (dflash watch resumes)")
        return ExitCode.INTERRUPTED
    finally:
        watcher.close()


def _watch_hosts(session: Session, ref: RunRef, tail: int | None, interval: float, as_json: bool,
                 retry_for: float, trackers: TrackerSettings) -> ExitCode:
    """Every host's part of the run followed at once, one thread each; returns when all
    ended, with the whole run's outcome, and names the host of its root cause. A host that
    left the inventory is named and not followed; its part's state is unknown."""
    hosts, left = run_hosts.members(session, ref)
    outcomes: dict[str, ExitCode | DflashError] = dict(left)
    for exc in left.values():
        console.warn(f"{exc.message}: its part is not followed")
    watchers = [Watcher(session, RunRef(host.name, ref.run_id), interval, as_json, ref.hosts, trackers)
                for host in hosts]

    def follow(watcher: Watcher) -> None:
        try:
            outcomes[watcher.ref.host] = watcher.follow_to_end(tail, retry_for)
        except DflashError as exc:
            outcomes[watcher.ref.host] = exc
            console.warn(f"{watcher.label}{exc.message}")
        finally:
            watcher.close()

    # Daemons: Ctrl-C leaves while they wait on their hosts (the cursors are saved as
    # they go, so the next watch resumes).
    threads = [threading.Thread(target=follow, args=(w,), name=f"watch-{w.ref.host}", daemon=True)
               for w in watchers]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except KeyboardInterrupt:
        console.say(f"\ndetached from {ref.run_id}; it keeps running on {', '.join(ref.hosts)} "
                    "(dflash watch resumes)")
        return ExitCode.INTERRUPTED
    ends = {w.ref.host: w.end for w in watchers if w.end}
    states = {host: ends[host].state if host in ends else None for host in ref.hosts}
    state = multihost.aggregate_state(states)
    cause = multihost.root_cause(multihost.in_time_order({w.ref.host: w.latest_records for w in watchers}))
    if cause is not None and not as_json:
        host, record = cause
        blamed = multihost.blamed_host(cause, ref.hosts)
        if blamed is not None:  # no rank recorded its own failure: the one that died or went silent
            line = f"root cause on {blamed} (rank {ref.hosts.index(blamed)}): " + multihost.blamed_line(
                ref.hosts, ends[blamed].exit if blamed in ends else None, cause)
        else:
            line = (f"root cause on {host} (rank {ref.hosts.index(host)}): thread {record.get('thread')} "
                    f"{record.get('exc_type')}: {record.get('message', '')}".rstrip())
        console.say(console.printable(line))
    console.say(f"run {ref.run_id} ended: {multihost.state_name(state)} "
                f"({', '.join(f'{host} {multihost.state_name(s)}' for host, s in states.items())})")
    if cause is not None and not as_json and state == RunState.FAILED:
        say_diagnosis(cause[1], RunRef(cause[0], ref.run_id), ref.hosts)
    if state is None:
        return max((o.exit_code for o in outcomes.values() if isinstance(o, DflashError)), default=ExitCode.UNREACHABLE)
    return exit_code_for_state(state)
