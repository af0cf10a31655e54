"""The `follow` verb: one long-lived stream of JSON lines (log chunks, the run's events,
error records, GPU samples, state changes: dflash_contract.follow.FOLLOW_MESSAGES, each flushed as it
goes) until the run is terminal and everything was sent.

The host does the following so the client never re-tails: it polls with fstat, sends
whole log lines by byte offset (resumable: offset, inode, segment and the fingerprint of
the bytes before the offset), follows the log across truncation and replacement (a
"rotated" line between segments), forwards each errors.jsonl record as soon as its line
is complete, and ends with an "end" line. When the reader goes away (EPIPE, or its pipe
reports an error even while the run is quiet) it exits 0 without a word; the run goes on.

--tail-lines N starts at the last N lines (found by reading backwards from the end, so
the cost does not depend on the log's size), of the file a resume found or of the new
one after "rotated"; --errors-seen K skips the records already received;
--events-offset the events already received.

Resuming: --offset N --inode I --segment K --fingerprint F, F being dflash_contract.requests.fingerprint
of the (at most 64) bytes received just before N. The stream goes on at N in segment K
when the file with inode I (train.log, or renamed to train.log.*) is at least N long and
holds those bytes there. If not, the content the client stopped in is gone: the rest of
it is sent from a copy that holds those bytes, if any, then "rotated" to segment K+1 and
the current train.log from 0. So a reconnect neither replays nor splices: (inode,
offset) alone cannot tell a log cut and grown back past N from the old one. Segment
numbers are the client's: a fresh stream starts at --segment.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import select
import shutil
import sys
import threading
import time
from typing import Iterator, List, Optional, Tuple


from dflash_contract.events import HEARTBEAT
from dflash_contract.follow import (EndMessage, ErrorMessage, EventsMessage, FollowMessage, GpuMessage, LogMessage,
                                    RotatedMessage, StateMessage)
from dflash_contract.records import ErrorRecord, RunRecord, parse_json_line
from dflash_contract.replies import Gpu
from dflash_contract.requests import FINGERPRINT_BYTES, fingerprint

from .gpus import query_gpus
from .jsonio import decode_bytes, encode_line, read_json, tail_start
from .layout import Workspace
from .state import derive_state, observe, read_record

READ_CHUNK = 256 * 1024
# At most one log message per LOG_FLUSH_S (or per LOG_FLUSH_BYTES): every message
# carries ~70 bytes of framing, so a chatty log sent line by line would cost far more on
# the wire than it holds. A quiet log's line still goes out at the next poll, and an
# error record never waits (its log context is flushed with it).
LOG_FLUSH_S = 1.0
LOG_FLUSH_BYTES = 64 * 1024
# A "line" that never ends (a progress bar redrawn with \r) is sent in pieces this big
# rather than held in memory forever.
MAX_PARTIAL_LINE = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class FollowRequest:
    run_id: str
    offset: Optional[int] = None
    inode: Optional[int] = None
    segment: int = 0
    fingerprint: Optional[str] = None
    errors_seen: int = 0
    events_offset: int = 0
    tail_lines: Optional[int] = None
    gpu_interval: float = 5.0
    poll: float = 0.1


class ClientGone(Exception):
    """The reader of our stdout went away (SSH connection dropped, CLI detached)."""


class Output:
    """stdout for several writer threads: whole lines, one lock, flushed line by line."""

    def __init__(self, fd: int = 1):
        self._fd = fd
        self._lock = threading.Lock()
        self._closed = False
        self._poller = select.poll()
        self._poller.register(fd, 0)  # POLLERR/POLLHUP are always reported

    def send(self, message: FollowMessage) -> None:
        data = encode_line(message.to_json())
        with self._lock:
            if self._closed:
                return  # a GPU sample racing the final "end": the stream is over
            try:
                while data:
                    data = data[os.write(self._fd, data):]
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.ECONNRESET):
                    raise ClientGone() from exc
                raise

    def reader_gone(self) -> bool:
        """Noticed without writing: a pipe whose reader closed reports POLLERR."""
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in self._poller.poll(0))

    def close(self) -> None:
        with self._lock:
            self._closed = True


def _open_if_exists(path: str) -> Optional[int]:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None


def _holds_before(fd: int, offset: int, mark: Optional[str]) -> bool:
    """Whether the file is at least `offset` bytes long and holds the bytes `mark` (a
    `fingerprint`) names right before `offset`. Without a mark only the length counts."""
    if os.fstat(fd).st_size < offset:
        return False
    if mark is None:
        return True
    length = int(mark.split(":", 1)[0])
    return length <= offset and fingerprint(os.pread(fd, length, offset - length)) == mark


class LogFollower:
    """Sends train.log from a byte offset, whole lines only, across rotations.

    The file may be truncated in place (logrotate's copytruncate; noticed as a size below
    the read position, or other bytes than those read just before it) or replaced (the
    path names another file that has content: logrotate's create mode, or deleted and
    written anew). Either way the old content's unsent bytes go out first (read from the
    old file, or from a copy of it next to it, e.g. train.log.1), then a "rotated"
    message, then the new content from byte 0 as the next segment. A replacement that is
    still empty is not followed yet: the trainer keeps writing to the file it opened.
    """

    def __init__(self, path: str, request: FollowRequest):
        self._path = path
        self._request = request
        self._tail_lines = request.tail_lines
        self._fd: Optional[int] = None
        self.inode: Optional[int] = None
        self.segment = request.segment
        self.sent = 0  # offset of the first byte not yet sent, in this segment
        self._buffer = b""  # bytes read but not sent: they start at self.sent
        self._recent = b""  # the last bytes before the read position, to notice a rewrite
        self._announce = True  # the next log message names the file and segment
        self._last_flush = float("-inf")

    @property
    def _read_pos(self) -> int:
        return self.sent + len(self._buffer)

    def _start(self, fd: int, offset: int) -> None:
        self._fd = fd
        self.inode = os.fstat(fd).st_ino
        self.sent = offset
        self._recent = os.pread(fd, min(offset, FINGERPRINT_BYTES), max(0, offset - FINGERPRINT_BYTES))

    def _start_at(self, fd: int, path: str, offset: int) -> None:
        """Starts at `offset`, or where --tail-lines puts the start of this stream."""
        tail, self._tail_lines = self._tail_lines, None  # once per stream
        self._start(fd, offset if tail is None else tail_start(path, tail))

    def _open(self) -> Iterator[FollowMessage]:
        """Opens the log on the first poll that finds it. A resume whose content is gone
        first sends what a copy still holds of it, then "rotated"."""
        request = self._request
        if request.offset is None:
            fd = _open_if_exists(self._path)
            if fd is not None:
                self._start_at(fd, self._path, 0)
            return
        found = self._find_inode(request.inode)
        if found is not None and _holds_before(found[0], request.offset, request.fingerprint):
            self._start_at(*found, request.offset)
            return
        if found is not None:
            os.close(found[0])
        new = _open_if_exists(self._path)
        if new is None:
            return  # neither the old content nor a new file: look again at the next poll
        self.inode, self.sent = request.inode, request.offset
        complete = yield from self._drain_copy(request.fingerprint)
        replaced = request.inode is not None and os.fstat(new).st_ino != request.inode
        yield from self._rotate(new, "replaced" if replaced else "truncated", complete)

    def _find_inode(self, inode: Optional[int]) -> Optional[Tuple[int, str]]:
        """(fd, path) of train.log if it is that file (or any file, for None), else of a
        file next to it named train.log.* that is (renamed by a rotation)."""
        fd = _open_if_exists(self._path)
        if fd is not None and (inode is None or os.fstat(fd).st_ino == inode):
            return fd, self._path
        if fd is not None:
            os.close(fd)
        if inode is None:
            return None
        for path in self._siblings():
            try:
                if os.stat(path).st_ino != inode:
                    continue
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            if os.fstat(fd).st_ino == inode:
                return fd, path
            os.close(fd)
        return None

    def _siblings(self) -> List[str]:
        folder, name = os.path.split(self._path)
        return [os.path.join(folder, entry) for entry in sorted(os.listdir(folder))
                if entry.startswith(name + ".")]

    def _drain_copy(self, mark: Optional[str]) -> Iterator[FollowMessage]:
        """Sends what a copy of the old content (a file next to train.log holding the bytes
        `mark` names right before the read position) has past that position. Returns
        whether one was found; without a mark nothing can be matched."""
        if mark is None:
            return self._read_pos == 0  # nothing was read: nothing of it can be missing
        for path in self._siblings():
            fd = _open_if_exists(path)
            if fd is None:
                continue
            try:
                if os.fstat(fd).st_ino != self.inode and _holds_before(fd, self._read_pos, mark):
                    yield from self._read(fd, until_end=True)
                    return True
            finally:
                os.close(fd)
        return False

    def _rotate(self, fd: int, reason: str, complete: bool) -> Iterator[FollowMessage]:
        """Ends the old segment (its last bytes, even a partial line) and starts the next
        at byte 0 of `fd` (or at its --tail-lines start)."""
        yield from self._flush(final=True)
        previous_end = self.sent
        if self._fd is not None and self._fd != fd:
            os.close(self._fd)
        self._buffer = b""
        self._start_at(fd, self._path, 0)
        self.segment += 1
        self._announce = True
        assert self.inode is not None  # _start_at read it from the new file
        yield RotatedMessage(reason=reason, segment=self.segment, inode=self.inode, offset=self.sent,
                             previous_end=previous_end, complete=complete)

    def _follow_rotation(self) -> Iterator[FollowMessage]:
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        rewritten = size > self._read_pos and self._recent and os.pread(
            self._fd, len(self._recent), self._read_pos - len(self._recent)) != self._recent
        if size < self._read_pos or rewritten:
            complete = yield from self._drain_copy(fingerprint(self._recent) if self._recent else None)
            yield from self._rotate(self._fd, "truncated", complete)
            return
        try:
            current = os.stat(self._path)
        except FileNotFoundError:
            return  # deleted: what the old file still gets is read from the open descriptor
        if current.st_ino != self.inode and current.st_size > 0:
            new = _open_if_exists(self._path)
            if new is not None:
                yield from self._read(self._fd, until_end=True)
                yield from self._rotate(new, "replaced", complete=True)

    def _read(self, fd: int, until_end: bool = False) -> Iterator[FollowMessage]:
        """Reads what `fd` holds past the read position into the buffer (up to the size
        seen now, or `until_end`: up to its end), sending full batches on the way."""
        size = None if until_end else os.fstat(fd).st_size
        while size is None or self._read_pos < size:
            chunk = os.pread(fd, READ_CHUNK, self._read_pos)
            if not chunk:
                break  # the end, or shrank since fstat: nothing more to read
            self._buffer += chunk
            self._recent = (self._recent + chunk[-FINGERPRINT_BYTES:])[-FINGERPRINT_BYTES:]
            if len(self._buffer) >= LOG_FLUSH_BYTES:
                yield from self._flush(final=False)

    def poll(self, final: bool, urgent: bool = False) -> Iterator[FollowMessage]:
        """Messages for what is new. `final` (the run ended): also a last partial line.
        `urgent`: send complete lines now rather than batching them."""
        if self._fd is None:
            yield from self._open()
            if self._fd is None:
                return
        yield from self._follow_rotation()
        yield from self._read(self._fd)
        if final or urgent or time.monotonic() - self._last_flush >= LOG_FLUSH_S:
            yield from self._flush(final)

    def _flush(self, final: bool) -> Iterator[FollowMessage]:
        cut = len(self._buffer) if final else self._buffer.rfind(b"\n") + 1
        if not cut and len(self._buffer) >= MAX_PARTIAL_LINE:
            cut = len(self._buffer)
        if cut:
            data, self._buffer = self._buffer[:cut], self._buffer[cut:]
            start, self.sent = self.sent, self.sent + cut
            self._last_flush = time.monotonic()
            # A stream's and a segment's first message names the file.
            announce, self._announce = self._announce, False
            yield LogMessage(offset=start, data=decode_bytes(data), inode=self.inode if announce else None,
                             segment=self.segment if announce else None)


class ErrorsFollower:
    """Sends each errors.jsonl record once its line is complete."""

    def __init__(self, path: str, seen: int):
        self._path = path
        self._seen = seen
        self._pos = 0
        self._index = 0  # index of the next record

    def poll(self, final: bool) -> Iterator[FollowMessage]:
        try:
            with open(self._path, "rb") as handle:
                handle.seek(self._pos)
                data = handle.read()
        except FileNotFoundError:
            return
        cut = len(data) if final else data.rfind(b"\n") + 1
        self._pos += cut
        for line in data[:cut].split(b"\n"):
            if not line.strip():
                continue
            index, self._index = self._index, self._index + 1
            if index < self._seen:
                continue
            record = ErrorRecord.of_line(decode_bytes(line))
            if record.raw is None:
                yield ErrorMessage(index=index, record=record)
            else:
                yield ErrorMessage(index=index, record=None, raw=record.raw)


class EventsFollower:
    """Sends events.jsonl's records from a byte offset, whole lines only, batched like the
    log. Heartbeats stay on the host: they only say the run is alive, which the "state"
    messages already tell, and they would be most of the bytes of a quiet run.

    events.jsonl is the trainer's append-only file (never rotated), so a byte offset is
    all a resume needs. A line that is not JSON (a write cut by a kill) is skipped."""

    def __init__(self, path: str, offset: int):
        self._path = path
        self._fd: Optional[int] = None
        self.sent = offset  # the first byte not yet read into a flush
        # The first byte no message has covered: after a flush of heartbeats alone (no
        # message) the next message starts there, so the messages cover every byte once.
        self._covered = offset
        self._buffer = b""  # complete lines read past self.sent, not yet sent
        self._last_flush = float("-inf")

    def poll(self, final: bool) -> Iterator[FollowMessage]:
        if self._fd is None:
            self._fd = _open_if_exists(self._path)
            if self._fd is None:
                return
        size = os.fstat(self._fd).st_size
        while self.sent + len(self._buffer) < size:
            start = self.sent + len(self._buffer)
            chunk = os.pread(self._fd, min(READ_CHUNK, size - start), start)
            cut = chunk.rfind(b"\n") + 1
            if not chunk or not cut:
                break  # only part of a line: the trainer is writing it
            self._buffer += chunk[:cut]
            if len(self._buffer) >= LOG_FLUSH_BYTES:
                yield from self._flush()
        if self._buffer and (final or time.monotonic() - self._last_flush >= LOG_FLUSH_S):
            yield from self._flush()

    def _flush(self) -> Iterator[FollowMessage]:
        records = [record for record in map(parse_json_line, self._buffer.split(b"\n"))
                   if isinstance(record, dict) and not HEARTBEAT.matches(record)]
        self.sent += len(self._buffer)
        self._buffer = b""
        self._last_flush = time.monotonic()
        if records:  # a stretch of heartbeats alone is not worth a message
            start, self._covered = self._covered, self.sent
            yield EventsMessage(offset=start, next=self.sent, events=tuple(records))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


class GpuSampler(threading.Thread):
    """Samples nvidia-smi every `interval` s into the stream; a failure is kept for the
    main loop to raise, never swallowed."""

    def __init__(self, out: Output, interval: float):
        super().__init__(name="gpu-sampler", daemon=True)
        self._out = out
        self._interval = interval
        self._halt = threading.Event()  # not _stop: Thread has a method of that name
        self.failure: Optional[BaseException] = None
        self.client_gone = False
        self._warned = False

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                found, problem = query_gpus()
                if found:
                    self._out.send(GpuMessage(ts=time.time(), gpus=tuple(map(Gpu.from_json, found))))
                elif problem and not self._warned:
                    sys.stderr.write("dflash-agent follow: %s\n" % problem)
                    self._warned = True
                self._halt.wait(self._interval)
        except ClientGone:
            self.client_gone = True
        except BaseException as exc:
            self.failure = exc

    def check(self) -> None:
        if self.client_gone:
            raise ClientGone()
        if self.failure is not None:
            raise RuntimeError("GPU sampling failed") from self.failure

    def stop(self) -> None:
        self._halt.set()


def follow(ws: Workspace, request: FollowRequest, out: Output) -> int:
    run = ws.existing_run(request.run_id)
    record = read_record(run)
    logs = LogFollower(run.train_log, request)
    errors = ErrorsFollower(run.errors, request.errors_seen)
    events = EventsFollower(run.events, request.events_offset)
    sampler = None
    if request.gpu_interval > 0 and shutil.which("nvidia-smi"):
        sampler = GpuSampler(out, request.gpu_interval)
        sampler.start()
    last_state = None
    try:
        while True:
            if out.reader_gone():
                raise ClientGone()
            if sampler is not None:
                sampler.check()
            # The state is taken before reading: if it is terminal, everything the run
            # wrote is already on disk, and the reads below drain it. run.json is read
            # anew: a restart puts another attempt's trainer in it.
            written = read_json(run.run_json)
            record = record if written is None else RunRecord.from_json(written)
            obs = observe(run, record)
            state = derive_state(obs)
            terminal = state.terminal
            new_errors = list(errors.poll(final=terminal))
            # The log's last lines are the context of an error: they go out first, at once.
            for message in logs.poll(final=terminal, urgent=bool(new_errors)):
                out.send(message)
            for message in new_errors:
                out.send(message)
            for message in events.poll(final=terminal):
                out.send(message)
            if state != last_state:
                out.send(StateMessage(state=state, ts=time.time()))
                last_state = state
            if terminal:
                out.send(EndMessage(state=state, exit=obs.exit, attempt=record.attempt_number,
                                    offset=logs.sent, segment=logs.segment))
                return 0
            time.sleep(request.poll)
    finally:
        events.close()
        if sampler is not None:
            sampler.stop()
        out.close()
