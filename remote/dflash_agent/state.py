"""Run states (dflash_contract.states.RunState, docs/runs.md "Run states").

`observe` gathers the facts from the run directory and /proc; `derive_state` is the one
pure function that turns them into a state. Nothing here reads a whole log: the last
events are found by reading events.jsonl backwards.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Dict, List, Optional

from dflash_contract.checker import ProtocolError
from dflash_contract.records import ErrorRecord, ExitRecord, PeerFailure, RunRecord, attempt_errors, parse_json_line
from dflash_contract.replies import RunStatus
from dflash_contract.states import RunState
from dflash_contract.events import ATTEMPT, DONE, HEARTBEAT, PHASE, STARTUP, STEP, TS, TYPE, TYPES, JobPhase, StartupState

from dflash_files import procfs
from . import checkpoints
from dflash_files.checkpoint_files import EXPORT_DIR
from .attempts import newest_checkpoint
from .jsonio import AgentError, decode_bytes, lines_backwards, read_json, read_tail_text
from .layout import RunDir

# Liveness of the trainer process, as far as /proc and the supervisor can tell.
ALIVE = "alive"
ENDING = "ending"  # the trainer exited; its supervisor lives and is about to write exit.json
GONE = "gone"  # exited (or pid reused, or host rebooted) and no supervisor will report it

# Event types that show the pipeline moving (events.jsonl, written by the trainer); both
# carry the step reached.
PROGRESS_TYPES = (HEARTBEAT.name, STEP.name)
# A supervisor's own error in agent.log (supervisor.log_error): its pid, then the message.
_AGENT_ERROR = re.compile(r"^\S+ supervisor\[(\d+)\]: error: (.*)$")
AGENT_LOG_TAIL_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class EventSummary:
    """What the end of events.jsonl says."""
    last_event_ts: Optional[float] = None  # any event
    last_phase: Optional[str] = None  # the newest "phase" event, if newer than any progress
    last_phase_ts: Optional[float] = None
    last_heartbeat: Optional[float] = None  # ts of the newest heartbeat or step event
    step: Optional[int] = None  # its step
    # The trainer's own record of its outcome, the last thing it writes before exiting
    # (a DONE event). It tells how a run ended whose supervisor died before it could
    # write exit.json.
    done: Optional[Dict[str, Any]] = None
    # The start-up phase under way (its `startup` event's label, state "started" or
    # "alive"), when the newest start-up event says one is; None once it ended or a step
    # happened.
    startup: Optional[str] = None
    startup_since: Optional[float] = None  # when that phase began (ts)


@dataclasses.dataclass(frozen=True)
class Observation:
    started_at: float
    stall_after: float
    now: float
    trainer: str  # ALIVE | ENDING | GONE
    startup_stall_after: float = 300.0
    exit: Optional[ExitRecord] = None
    error_count: int = 0
    stop_requested: bool = False
    events: EventSummary = EventSummary()
    # The trainer process is stopped (SIGSTOP, a debugger): alive, and certainly not
    # making progress, whatever its last heartbeat says.
    frozen: bool = False
    # The detail of the attempt's first PeerFailed record {peer_rank, peer_exc_type,
    # peer_message}: this rank stopped because of that one (RunStatus `peer_failure`).
    peer_failure: Optional[PeerFailure] = None


def derive_state(obs: Observation) -> RunState:
    if obs.exit is not None:
        if obs.stop_requested:
            return RunState.STOPPED
        # A worker that failed while the process still exited 0 is not a success.
        clean = obs.exit.exit_code == 0 and not obs.exit.signal
        return RunState.SUCCEEDED if clean and obs.error_count == 0 else RunState.FAILED
    if obs.trainer == GONE:
        # No process is left and the supervisor wrote no exit.json (it was killed, or the
        # host rebooted): what the run itself recorded decides. LOST only when nobody
        # recorded anything.
        if obs.stop_requested:
            return RunState.STOPPED
        done = obs.events.done
        if done is not None:
            return RunState.SUCCEEDED if done.get(DONE.exit_code) == 0 and obs.error_count == 0 else RunState.FAILED
        return RunState.FAILED if obs.error_count else RunState.LOST
    if obs.frozen:
        return RunState.STALLED
    if obs.error_count:
        return RunState.DEGRADED
    ev = obs.events
    starting = ev.last_heartbeat is None and ev.last_phase in (None, JobPhase.STARTUP)
    if starting:
        # Start-up emits no heartbeats, but its phases' events and, while its threads
        # work (a long compile, a slow load), an `alive` event every few seconds: it
        # counts as stalled once neither the launch nor any event is recent.
        clock, limit = max(obs.started_at, ev.last_event_ts or 0.0), obs.startup_stall_after
    else:
        clock, limit = max(ev.last_heartbeat or 0.0, ev.last_phase_ts or 0.0), obs.stall_after
    if obs.now - clock > limit:
        return RunState.STALLED
    return RunState.STARTING if starting else RunState.RUNNING


def summarize_events(path: str) -> EventSummary:
    """Read events.jsonl backwards until the newest heartbeat/step event, or the marker
    of the latest attempt (attempts.py): what earlier attempts wrote is not this one's."""
    last_event_ts = last_phase = last_phase_ts = done = None
    startup = None  # type: Optional[Dict[str, Any]]
    for line in lines_backwards(path):
        event = parse_json_line(line)
        if not isinstance(event, dict):
            continue
        ts = event.get(TS)
        if last_event_ts is None:
            last_event_ts = ts
        kind = event.get(TYPE)
        if kind == ATTEMPT.name:
            break
        if kind == PHASE.name and last_phase is None:
            last_phase, last_phase_ts = event.get(PHASE.phase), ts
        if kind == DONE.name and done is None:
            done = event
        if kind == STARTUP.name and startup is None:
            startup = event
        if kind in PROGRESS_TYPES:
            return EventSummary(last_event_ts, last_phase, last_phase_ts, ts, event.get(TYPES[kind].step), done)
    if startup is None or startup.get(STARTUP.state) not in StartupState.UNDER_WAY:  # alive: still at it
        return EventSummary(last_event_ts, last_phase, last_phase_ts, done=done)
    since = startup.get(TS, 0.0) - (startup.get(STARTUP.elapsed_s) or 0.0)
    return EventSummary(last_event_ts, last_phase, last_phase_ts, done=done, startup=startup.get(STARTUP.label),
                        startup_since=since)


