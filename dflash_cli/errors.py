"""The one error type of the core and the CLI's exit codes (docs/cli.md "CLI exit codes").

The core raises `DflashError` with the exit code that fits; only `cli.py` turns it
into a message on stderr and a process exit status.
"""
from __future__ import annotations

import enum

from dflash_contract.states import EXIT_OK, EXIT_RUN_FAILED, EXIT_STOPPED, RunState


class ExitCode(enum.IntEnum):
    """What each code means is docs/cli.md's "CLI exit codes"; a run state's is its RunState's."""
    OK = EXIT_OK
    RUN_FAILED = EXIT_RUN_FAILED
    USAGE = 2
    UNREACHABLE = 3
    STOPPED = EXIT_STOPPED
    LOCAL_DISK_FULL = 5
    INTERRUPTED = 130


def exit_code_for_state(state: RunState | None) -> ExitCode:
    """The exit code of `status` and `watch` for a run state; None, a state nobody could
    tell (a host that could not be asked), is a state this CLI cannot vouch for (3)."""
    return ExitCode.UNREACHABLE if state is None else ExitCode(state.exit_code)


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


class BadOption(DflashError):
    """Options the verb cannot take: a value out of its range, or options that do not go
    together. `problem` names each of `options` as `{option}`, the parameter as the Python
    API spells it (`{master_port}`): the API's message reads so, the CLI's names its --flag
    instead (cli.py), so the rule is stated once, here in the core, for both."""

    def __init__(self, problem: str, *options: str):
        self.problem = problem
        self.options = options
        super().__init__(self.named({option: option for option in options}), ExitCode.USAGE)

    def named(self, spelled: dict[str, str]) -> str:
        """The message with each option spelled as `spelled` says."""
        message = self.problem
        for option in self.options:
            message = message.replace(f"{{{option}}}", spelled[option])
        return message


def at_least(option: str, value: float | None, low: float) -> None:
    """BadOption unless `value` (None: not given) is at least `low`."""
    if value is not None and value < low:
        raise BadOption(f"{{{option}}} {value}: expected at least {low}", option)
