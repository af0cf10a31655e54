"""The one error type of the core and the CLI's exit codes (DESIGN.md).

The core raises `DflashError` with the exit code that fits; only `cli.py` turns it
into a message on stderr and a process exit status.
"""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    RUN_FAILED = 1  # the run failed or was found failed; the traceback was printed
    USAGE = 2  # usage or configuration error
    UNREACHABLE = 3  # host unreachable, or run state unknown after retries
    STOPPED = 4  # the run was stopped
    INTERRUPTED = 130  # the user pressed Ctrl-C; the run keeps going


class DflashError(Exception):
    """A failure the user can act on. `hint` is an optional second line."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.USAGE, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.hint = hint


class UnreachableError(DflashError):
    """The host (or the container behind it) could not be reached."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message, ExitCode.UNREACHABLE, hint)


class ConnectionLost(UnreachableError):
    """The connection dropped while a command ran: the host was reachable a moment ago,
    so an idempotent command is worth running again (the transport reconnects)."""
