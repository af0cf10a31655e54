"""The `follow` verb: one long-lived stream of JSON lines (log chunks, error records,
GPU samples, state changes) until the run is terminal and everything was sent.

The host does the following so the client never re-tails: it polls with fstat, sends
whole log lines by byte offset (resumable: offset + inode), forwards each errors.jsonl
record as soon as its line is complete, and ends with an "end" line.
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
from typing import Any, Dict, Iterator, Optional

from .gpus import query_gpus
from .jsonio import decode_bytes, encode_line, parse_json_line, tail_start
from .layout import Workspace
from .state import TERMINAL, derive_state, observe, read_record

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
    errors_seen: int = 0
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

    def send(self, obj: Dict[str, Any]) -> None:
        data = encode_line(obj)
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


class LogFollower:
    """Sends train.log from a byte offset, whole lines only."""

    def __init__(self, path: str, request: FollowRequest):
        self._path = path
        self._request = request
        self._fd: Optional[int] = None
        self.inode: Optional[int] = None
        self.sent = 0  # offset of the first byte not yet sent
        self._first_offset: Optional[int] = None  # where this stream started sending
        self._buffer = b""  # bytes read but not sent: they start at self.sent
        self._last_flush = float("-inf")

    def _open(self) -> bool:
        if self._fd is not None:
            return True
        try:
            self._fd = os.open(self._path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # not created yet: the run is starting
        st = os.fstat(self._fd)
        self.inode = st.st_ino
        request = self._request
        if request.offset is not None and (request.inode is None or request.inode == st.st_ino):
            # Resuming: same file. An offset past the end means it is not the same content.
            self.sent = request.offset if request.offset <= st.st_size else 0
        elif request.offset is None and request.tail_lines is not None:
            self.sent = tail_start(self._path, request.tail_lines)
        self._first_offset = self.sent
        return True

    def poll(self, final: bool, urgent: bool = False) -> Iterator[Dict[str, Any]]:
        """Messages for what is new. `final` (the run ended): also a last partial line.
        `urgent`: send complete lines now rather than batching them."""
        if not self._open():
            return
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        while self.sent + len(self._buffer) < size:
            chunk = os.pread(self._fd, READ_CHUNK, self.sent + len(self._buffer))
            if not chunk:
                break  # shrank since fstat: nothing more to read
            self._buffer += chunk
            if len(self._buffer) >= LOG_FLUSH_BYTES:
                yield from self._flush(final=False)
        if final or urgent or time.monotonic() - self._last_flush >= LOG_FLUSH_S:
            yield from self._flush(final)

    def _flush(self, final: bool) -> Iterator[Dict[str, Any]]:
        cut = len(self._buffer) if final else self._buffer.rfind(b"\n") + 1
        if not cut and len(self._buffer) >= MAX_PARTIAL_LINE:
            cut = len(self._buffer)
        if cut:
            data, self._buffer = self._buffer[:cut], self._buffer[cut:]
            start, self.sent = self.sent, self.sent + cut
            self._last_flush = time.monotonic()
            message = {"t": "log", "offset": start, "data": decode_bytes(data)}
            if start == self._first_offset:  # the stream's first message names the file
                message["inode"] = self.inode
            yield message


class ErrorsFollower:
    """Sends each errors.jsonl record once its line is complete."""

    def __init__(self, path: str, seen: int):
        self._path = path
        self._seen = seen
        self._pos = 0
        self._index = 0  # index of the next record

    def poll(self, final: bool) -> Iterator[Dict[str, Any]]:
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
            record = parse_json_line(line)
            if isinstance(record, dict):
                yield {"t": "error", "index": index, "record": record}
            else:
                yield {"t": "error", "index": index, "record": None, "raw": decode_bytes(line)}


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
                    self._out.send({"t": "gpu", "ts": time.time(), "gpus": found})
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
            # wrote is already on disk, and the reads below drain it.
            obs = observe(run, record)
            state = derive_state(obs)
            terminal = state in TERMINAL
            new_errors = list(errors.poll(final=terminal))
            # The log's last lines are the context of an error: they go out first, at once.
            for message in logs.poll(final=terminal, urgent=bool(new_errors)):
                out.send(message)
            for message in new_errors:
                out.send(message)
            if state != last_state:
                out.send({"t": "state", "state": state, "ts": time.time()})
                last_state = state
            if terminal:
                out.send({"t": "end", "state": state, "exit": obs.exit, "offset": logs.sent})
                return 0
            time.sleep(request.poll)
    finally:
        if sampler is not None:
            sampler.stop()
        out.close()
