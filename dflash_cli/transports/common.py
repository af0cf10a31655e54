"""Pieces shared by the transports: argv checks, stdin chunking, line splitting,
threads whose result or exception the caller collects, and the error for a failed stream."""
from __future__ import annotations

import os
import threading
from typing import BinaryIO, Callable, Generic, Iterator, Sequence, TypeVar

from ..errors import DflashError, ExitCode

#: bytes per read or write; large enough for throughput, small enough to stay prompt
CHUNK = 64 * 1024
#: seconds between keepalive packets, and how many may go unanswered before the
#: connection counts as lost (OpenSSH's ServerAliveInterval/CountMax, where the
#: user's config sets none)
KEEPALIVE_S = 5
KEEPALIVE_COUNT = 3
#: the exit code of a command killed by a signal on an SSH host: sshd sends no exit
#: status then, and the OpenSSH client reports 255 (so does the paramiko transport)
SIGNALLED_EXIT = 255

T = TypeVar("T")


class CommandFailed(DflashError):
    """A streamed command exited non-zero. `status` is its exit code, `stderr` its error output.

    Maps to the CLI's exit code 2 when the command itself reported a usage problem
    (the agent exits 2 for usage, not-found and conflict), otherwise 3: the state of
    what the command was looking at is unknown."""

    def __init__(self, describe: str, argv: Sequence[str], status: int, stderr: bytes):
        text = stderr.decode("utf-8", errors="replace").strip()
        detail = f": {text}" if text else ""
        super().__init__(f"{describe}: `{argv[0]}` exited with status {status}{detail}",
                         ExitCode.USAGE if status == 2 else ExitCode.UNREACHABLE)
        self.argv = tuple(argv)
        self.status = status
        self.stderr = stderr


def normalize_argv(argv: Sequence[str | os.PathLike[str]]) -> list[str]:
    """argv as a list of str. A bare string is refused: it would be split into characters."""
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a sequence of arguments, not one string")
    args = [os.fspath(arg) for arg in argv]
    if not args:
        raise ValueError("argv must not be empty")
    return args


def iter_chunks(stdin: bytes | BinaryIO) -> Iterator[bytes]:
    """`stdin` (bytes or a readable binary file) in chunks of at most CHUNK bytes."""
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        view = memoryview(stdin)
        for start in range(0, len(view), CHUNK):
            yield view[start:start + CHUNK].tobytes()
        return
    while chunk := stdin.read(CHUNK):
        yield chunk


def feed_stdin(stdin: bytes | BinaryIO, write: Callable[[bytes], object], abort: Callable[[], None],
               what: str, tally: Callable[..., None]) -> None:
    """Write `stdin` chunk by chunk with `write`, until it ends or the command stops
    reading (`write` raises OSError: it exited, or the connection dropped; its exit
    status tells which). When reading `stdin` itself fails, `abort` ends the command
    first, so that it does not take the part it got for the whole input."""
    try:
        for chunk in iter_chunks(stdin):
            try:
                write(chunk)
            except OSError:
                return
            tally(sent=len(chunk))
    except DflashError:
        abort()
        raise
    except Exception as exc:
        abort()
        raise DflashError(f"{what}: reading its input failed: {exc}") from exc


class LineSplitter:
    """Turns chunks into complete lines (newline kept); the partial tail waits for more."""

    def __init__(self) -> None:
        self._partial = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._partial += data
        end = self._partial.rfind(b"\n")
        if end < 0:
            return []
        complete = bytes(self._partial[:end])
        del self._partial[:end + 1]
        # split on b"\n" only: bytes.splitlines would also split on \r, \x0b, \x1c...
        return [line + b"\n" for line in complete.split(b"\n")]

    def rest(self) -> bytes:
        """The bytes after the last newline (a last line without one)."""
        rest = bytes(self._partial)
        self._partial.clear()
        return rest


class ResultThread(threading.Thread, Generic[T]):
    """A daemon thread running `target`; `result()` joins and re-raises its exception,
    so a failure in a pump thread surfaces in the caller instead of dying silently."""

    def __init__(self, name: str, target: Callable[[], T]):
        super().__init__(name=name, daemon=True)
        self._target_fn = target
        self._value: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self._target_fn()
        except BaseException as exc:  # forwarded to whoever calls result()
            self._error = exc

    def result(self) -> T:
        self.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def read_to_end(recv: Callable[[int], bytes]) -> bytes:
    """Call recv(CHUNK) until it returns b"" and join what it returned."""
    parts = []
    while data := recv(CHUNK):
        parts.append(data)
    return b"".join(parts)


class Tally:
    """What a transport moved: `round_trips` (commands run), `bytes_received` (stdout +
    stderr) and `bytes_sent` (stdin), added to from any thread, for tests and benchmarks."""

    def __init__(self) -> None:
        self.round_trips = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self._tally_lock = threading.Lock()

    def tally(self, *, trips: int = 0, received: int = 0, sent: int = 0) -> None:
        with self._tally_lock:
            self.round_trips += trips
            self.bytes_received += received
            self.bytes_sent += sent


class Deadline:
    """Calls `expire` once after `seconds` (never when seconds is None) unless cancelled;
    `expired` tells afterwards whether it fired."""

    def __init__(self, seconds: float | None, expire: Callable[[], None]):
        self.expired = False
        self._expire = expire
        self._timer = None
        if seconds is not None:
            self._timer = threading.Timer(seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        self.expired = True
        self._expire()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
