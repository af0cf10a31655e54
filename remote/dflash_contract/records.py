"""What the agent and the trainer write in a run's folder, as the CLI and the agent read
it (docs/layout.md): exit.json typed, JSON lines, and which of errors.jsonl's records
are one attempt's."""
import dataclasses
import json
from typing import Any, Dict, List, Optional

from .checker import Message, optional


def parse_json_line(line: bytes) -> Optional[Any]:
    """One JSONL record, or None for a line that is not JSON (a torn write)."""
    try:
        return json.loads(line.decode("utf-8"))
    except ValueError:
        return None


def attempt_errors(records: List[Dict[str, Any]], attempt: int) -> List[Dict[str, Any]]:
    """The error records of one attempt of the run (a record without `attempt`, or a line
    that is not JSON, counts as attempt 0's: written before attempts existed)."""
    return [r for r in records if int(r.get("attempt") or 0) == attempt]


@dataclasses.dataclass(frozen=True)
class ExitRecord(Message):
    """exit.json: how the trainer of the run's last attempt ended, written by its
    supervisor (docs/layout.md)."""

    exit_code: Optional[int]  # None: a signal ended it, or it never ran (exec_error)
    signal: Optional[str]  # the signal's name, SIGKILL
    oom_killed: bool  # the kernel's OOM killer sent that signal
    ended_at: float
    exec_error: Optional[str]  # why the trainer could not be started
    attempt: Optional[int] = optional()  # None: written before attempts existed (attempt 0)
    # null, or the supervisor's own problem in ending the run (no space left to write this)
    error: Optional[str] = optional(written=True)

    @classmethod
    def describe(cls) -> str:
        return "exit.json"

    def ended_by(self) -> str:
        """How the trainer ended: "killed by SIGKILL (the kernel's OOM killer)", "exit code 1"."""
        cause = "killed by %s" % self.signal if self.signal else "exit code %s" % self.exit_code
        return cause + (" (the kernel's OOM killer)" if self.oom_killed else "")


@dataclasses.dataclass(frozen=True)
class AbortRecord(Message):
    """What a rank of a run on several hosts leaves under names.ABORT_KEY in the run's
    store when it fails or stops, for its peers to stop on (docs/multihost.md "Failure
    propagation"); the supervisor leaves one for a trainer killed by a signal."""

    rank: int
    kind: str  # FAILED or STOPPED below
    exc_type: Optional[str]  # None: stopped, or killed without a word
    message: str
    thread: Optional[str] = optional()  # the thread that failed

    FAILED = "failed"
    STOPPED = "stopped"

    @classmethod
    def describe(cls) -> str:
        return "abort record"
