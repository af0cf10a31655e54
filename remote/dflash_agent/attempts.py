"""Attempts of a run (docs/runs.md "Attempts"): one run id, several trainer processes in turn.

A run's first attempt (0) is its launch; each `resume` verb (by hand) or restart (by the
supervisor, under the run's `restart` policy) starts the next one from a checkpoint of
the run. run.json's top-level fields (pid, pgid, start_time, supervisor, started_at,
release) are always those of the latest attempt, and `attempts` lists them all, each
ended one with how it ended; exit.json and stop_requested.json are the latest attempt's
only, errors.jsonl records carry their `attempt`, and events.jsonl and train.log go on
across attempts after a marker line. So the state (state.py) is that of the latest
attempt with nothing else to know.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import List, Optional, Tuple

from dflash_contract.events import ATTEMPT
from dflash_contract.records import AttemptEntry, ErrorRecord, ExitRecord, RestartPolicy, RunRecord
from dflash_contract.states import RunState
from dflash_files.checkpoint_files import CHECKPOINT_FILES, CHECKPOINTS_DIR, STEP_FOLDER
from dflash_files.diskspace import NO_SPACE

from .jsonio import encode_line
from .layout import RunDir


def checkpoint_folders(run: RunDir) -> List[Tuple[int, str]]:
    """(step, folder) of every complete checkpoint of the run, oldest first. Staging
    folders (`.step_…-XXXX`) and folders missing a file are not checkpoints."""
    root = run.file(CHECKPOINTS_DIR)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = STEP_FOLDER.match(name)
        folder = os.path.join(root, name)
        if match and all(os.path.isfile(os.path.join(folder, f)) for f in CHECKPOINT_FILES):
            found.append((int(match.group(1)), folder))
    return sorted(found)


def newest_checkpoint(run: RunDir) -> Optional[Tuple[int, str]]:
    folders = checkpoint_folders(run)
    return folders[-1] if folders else None


def history(record: RunRecord) -> List[AttemptEntry]:
    """run.json's `attempts`; one entry made from the top-level fields for a run.json
    written before attempts existed."""
    if record.attempts:
        return list(record.attempts)
    return [AttemptEntry(attempt=0, reason="launch", started_at=record.started_at, pid=record.pid,
                         release_id=record.release_id, resume_from=None)]


def failed_step(errors: List[ErrorRecord], last_step: Optional[int]) -> Optional[int]:
    """Where an attempt failed: its root cause's step, else the last step it reported."""
    for record in errors:
        if record.step is not None:
            return record.step
    return last_step


def closed(entry: AttemptEntry, exit_record: Optional[ExitRecord], state: RunState,
           step: Optional[int]) -> AttemptEntry:
    """An attempt's entry once it ended: how (exit.json or null), its state, and the step
    it ended at (for a failure: its root cause's step, `failed_step`)."""
    ended_at = (exit_record.ended_at if exit_record else None) or time.time()
    return dataclasses.replace(entry, exit=exit_record, state=state, step=step, ended_at=ended_at)


def append_markers(run: RunDir, attempt: int, reason: str, resume_step: Optional[int],
                   release_id: str) -> None:
    """The boundary of a new attempt in events.jsonl and train.log: both go on, never
    rewritten. state.summarize_events stops at the events marker, so nothing an earlier
    attempt wrote (its `done`, its heartbeats) counts for the new one."""
    now = time.time()
    event = ATTEMPT.record(now, {"attempt": attempt, "reason": reason, "resume_step": resume_step,
                                 "release_id": release_id})
    _append(run.events, encode_line(event))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + ".%03d" % (int(now * 1000) % 1000)
    start = "from its checkpoint at step %d" % resume_step if resume_step is not None else "from the start"
    line = "%s [supervisor] === attempt %d (%s): %s, release %s ===\n" % (stamp, attempt, reason, start, release_id)
    _append(run.train_log, line.encode("utf-8"))


def log_line(run: RunDir, text: str) -> None:
    """One supervisor line in train.log, where `watch` shows it; none on a full disk,
    which must not keep the supervisor from writing exit.json."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    try:
        _append(run.train_log, ("%s.000 [supervisor] %s\n" % (stamp, text)).encode("utf-8"))
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise


def _append(path: str, data: bytes) -> None:
    """Append whole lines. A trainer killed in the middle of a line left it without its
    newline: one goes first, or the marker would be glued to that torn line and lost."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def clear_ended_attempt(run: RunDir) -> None:
    """exit.json and stop_requested.json are the latest attempt's: once a new attempt's
    run.json is written (its entry in `attempts` keeps them), they go."""
    for path in (run.exit_json, run.stop_requested):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# The restart policy (config `restart:`), applied by the supervisor when an attempt ends.

def restart_cause(exit_record: ExitRecord, errors: List[ErrorRecord]) -> Optional[str]:
    """"failure" (an error record, or a non-zero exit), "killed" (a signal, no record),
    or None for a clean exit."""
    if errors:
        return "failure"
    if exit_record.signal:
        return "killed"
    return "failure" if exit_record.exit_code != 0 else None


def restart_refusal(policy: Optional[RestartPolicy], attempts: List[AttemptEntry], cause: Optional[str],
                    step: Optional[int], stop_requested: bool) -> Optional[str]:
    """Why the attempt that just ended (the last of `attempts`, not yet closed) is not
    restarted, or None when it is. Restarts count since the last attempt started by a
    person (the launch or a `resume`), so a resume by hand renews the budget."""
    if cause is None:
        return "it succeeded"
    if stop_requested:
        return "it was stopped"
    if not policy or not policy.max:
        return "the config sets no restart"
    if cause not in policy.on:
        return "restart.on does not name %r" % cause
    if restarts_in_a_row(attempts) >= policy.max:
        return "restart.max (%d) reached" % policy.max
    previous = attempts[-2] if len(attempts) > 1 else None
    if (previous is not None and step is not None and previous.state is not None and previous.state.failed
            and previous.step == step):
        return "it failed at step %d twice in a row: a restart would fail there again" % step
    return None


def backoff(policy: RestartPolicy, attempts: List[AttemptEntry]) -> float:
    """backoff_s before the first restart, doubled before each next one."""
    return float(policy.backoff_s) * (2 ** restarts_in_a_row(attempts))


def restarts_in_a_row(attempts: List[AttemptEntry]) -> int:
    count = 0
    for entry in reversed(attempts):
        if entry.reason != "restart":
            break
        count += 1
    return count
