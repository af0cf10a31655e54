"""The agent's protocol as types: the reply of every verb and the error object
(dflash_agent's docstring lists the verbs and their options; follow.py the messages of
the `follow` stream).

Each type is a checker.Message: the agent prints its `to_json()`, the CLI reads it with
`from_json()`, strictly.

run.json, exit.json and errors.jsonl's records are records.RunRecord, ExitRecord and
ErrorRecord; events.jsonl's events are passed on as they are, typed Dict[str, Any]: the
trainer's format (docs/events.md), read by whoever reads that file.

Standard library only, and Python 3.8's: the agent imports it from its release, the CLI
from its own tree.
"""
import dataclasses
import enum
from typing import Any, Dict, Optional, Tuple

from .checker import Message, optional
from .records import ErrorRecord, ExitRecord, PeerFailure, ReleaseSource, RunRecord
from .states import RunState


class ErrorKind(str, enum.Enum):
    """What an error reply's `kind` says went wrong."""

    USAGE = "usage"  # a bad option or value
    NOT_FOUND = "not_found"  # no such run, release, checkpoint, artifacts...
    CONFLICT = "conflict"  # the run or resource is in a state that refuses the request
    HOST = "host"  # the host was reached but cannot take it: a package, a path, disk space
    INTERNAL = "internal"  # the agent failed (exit 1; its traceback is on stderr)
    NOT_DEPLOYED = "not_deployed"  # the CLI's bootstrap found no agent in the release folder

    def __str__(self) -> str:
        return self.value


class Reply(Message):
    """The one JSON object a verb prints on stdout."""

    VERB = ""

    @classmethod
    def describe(cls) -> str:
        return "agent %s reply" % cls.VERB


# -- errors ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ErrorReply(Message):
    """What any verb prints instead of its reply when it refuses or fails, exiting 2 (1 for
    kind internal). For `send-file` and `send-compile-artifacts`, whose stdout carries
    bytes, it is the one line on stderr and stdout stays empty."""

    error: str  # the message, for people
    kind: ErrorKind
    hint: Optional[str] = optional()  # what to do instead, shown under the message
    path: Optional[str] = optional()  # kind host: the file it could not write (no space left) or read (run.json)
    resource: Optional[str] = optional()  # a lock conflict: the resource in use...
    holders: Optional[Tuple[str, ...]] = optional()  # ... and the ids of the runs using it
    state: Optional[RunState] = optional()  # a refused resume: the run's state

    @classmethod
    def describe(cls) -> str:
        return "agent error reply"


# -- launch and resume -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LaunchReply(Reply):
    """`launch`: the run started detached (dflash_agent/launch.py says how); the reply
    comes once run.json exists. A launch that fails before that leaves no run directory,
    no lock, and `current` as it was."""

    VERB = "launch"
    run_id: str
    run_dir: str
    pid: int  # the trainer's
    pgid: int
    release_id: str


@dataclasses.dataclass(frozen=True)
class LaunchCheckReply(Reply):
    """`launch --check-only`: every check a launch makes passed (the preflight, the run id
    free, no live holder of a resource unless --force); nothing was created or started.
    The CLI checks every host of a run this way before it starts any."""

    VERB = "launch"
    run_id: str
    checked: bool  # always true
    release_id: str
    master_port: Optional[int] = optional()  # with --master-port 0 or absent: a TCP port free here now


@dataclasses.dataclass(frozen=True)
class CorruptCheckpoint(Message):
    """A complete checkpoint whose files do not hold what its SHA256SUMS lists
    (dflash_agent/checkpoints.py): never resumed or restarted from."""

    step: int
    path: str  # its folder on the host
    problem: str  # the file and what is wrong with it, one line


@dataclasses.dataclass(frozen=True)
class ResumeReply(Reply):
    """`resume`: the next attempt of an ended run started from an intact checkpoint
    (dflash_agent/resume.py says when it is refused)."""

    VERB = "resume"
    run_id: str
    attempt: int  # the new attempt's number
    previous_state: RunState
    step: int  # the checkpoint's step
    checkpoint: str  # its folder on the host ("rank0" for a rank > 0, which takes rank 0's)
    pid: int
    release_id: str  # the release the attempt runs
    previous_release_id: Optional[str]  # the release the run had
    release: str  # "run" or "current", as asked
    # the newer checkpoints found corrupt and passed over, newest first (none: left out)
    corrupt: Optional[Tuple[CorruptCheckpoint, ...]] = optional()