def error_records(path: str) -> List[ErrorRecord]:
    """Every errors.jsonl record, oldest (the root cause) first. A line that is not a
    record is kept as {"raw": text} rather than dropped."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return []
    records = []
    for line in data.split(b"\n")[:-1]:
        if not line.strip():
            continue
        records.append(ErrorRecord.of_line(decode_bytes(line)))
    return records


def trainer_liveness(record: RunRecord) -> str:
    recorded_boot = record.boot_id
    current_boot = procfs.boot_id()
    if recorded_boot and current_boot and recorded_boot != current_boot:
        return GONE  # the host rebooted since the launch
    if procfs.identity_alive(record.pid, record.start_time):
        return ALIVE
    if procfs.identity_alive(record.supervisor.pid, record.supervisor.start_time):
        return ENDING
    return GONE


def is_frozen(record: RunRecord) -> bool:
    """Whether the trainer process is stopped by a signal or a tracer (state T or t)."""
    stat = procfs.read_stat(record.pid)
    return stat is not None and stat.start_time == record.start_time and stat.state in ("T", "t")


def read_exit(run: RunDir) -> Optional[ExitRecord]:
    """exit.json, or None before the supervisor wrote it."""
    written = read_json(run.exit_json)
    return None if written is None else ExitRecord.from_json(written)


def observe(run: RunDir, record: RunRecord) -> Observation:
    """The facts about a started run's latest attempt (record = its run.json)."""
    exit_record = read_exit(run)
    trainer = GONE
    if exit_record is None:
        trainer = trainer_liveness(record)
        if trainer == GONE:
            # The supervisor may have written exit.json and exited between our two looks.
            exit_record = read_exit(run)
    errors = attempt_errors(error_records(run.errors), record.attempt_number)
    return Observation(
        started_at=float(record.started_at),
        stall_after=float(record.stall_after),
        startup_stall_after=float(record.startup_stall_after or 300.0),
        now=time.time(),
        trainer=trainer,
        exit=exit_record,
        error_count=len(errors),
        stop_requested=os.path.exists(run.stop_requested),
        events=summarize_events(run.events),
        frozen=trainer == ALIVE and is_frozen(record),
        peer_failure=next((r.peer_failure() for r in errors if r.exc_type == ErrorRecord.PEER_FAILED), None),
    )


class UnreadableRecord(AgentError):
    """run.json is there but is no run.json (cut short, spoiled, a key missing): kind host, naming
    the file. The run cannot be shown, followed or resumed until it is repaired or
    removed; the host's other runs are not its concern."""

    def __init__(self, run: RunDir, problem: str):
        super().__init__("run %r: %s cannot be read (%s): the run cannot be shown, followed or resumed until "
                         "it is repaired or removed" % (run.run_id, run.run_json, problem), "host",
                         path=run.run_json)
        self.problem = problem


def read_record(run: RunDir) -> RunRecord:
    """run.json; FileNotFoundError when there is none, UnreadableRecord when it is not
    one (records.RunRecord, read strictly)."""
    try:
        record = read_json(run.run_json)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise UnreadableRecord(run, "%s: %s" % (type(exc).__name__, exc))
    if record is None:
        raise FileNotFoundError(run.run_json)
    if not isinstance(record, dict):
        raise UnreadableRecord(run, "a JSON %s, not an object" % type(record).__name__)
    try:
        return RunRecord.from_json(record)
    except ProtocolError as exc:
        raise UnreadableRecord(run, str(exc))


