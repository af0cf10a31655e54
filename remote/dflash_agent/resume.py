"""The `resume` verb: the next attempt of a run that ended (stopped, failed, lost), from
a complete checkpoint of its own, with its config and its release (or the host's current
one), under the same run id (attempts.py).

Refused, with nothing changed, under a per-run lock: kind "conflict" while the run is
live, when it succeeded (unless --step names the checkpoint to train again from), when
the --step checkpoint is corrupt, or when the checkpoint does not fit the config as the
chosen release's trainer reads it (`python -m dflash_train.resume_check`); kind
"not_found" when it has no complete checkpoint (or not the --step asked for), none
intact, or its release is gone. Without --step it starts from the newest intact
checkpoint, every byte checked against its SHA256SUMS (checkpoints.py), and the reply
names the newer ones found corrupt. The step is explicit in the request, so several
hosts' runs can be resumed from one common step. What a new attempt changes in the run
directory: docs/runs.md "Attempts: resume and restart".

A part of a run on several hosts resumes only with its place in the run (--rank and
--world-size, which must be run.json's `distributed`; --master-addr defaults to the
launch's; the CLI's `dflash resume` sends every host's): rank 0 must hold the
checkpoint at --step and checks that it fits; a host of rank > 0 needs --step and no
checkpoint, its trainer takes rank 0's. --check-only checks all of that and the
resources' locks and starts nothing (replies.ResumeCheckReply); on rank 0 it also
picks a free rendezvous port, as launch does.
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
import shlex
import subprocess
from typing import Optional, Tuple, Union


from dflash_contract.records import RunRecord, attempt_errors
from dflash_contract.replies import CorruptCheckpoint, ResumeCheckReply, ResumeReply
from dflash_contract.states import RunState

from . import attempts, checkpoints, locks, preflight
from .jsonio import AgentError
from .launch import Distributed, free_port, start_supervisor, trainer_env
from .layout import RunDir, Workspace
from .state import derive_state, error_records, observe, read_record, summarize_events
from .supervisor import TrainerPlan

CHECK_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class ResumeRequest:
    run_id: str
    release: str = "run"  # "run": the run's own release; "current": the host's current one
    step: Optional[int] = None  # the checkpoint step; None: the newest complete one
    env: Tuple[Tuple[str, str], ...] = ()  # the host's settings, as at launch (values are not recorded)
    modules: Tuple[str, ...] = ()  # the trainer's interpreter must find these
    distributed: Optional[Distributed] = None  # this host's place, for a part of a run on several hosts
    check_only: bool = False  # check what a resume would, start nothing (several hosts)


# What a trainer of rank > 0 is given as --resume-from: it reads no checkpoint itself but
# takes rank 0's over the process group (dflash_train.jobs.startup.resume_point).
FROM_RANK0 = "rank0"


def resume(ws: Workspace, request: ResumeRequest) -> Union[ResumeReply, ResumeCheckReply]:
    run = ws.existing_run(request.run_id)
    # One resume of a run at a time: the second would find it STARTING anyway, but only
    # once the first has written run.json.
    fd = os.open(run.file(".resume.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentError("run %r is being resumed by another command" % run.run_id, "conflict")
        return _resume_locked(ws, run, request)
    finally:
        os.close(fd)


def _resume_locked(ws: Workspace, run: RunDir,
                   request: ResumeRequest) -> Union[ResumeReply, ResumeCheckReply]:
    record = read_record(run)
    obs = observe(run, record)
    state = derive_state(obs)
    if not state.terminal:
        raise AgentError("run %r is still live (%s): stop it first (dflash stop), or wait for it to end"
                         % (run.run_id, state), "conflict", state=state)
    distributed = _place(run, record, request)
    if state == RunState.SUCCEEDED and request.step is None:
        raise _finished(run, obs.events.step)
    corrupt = ()  # type: Tuple[CorruptCheckpoint, ...]
    if distributed is None or distributed.rank == 0:
        checkpoint, corrupt = _checkpoint(run, request.step, state)
    elif request.step is None:
        raise AgentError("--step is required for rank %d: the step is rank 0's checkpoint" % distributed.rank, "usage")
    else:
        checkpoint = (request.step, FROM_RANK0)
    release_id, release_root = _release(ws, record, request.release)
    python = (record.argv or (None,))[0] or "python3"
    env = trainer_env(ws, run, release_id, release_root, request.env, distributed)
    preflight.check(ws.root, release_root, python, env, request.modules, ())
    if checkpoint[1] != FROM_RANK0:
        _check_fit(python, env, run, checkpoint)
    resources = record.resources
    attempt = record.attempt_number
    if request.check_only:
        locks.check_free(ws, resources, False)
        picks_port = distributed is not None and distributed.master_port == 0
        return ResumeCheckReply(run_id=run.run_id, checked=True, attempt=attempt + 1, previous_state=state,
                                step=checkpoint[0], checkpoint=checkpoint[1],
                                master_port=free_port() if picks_port else None, corrupt=corrupt or None)
    locks.acquire(ws, resources, run.run_id, force=False)
    errors = attempt_errors(error_records(run.errors), attempt)
    history = attempts.history(record)
    ended = attempts.closed(history[-1], obs.exit, state,
                            attempts.failed_step(errors, summarize_events(run.events).step))
    plan = TrainerPlan(
        workspace=ws, run=run, name=record.name, release_id=release_id, release_root=release_root,
        config_source=record.config_source or run.config, python=python, env=env,
        env_keys=tuple(key for key, _ in request.env), resources=resources,
        stall_after=float(record.stall_after),
        startup_stall_after=float(record.startup_stall_after or 300.0),
        source=record.source if release_id == record.release_id else None,
        overrides=record.overrides or (), restart=record.restart, attempt=attempt + 1, reason="resume", resume_from=checkpoint,
        history=tuple(history[:-1]) + (ended,), distributed=distributed.record() if distributed else None)
    try:
        report = start_supervisor(plan)
    except BaseException:
        if still_recorded(run, record):  # nothing started: the locks are ours to drop
            locks.release(ws, resources, run.run_id)
        raise
    return ResumeReply(run_id=run.run_id, attempt=attempt + 1, previous_state=state, step=checkpoint[0],
                       checkpoint=checkpoint[1], pid=report.pid, release_id=release_id,
                       previous_release_id=record.release_id, release=request.release,
                       corrupt=corrupt or None)


def still_recorded(run: RunDir, record: RunRecord) -> bool:
    """Whether run.json still holds `record`: no supervisor wrote a new attempt's. Compared
    as records, so a run.json an older release wrote (a key it lacks, which this release
    writes as null) compares equal to itself."""
    try:
        return read_record(run) == record
    except (OSError, AgentError):  # gone or spoiled since: whose it is cannot be told
        return False


def _place(run: RunDir, record: RunRecord, request: ResumeRequest) -> Optional[Distributed]:
    """This host's place in the resumed run: the request's, which must be the one run.json
    records (the rendezvous address defaults to the launch's; the port is new)."""
    recorded = record.distributed
    given = request.distributed
    if recorded and given is None:
        # Only rank 0's host holds the checkpoints, and every host's trainer must start
        # again together: resuming one host's part alone would wait for peers that ended.
        raise AgentError("run %r is one part of a run on several hosts (%s): resume it on all of them "
                         "together (dflash resume %s)" % (run.run_id, ", ".join(recorded.hosts or ()),
                                                          run.run_id), "conflict")
    if given is None:
        return None
    if not recorded:
        raise AgentError("run %r runs on this host alone: resume it without --rank" % run.run_id, "usage")
    if not given.master_addr:
        given = dataclasses.replace(given, master_addr=recorded.master_addr)
    if not given.hosts:
        given = dataclasses.replace(given, hosts=recorded.hosts or ())
    given.check(request.check_only)
    if (given.rank, given.world_size) != (recorded.rank, recorded.world_size):
        raise AgentError("run %r is rank %s of %s here, not rank %d of %d" % (
            run.run_id, recorded.rank, recorded.world_size, given.rank, given.world_size), "conflict")
    return given


def _finished(run: RunDir, step: Optional[int]) -> AgentError:
    """A run that succeeded has nothing to resume: a new attempt would train nothing.
    Training again from an earlier checkpoint is asked for by its step."""
    steps = [found for found, _ in attempts.checkpoint_folders(run)]
    at = "" if step is None else " at step %d" % step
    error = AgentError("run %r succeeded%s; nothing to resume" % (run.run_id, at), "conflict", state=RunState.SUCCEEDED)
    if steps:
        error.extra["hint"] = ("to train again from one of its checkpoints (steps %s): dflash resume %s --step N"
                               % (", ".join(map(str, steps)), shlex.quote(run.run_id)))
    return error


def _checkpoint(run: RunDir, step: Optional[int],
                state: RunState) -> Tuple[Tuple[int, str], Tuple[CorruptCheckpoint, ...]]:
    """The checkpoint to start from (the --step one, else the newest intact one) and the
    newer ones passed over as corrupt."""
    if not attempts.checkpoint_folders(run):
        raise AgentError("run %r (%s) has no complete checkpoint to resume from: it ended before its first "
                         "one (checkpoint.every, checkpoint.every_minutes); launch it anew"
                         % (run.run_id, state), "not_found", state=state)
    if step is not None:
        return checkpoints.at_step(run, step), ()
    pick = checkpoints.newest_intact(run)
    if pick.checkpoint is None:
        raise AgentError(checkpoints.none_intact(run, pick.corrupt) + "; launch it anew", "not_found", state=state)
    return pick.checkpoint, pick.corrupt


def _release(ws: Workspace, record: RunRecord, which: str) -> Tuple[str, str]:
    if which == "current":
        return ws.current_release()
    root = record.release_dir
    if not os.path.isfile(os.path.join(root, "MANIFEST")):
        raise AgentError("the run's release %s is no longer in %s; resume with --release current"
                         % (record.release_id, root), "not_found")
    return record.release_id, root


def _check_fit(python: str, env: Tuple[Tuple[str, str], ...], run: RunDir, checkpoint: Tuple[int, str]) -> None:
    """The chosen release's trainer says whether the checkpoint fits the run's config."""
    argv = [python, "-m", "dflash_train.resume_check", "--config", run.config, "--checkpoint", checkpoint[1]]
    try:
        done = subprocess.run(argv, env=dict(env), cwd=run.path, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=CHECK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AgentError("cannot check checkpoint %s against the config: %s" % (checkpoint[1], exc), "host")
    if done.returncode != 0:
        said = (done.stdout or done.stderr).decode("utf-8", "replace").strip()
        raise AgentError("run %r cannot resume from %s: %s" % (run.run_id, checkpoint[1], said[-2000:]),
                         "conflict")
