"""The one error type of the core and the CLI's exit codes (docs/cli.md "CLI exit codes").

The core raises `DflashError` with the exit code that fits; only `cli.py` turns it
into a message on stderr and a process exit status.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_contract.replies import RunState


class ExitCode(enum.IntEnum):
    OK = 0
    RUN_FAILED = 1  # the run failed or was found failed; the traceback was printed
    USAGE = 2  # usage or configuration error
    UNREACHABLE = 3  # host unreachable, or run state unknown after retries
    STOPPED = 4  # the run was stopped
    LOCAL_DISK_FULL = 5  # this machine's disk (logs/) is full; the run itself is not affected
    INTERRUPTED = 130  # the user pressed Ctrl-C; the run keeps going


def exit_code_for_state(state: RunState | None) -> ExitCode:
    """The exit code of `status` and `watch` for a run state; None, a state nobody could
    tell (a host that could not be asked), is a state this CLI cannot vouch for (3)."""
    # imported here: the protocol's dataclasses take ~17 ms to define, and the verbs that
    # never see a run state (deploy, setup) import this module first thing
    from dflash_contract.replies import RunState

    # docs/cli.md "CLI exit codes". STALLED shares 1 with DEGRADED: the run is alive but not
    # well (no progress for stall_after seconds), and `dflash stacks` shows where it hangs.
    exit_for_state = {
        RunState.STARTING: ExitCode.OK, RunState.RUNNING: ExitCode.OK, RunState.SUCCEEDED: ExitCode.OK,
        RunState.FAILED: ExitCode.RUN_FAILED, RunState.LOST: ExitCode.RUN_FAILED,
        RunState.DEGRADED: ExitCode.RUN_FAILED, RunState.STALLED: ExitCode.RUN_FAILED,
        RunState.STOPPED: ExitCode.STOPPED,
    }
    return ExitCode.UNREACHABLE if state is None else exit_for_state[state]


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