def agent_error(run: RunDir, record: RunRecord) -> Optional[str]:
    """The last error the latest attempt's supervisor wrote in agent.log, or None; read
    from the log's end (an earlier attempt's supervisor has another pid)."""
    pid = str(record.supervisor.pid)
    text = read_tail_text(run.agent_log, 1000, AGENT_LOG_TAIL_BYTES)
    for line in reversed(text.splitlines()):
        match = _AGENT_ERROR.match(line)
        if match and match.group(1) == pid:
            return match.group(2)
    return None


def failure_reason(run: RunDir, record: RunRecord, obs: Observation, state: RunState) -> Optional[str]:
    """Why a FAILED, LOST or DEGRADED run's latest attempt failed, in one line: its first
    error record (`exc_type: message`), else exit.json's `error`, else the kernel's OOM
    killer when exit.json says it ended the trainer, else a boot of the host since the
    attempt started (no exit.json), else its supervisor's last error in agent.log, else
    how exit.json says the trainer ended; None when nothing says, or for another state."""
    if not (state.failed or state is RunState.DEGRADED):
        return None
    errors = attempt_errors(error_records(run.errors), record.attempt_number)
    if errors:
        return errors[0].summary().splitlines()[0]  # never empty: error_records skips blank lines
    ended = obs.exit
    if ended is not None and ended.error:
        return ended.error
    if ended is not None and ended.oom_killed:
        return ("the kernel's OOM killer ended the trainer (%s): the host, or its container's limit, ran out of "
                "memory" % ended.signal)
    booted = _booted_since(record) if obs.exit is None else None
    if booted:
        return booted
    return agent_error(run, record) or _ended_by(ended)


def _booted_since(record: RunRecord) -> Optional[str]:
    """The host booted again since the attempt started (its boot id changed): every
    process of the run ended with it."""
    recorded, current = record.boot_id, procfs.boot_id()
    if not recorded or not current or recorded == current:
        return None
    return ("the host booted again since the run started (boot id %s then, %s now): its trainer ended with it"
            % (recorded, current))


def _ended_by(ended: Optional[ExitRecord]) -> Optional[str]:
    """How exit.json says the trainer ended, when it says it failed."""
    if ended is not None and ended.signal:
        return "the trainer was killed by %s" % ended.signal
    if ended is not None and ended.exit_code:
        return "the trainer exited with code %s" % ended.exit_code
    return None


def run_status(run: RunDir, with_config: bool = False, verify: bool = False) -> RunStatus:
    """The run's RunStatus; `with_config` adds run.json's config text; `verify`, for a run
    that ended, checks its checkpoints (checkpoints.py: a verdict is remembered per
    version of a folder's files), so that `checkpoint_step` is the newest intact one."""
    record = read_record(run)
    obs = observe(run, record)
    state = derive_state(obs)
    if verify and state.terminal:
        pick = checkpoints.newest_intact(run, remembered=True)
        checkpoint_step, corrupt = (pick.checkpoint[0] if pick.checkpoint else None), pick.corrupt
    else:
        checkpoint_step, corrupt = _newest_checkpoint_step(run), None
    return RunStatus(
        run_id=run.run_id,
        name=record.name,
        state=state,
        reason=failure_reason(run, record, obs, state),
        pid=record.pid,
        started_at=record.started_at,
        ended_at=_ended_at(obs),
        exit=obs.exit,
        errors=obs.error_count,
        last_heartbeat=obs.events.last_heartbeat,
        release_id=record.release_id,
        source=record.source,
        overrides=record.overrides or (),
        step=obs.events.step,
        startup=obs.events.startup,
        startup_elapsed_s=(None if obs.events.startup_since is None
                           else round(obs.now - obs.events.startup_since, 1)),
        peer_failure=obs.peer_failure,
        attempt=record.attempt_number,
        attempts=len(record.attempts or ()) or 1,
        resume_step=_resume_step(record),
        checkpoint_step=checkpoint_step,
        export=_export(run),
        config=record.config if with_config else None,
        corrupt_checkpoints=corrupt,
    )


def _resume_step(record: RunRecord) -> Optional[int]:
    """The checkpoint step the latest attempt started from (None: from the start)."""
    resume_from = record.attempts[-1].resume_from if record.attempts else None
    return resume_from.step if resume_from else None


def _export(run: RunDir) -> Optional[str]:
    """The export folder, once there: the trainer renames it into place whole."""
    path = run.file(EXPORT_DIR)
    return path if os.path.isdir(path) else None


def _newest_checkpoint_step(run: RunDir) -> Optional[int]:
    newest = newest_checkpoint(run)
    return newest[0] if newest else None


def _ended_at(obs: Observation) -> Optional[float]:
    if obs.exit is not None:
        return obs.exit.ended_at
    return obs.events.done.get("ts") if obs.events.done is not None and obs.trainer == GONE else None
