"""The `local` transport: commands run as subprocesses of this machine, with no shell.

Nothing expands `~` or `$VAR` in argv here; the agent expands its own workspace path.
Each command starts in a new session so that a timeout or a closed stream can end it
and its children (by the process group recorded at start) without touching anything
else this process started.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import BinaryIO, Iterator, Sequence

from ..errors import UnreachableError
from ..inventory import Host
from .base import Completed, Transport
from .common import CHUNK, CommandFailed, Deadline, Tally, ResultThread, feed_stdin, normalize_argv

#: exit codes a shell reports for a program it cannot start
_NOT_FOUND, _NOT_EXECUTABLE = 127, 126
#: seconds a stream's command gets to exit after SIGTERM before SIGKILL
_TERM_GRACE_S = 5.0


def _exit_code(returncode: int) -> int:
    # a process killed by signal N reads as 128+N, as a shell reports it over ssh
    return 128 - returncode if returncode < 0 else returncode


def _kill_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the process group this transport created for `proc` (pgid == its pid)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class LocalTransport(Tally, Transport):
    def __init__(self, host: Host):
        super().__init__()
        self.host = host
        self.describe = host.name or "local"

    def _command(self, argv: list[str]) -> list[str]:
        """What to start for `argv` (a subclass reaches another host through a client)."""
        return argv

    def _outcome(self, proc: subprocess.Popen[bytes], argv: list[str], code: int, stderr: bytes) -> int:
        """The exit code of `argv` from that of `proc` (which ran `_command(argv)`); a
        subclass raises UnreachableError here when the client, not `argv`, failed."""
        return code

    def _start(self, argv: list[str], stdin: int) -> subprocess.Popen[bytes] | Completed:
        try:
            proc = subprocess.Popen(self._command(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            # Report what a shell would, so callers see the same thing on every transport.
            code = _NOT_FOUND if isinstance(exc, FileNotFoundError) else _NOT_EXECUTABLE
            return Completed(tuple(argv), code, b"", f"{argv[0]}: {exc.strerror}\n".encode())
        self.tally(trips=1)
        return proc

    def run(self, argv: Sequence[str], *, stdin: bytes | BinaryIO | None = None,
            timeout: float | None = None) -> Completed:
        args = normalize_argv(argv)
        proc = self._start(args, subprocess.PIPE)
        if isinstance(proc, Completed):
            return proc
        assert proc.stdin and proc.stdout and proc.stderr
        feeder = ResultThread(f"{self.describe}-stdin", lambda: self._feed(proc, stdin, args))
        errors = ResultThread(f"{self.describe}-stderr", proc.stderr.read)
        output = ResultThread(f"{self.describe}-stdout", proc.stdout.read)
        for thread in (feeder, errors, output):
            thread.start()
        deadline = Deadline(timeout, lambda: _kill_group(proc, signal.SIGKILL))
        try:
            code = proc.wait()
        finally:
            deadline.cancel()
        if deadline.expired:
            # not waiting for the streams to end: what holds them may outlive the kill
            # (an ssh master keeps them until the remote command ends)
            raise UnreachableError(f"{self.describe}: `{args[0]}` did not finish within {timeout:g} s")
        try:
            out = output.result()
            err = errors.result()
            feeder.result()
        finally:
            proc.stdout.close()
            proc.stderr.close()
        self.tally(received=len(out) + len(err))
        return Completed(tuple(args), self._outcome(proc, args, _exit_code(code), err), out, err)

    def _feed(self, proc: subprocess.Popen[bytes], stdin: bytes | BinaryIO | None, argv: list[str]) -> None:
        assert proc.stdin
        try:
            if stdin is not None:
                feed_stdin(stdin, proc.stdin.write, lambda: _kill_group(proc, signal.SIGKILL),
                           f"{self.describe}: `{argv[0]}`", self.tally)
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it exited without reading all of its input; its exit code tells

    def chunks(self, argv: Sequence[str]) -> Iterator[bytes]:
        args = normalize_argv(argv)
        proc = self._start(args, subprocess.DEVNULL)
        if isinstance(proc, Completed):
            raise CommandFailed(self.describe, args, proc.exit_code, proc.stderr)
        assert proc.stdout and proc.stderr
        errors = ResultThread(f"{self.describe}-stderr", proc.stderr.read)
        errors.start()
        try:
            # os.read returns whatever is available: it is yielded as soon as it arrives
            while data := os.read(proc.stdout.fileno(), CHUNK):
                self.tally(received=len(data))
                yield data
            code = _exit_code(proc.wait())
            err = errors.result()
            self.tally(received=len(err))
            code = self._outcome(proc, args, code, err)
            if code != 0:
                raise CommandFailed(self.describe, args, code, err)
        finally:
            if proc.poll() is None:  # the consumer stopped early: end what we started
                _kill_group(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=_TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    _kill_group(proc, signal.SIGKILL)
                    proc.wait()
            proc.stdout.close()
            # a grandchild in another session may still hold stderr open: do not wait forever
            errors.join(timeout=_TERM_GRACE_S)
            if not errors.is_alive():
                proc.stderr.close()

    def close(self) -> None:
        """Nothing to release: every command's processes are waited for."""