@dataclasses.dataclass(frozen=True)
class ResumeCheckReply(Reply):
    """`resume --check-only`: every check a resume makes passed, the resources' locks
    included; nothing was started."""

    VERB = "resume"
    run_id: str
    checked: bool  # always true
    attempt: int
    previous_state: RunState
    step: int
    checkpoint: str
    master_port: Optional[int] = optional()  # with --master-port 0: a TCP port free here now
    corrupt: Optional[Tuple[CorruptCheckpoint, ...]] = optional()  # as ResumeReply's


# -- a run's state, report and stacks -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunStatus(Message):
    """One run as `status` sees it: its latest attempt's state and what explains it."""

    run_id: str
    name: Optional[str]
    state: RunState
    reason: Optional[str]  # why a FAILED, LOST or DEGRADED run failed, one line (docs/runs.md "Run states")
    pid: Optional[int]
    started_at: Optional[float]
    ended_at: Optional[float]  # exit.json's, or the trainer's `done` event's when no supervisor was left to write it
    exit: Optional[ExitRecord]  # exit.json
    errors: int  # the latest attempt's error records
    last_heartbeat: Optional[float]
    release_id: Optional[str]
    source: Optional[ReleaseSource]  # run.json's: where the release came from
    overrides: Tuple[str, ...]  # the `--set KEY=VALUE` the config was resolved with
    step: Optional[int]  # the latest attempt's last step
    startup: Optional[str]  # the start-up phase under way before the first step (its label)
    startup_elapsed_s: Optional[float]  # how long it has been under way
    # The latest attempt's first PeerFailed record's detail {peer_rank, peer_exc_type,
    # peer_message}: this rank stopped for that peer.
    peer_failure: Optional[PeerFailure]
    attempt: int
    attempts: int  # how many
    resume_step: Optional[int]  # the checkpoint step the latest attempt started from
    # The newest complete checkpoint's step; the newest intact one's where the
    # checkpoints were verified (`corrupt_checkpoints` is there).
    checkpoint_step: Optional[int]
    export: Optional[str] = optional()  # the run's export folder on the host (absolute), once the trainer wrote it
    config: Optional[str] = optional()  # with --config: config.yaml's text as launched
    # With --run-id, for a run that ended: its checkpoints newer than the newest intact
    # one, found corrupt (newest first; [] when the newest is intact). Left out where the
    # checkpoints were not verified (a live run, the listing of every run).
    corrupt_checkpoints: Optional[Tuple[CorruptCheckpoint, ...]] = optional()


@dataclasses.dataclass(frozen=True)
class UnreadableRun(Message):
    """A run whose run.json is no run.json (cut short, spoiled, a key missing): named instead of listed."""

    run_id: str
    path: str  # its run.json
    error: str  # what is wrong with it


@dataclasses.dataclass(frozen=True)
class StatusReply(Reply):
    """`status`: one run (--run-id), or every run of the host, newest first; --config (with
    --run-id only, else kind usage) adds each RunStatus's config. A run whose run.json
    cannot be read is, with --run-id, an error of kind host naming the file; in the list,
    one of `unreadable`, the others listed all the same."""

    VERB = "status"
    runs: Tuple[RunStatus, ...]
    unreadable: Optional[Tuple[UnreadableRun, ...]] = optional()  # by run id; left out when there is none


@dataclasses.dataclass(frozen=True)
class StopReply(Reply):
    """`stop`: stop_requested.json written (which also ends a restart policy's
    restarting), SIGTERM to the trainer's process group, SIGKILL after --grace (and so for
    an attempt a restart started meanwhile); the reply comes once no process of the group
    is left and exit.json exists (or no supervisor is left to write it: STOPPED all the
    same)."""

    VERB = "stop"
    run_id: str
    state: RunState
    killed: bool  # it took SIGKILL


@dataclasses.dataclass(frozen=True)
class StacksReply(Reply):
    """`stacks`: a header line appended to faulthandler.log, SIGUSR1 to the trainer, whose
    faulthandler dumps every thread there. Refused (conflict) when the trainer is not
    running or has no SIGUSR1 handler yet (the default action would kill it)."""

    VERB = "stacks"
    run_id: str
    text: str  # the new dump, threads named from threads.json: "Thread 0x… [drafter-1] (most recent call first):"


@dataclasses.dataclass(frozen=True)
class ReportReply(Reply):
    """`report`: everything fetch-traceback needs. Both stack texts have their threads named."""

    VERB = "report"
    run_id: str
    state: RunState
    run: RunRecord
    exit: Optional[ExitRecord]  # exit.json
    errors: Tuple[ErrorRecord, ...]  # every errors.jsonl record; a line that is no record as {"raw": text}
    faulthandler: str  # faulthandler.log's last 4 MiB
    last_stacks: str  # its newest dump
    log_tail: str  # the last --log-lines lines of train.log
    agent_error: Optional[str]  # the latest supervisor's last error in agent.log


