"""What the agent and the trainer write in a run's folder, as the CLI and the agent read
it (docs/layout.md): run.json and exit.json typed, JSON lines, and which of
errors.jsonl's records are one attempt's."""
import dataclasses
import json
from typing import Any, Dict, List, Literal, Optional, Tuple

from .checker import Message, optional
from .states import RunState


def parse_json_line(line: bytes) -> Optional[Any]:
    """One JSONL record, or None for a line that is not JSON (a torn write)."""
    try:
        return json.loads(line.decode("utf-8"))
    except ValueError:
        return None


def attempt_errors(records: List["ErrorRecord"], attempt: int) -> List["ErrorRecord"]:
    """The error records of one attempt of the run (a record without `attempt`, or a line
    that is not JSON, counts as attempt 0's: written before attempts existed)."""
    return [r for r in records if (r.attempt or 0) == attempt]


@dataclasses.dataclass(frozen=True)
class ErrorFrame(Message):
    """One frame of an error record's root cause, innermost last."""

    file: str
    line: Optional[int]
    func: str
    code: Optional[str]


@dataclasses.dataclass(frozen=True)
class PeerFailure(Message):
    """A PeerFailed record's `detail` (docs/errors.md): the rank of the peer that failed
    or went silent, and what it said."""

    peer_rank: int
    peer_exc_type: Optional[str]  # None: the peer died or went silent without a word
    peer_message: str
    silence_s: Optional[float] = optional(written=True)  # None: not silence, a failure or a closed link


@dataclasses.dataclass(frozen=True)
class MemoryPart(Message):
    """One of a CUDA out-of-memory record's `memory.parts` (docs/errors.md): what a part
    of the trainer held on a device."""

    part: str  # target, drafter-N, drafter-N CUDA graphs
    device: str  # cuda:N
    bytes: int


@dataclasses.dataclass(frozen=True)
class ErrorRecord(Message):
    """One errors.jsonl record: a thread that failed (docs/errors.md), written by the
    trainer. Every key may be missing in a record of an older release (and in the
    `{"raw": text}` form of a line that is no record); `detail` and `memory` are the
    facts of their kinds, as docs/errors.md gives them."""

    ts: Optional[float] = optional()
    run_id: Optional[str] = optional(written=True)
    thread: Optional[str] = optional()
    thread_ident: Optional[int] = optional(written=True)
    phase: Optional[str] = optional()  # startup, train or shutdown
    step: Optional[int] = optional(written=True)
    exc_type: Optional[str] = optional()
    message: Optional[str] = optional()
    traceback: Optional[str] = optional()
    frames: Optional[Tuple[ErrorFrame, ...]] = optional()
    release_id: Optional[str] = optional(written=True)
    attempt: Optional[int] = optional()  # None: written before attempts existed (attempt 0)
    detail: Optional[Dict[str, Any]] = optional()  # facts beyond the message, by exc_type
    memory: Optional[Dict[str, Any]] = optional()  # who held the memory, for a CUDA OOM
    raw: Optional[str] = optional()  # the text of a line that is no record

    @classmethod
    def describe(cls) -> str:
        return "errors.jsonl record"

    @classmethod
    def of_line(cls, line: str) -> "ErrorRecord":
        """A line of errors.jsonl: its record, or, for a line that is not one (torn,
        spoiled), the `{"raw": text}` form that keeps its text."""
        try:
            return cls.from_json(json.loads(line))
        except ValueError:  # not JSON, or not a record (ProtocolError)
            return cls(raw=line)

    def to_json(self) -> Dict[str, Any]:
        return {"raw": self.raw} if self.raw is not None else super().to_json()

    PEER_FAILED = "PeerFailed"  # the exc_type of a rank stopping because another failed

    def peer_failure(self) -> Optional[PeerFailure]:
        """The detail of a PeerFailed record; None for any other."""
        if self.exc_type != self.PEER_FAILED or self.detail is None:
            return None
        return PeerFailure.from_json(self.detail)

    def memory_parts(self) -> Tuple[MemoryPart, ...]:
        """What the trainer noted each part held, from a CUDA out-of-memory record."""
        return tuple(MemoryPart.from_json(part) for part in (self.memory or {}).get("parts", ()))

    def summary(self) -> str:
        """`exc_type: message`, or the raw text."""
        return self.raw if self.raw is not None else "%s: %s" % (self.exc_type, self.message)


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


@dataclasses.dataclass(frozen=True)
class ProcessRef(Message):
    """A process as run.json names it: its pid and its start time in clock ticks since
    boot (pids are reused; the pair is not)."""

    pid: Optional[int]
    start_time: Optional[int]


