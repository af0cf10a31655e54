"""A run's state (docs/runs.md "Run states"), derived on the host (dflash_agent/state.py),
with everything a state means anywhere else: the exit code `dflash status` and `watch`
give for it (docs/cli.md "CLI exit codes"), which state wins when the hosts of one run
disagree, whether the run ended and whether it counts as failed."""
import enum

# CLI exit codes a run state maps to (dflash_cli/errors.py's ExitCode holds the rest).
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_STOPPED = 4

# Where a host that could not be asked ranks among the states (see RunState.precedence):
# behind a failure anywhere, ahead of every state that would hide it.
UNKNOWN_PRECEDENCE = 2


class RunState(str, enum.Enum):
    """On the wire: its name. Each member is (name, exit code, precedence, failed,
    terminal, told by stacks): precedence orders the hosts' states of one run, lowest
    first, the run's state being the first any host is in. FAILED anywhere is the run
    failed; a stop of one part stops the whole; RUNNING only when every host runs, and
    SUCCEEDED only when every host succeeded. STALLED shares exit 1 with DEGRADED: the
    run is alive but not well, and `dflash stacks` shows where it hangs. A hang and a
    stop record no error: where every thread is (now, or at the stop's dump) is what
    `fetch-traceback` shows for them."""

    STARTING = ("STARTING", EXIT_OK, 6, False, False, False)
    RUNNING = ("RUNNING", EXIT_OK, 7, False, False, False)
    SUCCEEDED = ("SUCCEEDED", EXIT_OK, 8, False, True, False)
    FAILED = ("FAILED", EXIT_RUN_FAILED, 0, True, True, False)
    STOPPED = ("STOPPED", EXIT_STOPPED, 3, False, True, True)
    DEGRADED = ("DEGRADED", EXIT_RUN_FAILED, 5, False, False, False)  # alive, and a thread recorded an error
    # alive, and no progress for stall_after seconds (or stopped by a signal)
    STALLED = ("STALLED", EXIT_RUN_FAILED, 4, False, False, True)
    LOST = ("LOST", EXIT_RUN_FAILED, 1, True, True, False)  # no process left, and nobody recorded how the run ended

    def __new__(cls, name: str, exit_code: int, precedence: int, failed: bool, terminal: bool,
                told_by_stacks: bool) -> "RunState":
        member = str.__new__(cls, name)
        member._value_ = name
        member.exit_code = exit_code
        member.precedence = precedence
        member.failed = failed  # the run ended without finishing its job
        member.terminal = terminal  # the run ended: no process of it is left
        member.told_by_stacks = told_by_stacks  # without an error record, the threads' stacks say what happened
        return member

    def __str__(self) -> str:
        return self.value  # f-strings and str() show the name on every Python