# -- GPUs and host facts ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Gpu(Message):
    """One row of nvidia-smi (dflash_agent/gpus.py); a value it does not report is None."""

    index: Optional[int]
    name: Optional[str]
    memory_used_mib: Optional[float]
    memory_total_mib: Optional[float]
    utilization_pct: Optional[float]
    temperature_c: Optional[float]
    power_w: Optional[float]


@dataclasses.dataclass(frozen=True)
class GpuProcess(Message):
    """A compute process holding memory on a GPU (nvidia-smi --query-compute-apps); a
    value it does not report is None."""

    gpu: Optional[int]  # its GPU's index
    pid: Optional[int]  # as the host's (or the container's) PID namespace sees it
    name: Optional[str]  # nvidia-smi's process_name: its executable
    used_mib: Optional[float]


@dataclasses.dataclass(frozen=True)
class GpusReply(Reply):
    """`gpus`: no GPU without nvidia-smi."""

    VERB = "gpus"
    gpus: Tuple[Gpu, ...]
    problem: Optional[str] = optional()  # nvidia-smi exists but failed


@dataclasses.dataclass(frozen=True)
class HostFacts(Message):
    """What gpus.py says of a host's Python, packages, GPUs and release."""

    python: str  # its version
    python_executable: str
    platform: str
    hostname: str
    packages: Dict[str, Optional[str]]  # torch, transformers: the version found, or None
    gpus: Tuple[Gpu, ...]
    current_release: Optional[str]


@dataclasses.dataclass(frozen=True)
class InfoReply(HostFacts, Reply):
    """`info`."""

    VERB = "info"
    boot_id: Optional[str]
    gpus_problem: Optional[str] = optional()  # as GpusReply's problem


@dataclasses.dataclass(frozen=True)
class HostProbe(HostFacts):
    """What gpus.py answers run as a script (`dflash hosts --check` sends it with `python
    -c`): the host's facts and what a child interpreter importing the trainer's packages
    finds."""

    imports: Dict[str, Any]  # {"torch": version, "transformers": version, "cuda_devices": n}, or {"error": why}
    gpus_problem: Optional[str] = optional()

    @classmethod
    def describe(cls) -> str:
        return "gpus.py's host facts"


@dataclasses.dataclass(frozen=True)
class FitFacts(Message):
    """What gpus.fit_facts answers in host_check.py's HostCheck (`dflash launch`, before
    its deploy, docs/fit-check.md):
    the GPUs, the processes holding memory on them, and PATH's config.json, PATH an absolute or ~ model folder, or a hub id found
    in the host's Hugging Face cache (gpus.hub_file), looked up with the --env pairs (the
    inventory's env) applied, as the trainer gets them."""

    gpus: Tuple[Gpu, ...]
    target: Optional[Dict[str, Any]]  # config.json's fields; None without --model or when not found
    problem: Optional[str] = optional()  # as GpusReply's problem
    # The compute processes holding memory on the GPUs (none listed without GPUs), and
    # why nvidia-smi could not list them
    processes: Optional[Tuple[GpuProcess, ...]] = optional()
    processes_problem: Optional[str] = optional()
    target_source: Optional[str] = optional()  # the config.json read
    target_problem: Optional[str] = optional()  # why none was read

    @classmethod
    def describe(cls) -> str:
        return "gpus.fit_facts answer"


@dataclasses.dataclass(frozen=True)
class PreflightVerdict(Message):
    """One of the `launch` verb's preflight checks (preflight.problems) as a host made it."""

    check: str  # what was checked: "free space in WS", "data.train /data/x.jsonl", "PYTHON imports torch, ..."
    problem: Optional[str]  # None: it passed


@dataclasses.dataclass(frozen=True)
class SetupAnswer(Message):
    """The last line `dflash setup`'s host script prints (dflash_cli/host_scripts/
    host_setup.py, docs/hosts.md): the environment it left in use, or where it failed."""

    status: str  # unchanged, switched, installed, or FAILED
    env: Optional[str]  # the environment in use (a failure's: None when the host has none yet)
    key: Optional[str] = optional()  # the environment's key
    torch_index: Optional[str] = optional()  # the PyTorch index it installed from, or "pip"
    previous: Optional[str] = optional()  # the environment in use before a switch
    step: Optional[str] = optional()  # a failure's: lock, driver, venv, torch, requirements, setup
    error: Optional[str] = optional()  # a failure's message

    FAILED = "failed"

    @classmethod
    def describe(cls) -> str:
        return "host setup answer"