@dataclasses.dataclass(frozen=True)
class RunPlace(Message):
    """run.json's `distributed`: this host's place in a run on several hosts
    (docs/multihost.md)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    hosts: Optional[Tuple[str, ...]] = optional()  # the CLI's host names, in rank order


@dataclasses.dataclass(frozen=True)
class ReleaseSource(Message):
    """run.json's `source`: the tree a release was made from and its git state, as the CLI
    saw it when it deployed (docs/releases.md). The git facts are None, with `git_problem`
    saying why, where the tree is not a git checkout."""

    kind: str  # how the tree was chosen: the project stood in, --source DIR, or "bundled"
    path: str
    release_id: str
    dflash_version: Optional[str]  # None: not installed, or not looked up
    git_commit: Optional[str]
    dirty: Optional[bool]
    diff_sha256: Optional[str]  # of the uncommitted changes that were deployed
    modified: Tuple[str, ...]  # the first of the changed paths
    modified_count: Optional[int] = optional(written=True)  # every changed path
    git_problem: Optional[str] = optional(written=True)  # always written; a default as it follows one

    @classmethod
    def describe(cls) -> str:
        return "run.json source"

    def commit_mark(self) -> Optional[str]:
        """`1a2b3c4` for a clean checkout, `1a2b3c4*` with uncommitted changes, None without git."""
        if not self.git_commit:
            return None
        return self.git_commit[:7] + ("*" if self.dirty else "")


@dataclasses.dataclass(frozen=True)
class RestartPolicy(Message):
    """run.json's `restart`: the config's `restart:`, which the run's supervisor applies
    when an attempt ends (docs/runs.md "Attempts: resume and restart")."""

    max: int  # restarts at most in a row; 0: none
    on: Tuple[Literal["failure", "killed"], ...]  # the causes restarted
    backoff_s: float  # before the first restart; doubled before each next one

    @classmethod
    def describe(cls) -> str:
        return "restart policy"

    def problem(self) -> Optional[str]:
        """What is wrong with the policy's values, or None (the CLI checked the config;
        this guards the agent's own input)."""
        if self.max < 0:
            return "max must be an integer >= 0"
        if self.backoff_s < 0:
            return "backoff_s must be a number >= 0"
        return None


@dataclasses.dataclass(frozen=True)
class CheckpointRef(Message):
    """The checkpoint an attempt started from."""

    step: int
    path: str


@dataclasses.dataclass(frozen=True)
class AttemptEntry(Message):
    """One of run.json's `attempts` (docs/runs.md "Attempts: resume and restart"): how an
    attempt started and, once it ended, how. The four keys of its end are written only
    then (`exit` null when nobody wrote exit.json)."""

    attempt: int
    reason: str  # launch, resume or restart
    started_at: float
    pid: int
    release_id: str
    resume_from: Optional[CheckpointRef]  # None: from the start
    started_by: Optional[str] = optional()  # "warm" or "exec"; missing in an older release's
    exit: Optional[ExitRecord] = optional(written=True)
    state: Optional[RunState] = optional(written=True)  # how it ended: STOPPED, FAILED, LOST
    step: Optional[int] = optional(written=True)  # its root cause's step for a failure, else its last
    ended_at: Optional[float] = optional(written=True)  # None: not ended

    @classmethod
    def describe(cls) -> str:
        return "run.json attempt"

    def to_json(self) -> Dict[str, Any]:
        out = super().to_json()
        if self.ended_at is None:  # still running: the keys of its end are not there yet
            for key in ("exit", "state", "step", "ended_at"):
                del out[key]
        return out


@dataclasses.dataclass(frozen=True)
class RunRecord(Message):
    """run.json: the run's latest attempt, written by its supervisor before the trainer
    starts (docs/layout.md). The keys the first release wrote are required; those added
    since may be missing in a run of an older release, and read as None."""

    run_id: str
    name: Optional[str]
    release_id: str
    release_dir: str
    workspace: str
    config: str  # config.yaml's text
    config_source: str
    argv: Tuple[str, ...]
    cwd: str
    env_keys: Tuple[str, ...]
    pid: int
    pgid: int
    start_time: Optional[int]  # the trainer's, in clock ticks since boot
    boot_id: Optional[str]
    host: str
    started_at: float
    stall_after: float
    resources: Tuple[str, ...]
    supervisor: ProcessRef
    overrides: Optional[Tuple[str, ...]] = optional()
    started_by: Optional[str] = optional()  # "warm" or "exec"
    warm_reason: Optional[str] = optional(written=True)  # why not "warm"
    startup_stall_after: Optional[float] = optional()
    source: Optional[ReleaseSource] = optional(written=True)  # where the release came from
    restart: Optional[RestartPolicy] = optional(written=True)
    distributed: Optional[RunPlace] = optional(written=True)
    attempt: Optional[int] = optional()  # None: written before attempts existed (attempt 0)
    attempts: Optional[Tuple[AttemptEntry, ...]] = optional()

    @classmethod
    def describe(cls) -> str:
        return "run.json"

    @property
    def attempt_number(self) -> int:
        """The latest attempt's number (0 for a run.json from before attempts existed)."""
        return self.attempt or 0
