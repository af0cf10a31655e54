"""The one small interface every transport (local, ssh, pct) implements.

Commands are argv lists. A transport quotes them exactly once, for the one shell that
reads them (the SSH server's login shell); `local` runs them with no shell at all.
Nothing here raises anything but DflashError subclasses: a transport that cannot
reach its host raises UnreachableError (exit code 3).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import BinaryIO, Iterator, Sequence

from ..errors import DflashError
from .common import CommandFailed, LineSplitter


@dataclasses.dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    exit_code: int
    stdout: bytes
    stderr: bytes


class Transport(abc.ABC):
    """A host reached through zero or more hops. One instance per host per CLI invocation."""

    #: human-readable description of the hop chain, e.g. "root@node -> pct 200"
    describe: str

    @abc.abstractmethod
    def run(self, argv: Sequence[str], *, stdin: bytes | BinaryIO | None = None,
            timeout: float | None = None) -> Completed:
        """Run argv to completion; stdin (bytes or a readable binary file) is streamed in
        and closed. Returns whatever the exit code; raises UnreachableError only when the
        host or container cannot be reached (for pct: exit 255 with Proxmox's message)."""

    @abc.abstractmethod
    def chunks(self, argv: Sequence[str]) -> Iterator[bytes]:
        """Run argv and yield its stdout in chunks as they come (raw bytes, for a file's
        content). Ends when the command exits; raises UnreachableError if the connection
        drops before the command exited, and CommandFailed if it exits non-zero (after
        every chunk it wrote)."""

    def stream(self, argv: Sequence[str]) -> Iterator[bytes]:
        """Run argv and yield its stdout line by line (bytes, newline kept) as it comes.
        Ends when the command exits; raises UnreachableError if the connection drops
        before the command exited (a partial last line is then no data), and
        CommandFailed if it exits non-zero."""
        splitter = LineSplitter()
        try:
            for data in self.chunks(argv):
                yield from splitter.feed(data)
        except CommandFailed:
            if rest := splitter.rest():
                yield rest
            raise
        if rest := splitter.rest():
            yield rest

    def prepare(self) -> None:
        """What the first command needs that contacts no host, done ahead (the SSH
        transports resolve the target's options: `ssh -G`); nothing for `local`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections. Safe to call twice."""

    def read_file(self, path: str) -> bytes:
        """Bytes of a file on the host (inside the container for pct)."""
        done = self.run(["cat", "--", path])
        if done.exit_code != 0:
            raise DflashError(f"{self.describe}: cannot read {path}: "
                              f"{done.stderr.decode(errors='replace').strip()}")
        return done.stdout

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