@dataclasses.dataclass(frozen=True)
class HostCheck(Message):
    """What host_check.py answers (`dflash launch` sends it with `python -c` before its
    deploy, and `launch --dry-run` for its verdicts): the fit check's facts and every
    preflight verdict."""

    fit: FitFacts
    checks: Tuple[PreflightVerdict, ...]

    @classmethod
    def describe(cls) -> str:
        return "host_check.py answer"


# -- pull and compile artifacts ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ArtifactFile(Message):
    path: str  # inside its folder, "/"-separated
    size: int
    sha256: str  # from the folder's SHA256SUMS, else computed now
    identity: str  # "dev:inode:size:mtime_ns": what send-file checks before it sends a byte


@dataclasses.dataclass(frozen=True)
class ArtifactFolder(Message):
    folder: str  # "export" or "checkpoints/step_000100"
    files: Tuple[ArtifactFile, ...]  # regular files, sorted by path, SHA256SUMS included
    hashed_on_host: Tuple[str, ...]  # the paths SHA256SUMS did not list, hashed for this reply


@dataclasses.dataclass(frozen=True)
class ArtifactsReply(Reply):
    """`artifacts`: what `dflash pull` fetches, export/ and with --checkpoint the step folder
    checkpoints/latest names now, each read through one open descriptor of the folder so
    the listing is of one version even while the trainer replaces it. A run without
    export/ (or checkpoint) -> not_found, naming the run's state; a `latest` that is not a
    link to a step folder's name, or a listed folder that is a link -> host. `send-file`
    then sends a listed file's bytes."""

    VERB = "artifacts"
    run_id: str
    state: RunState
    folders: Tuple[ArtifactFolder, ...]


@dataclasses.dataclass(frozen=True)
class CompileArtifact(Message):
    """One key's portable compile artifacts, as its manifest (artifacts.json) lists them."""

    key: str
    facts: Optional[Dict[str, Any]]  # {gpu, torch, triton, cuda, python}: what makes the key
    size: int
    sha256: Optional[str]
    torch: Optional[str]
    saved_at: Optional[float]

    def manifest(self) -> Dict[str, Any]:
        """The manifest `receive-compile-artifacts --manifest-json` stores with the bytes."""
        return {name: value for name, value in self.to_json().items() if name != "key"}


@dataclasses.dataclass(frozen=True)
class CompileArtifactsReply(Reply):
    """`compile-artifacts`: the workspace's compile cache (cache/compile/<key>/), sorted by
    key; a key whose manifest is unreadable or names another size than its artifacts.bin
    is left out. `send-compile-artifacts` then sends a key's bytes."""

    VERB = "compile-artifacts"
    cpu: Optional[str]  # /proc/cpuinfo's model name
    artifacts: Tuple[CompileArtifact, ...]
    gpus: Tuple[str, ...]  # the host's GPU names


@dataclasses.dataclass(frozen=True)
class ReceiveCompileArtifactsReply(Reply):
    """`receive-compile-artifacts`: the bytes on stdin stored as the key's artifacts, all
    or nothing, checked against the manifest (usage when its facts do not make the key or
    the bytes do not match it; conflict when the key's key.json holds other facts)."""

    VERB = "receive-compile-artifacts"
    key: str
    size: int
    sha256: str
    received: bool  # always true


# -- releases -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ReleaseFilesReply(Reply):
    """`release-files`: what `dflash diff` and `runs` compare releases with. Only paths
    MANIFEST lists (else usage); a release not in releases/ -> not_found."""

    VERB = "release-files"
    release_id: str
    manifest: str  # releases/ID/MANIFEST's text
    files: Dict[str, str]  # path -> base64 of its bytes
    too_large: Tuple[str, ...]  # paths over 8 MiB, not sent


@dataclasses.dataclass(frozen=True)
class RunConfigReply(Reply):
    """`run-config`."""

    VERB = "run-config"
    run_id: str
    config: str  # runs/ID/config.yaml's text


@dataclasses.dataclass(frozen=True)
class RemovedRelease(Message):
    release_id: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class KeptRelease(Message):
    release_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class GcReply(Reply):
    """`gc`: releases/<id> folders that are not `current` and that no runs/*/run.json
    names, beyond the --keep newest (mtime) of them, removed, under .deploy.lock (taken
    without waiting: a deploy installing -> conflict)."""

    VERB = "gc"
    removed: Tuple[RemovedRelease, ...]
    kept: Tuple[KeptRelease, ...]
    freed_bytes: int
