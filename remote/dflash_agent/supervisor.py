"""The supervisor: starts the trainer, records run.json before it runs and exit.json
after it ends, then releases the run's locks. Under the run's restart policy it starts
the next attempt from the newest intact checkpoint instead of writing exit.json (attempts.py).

The trainer is forked into a session of its own and runs `python -m dflash_train
--config runs/ID/config.yaml --run-dir runs/ID` (TrainerPlan.argv) with cwd runs/ID,
stdout+stderr appended to train.log and the environment launch.trainer_env makes
(PYTHONPATH=<release>/remote, PYTHONUNBUFFERED, PYTHONDONTWRITEBYTECODE, DFLASH_RUN_ID,
DFLASH_RELEASE_ID, DFLASH_RELEASE_DIR, DFLASH_WORKSPACE, then the --env pairs) plus
DFLASH_ATTEMPT; it execs only once run.json is written (docs/layout.md
lists run.json's and exit.json's fields). An exec that fails writes exit_code 127,
exec_error says why and train.log holds it. The host's warm interpreter (warm.py), when
there is one, forks that same trainer instead of the exec; whatever keeps it from doing
so is said in agent.log and run.json (`started_by`, `warm_reason`) and the trainer is
exec'd.

It runs detached (launch.py daemonizes it): stdin /dev/null, stdout+stderr appended to
runs/ID/agent.log, no descriptor of the caller left open. Its own failures are lines
`supervisor[PID]: error: …` there (`log_error`), which `status` shows when nothing else
says why a run ended. exit.json has a reserve (dflash_files/diskspace.py), so that it is
written on a disk full to its last byte too.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time
from typing import Any, Dict, Optional, Tuple

from dflash_contract.names import ATTEMPT_ENV
from dflash_contract.records import (AttemptEntry, CheckpointRef, ExitRecord, ProcessRef, ReleaseSource, RestartPolicy,
                                     RunPlace, RunRecord, attempt_errors)
from dflash_files import procfs
from dflash_files.atomic import write_json_atomic
from dflash_files.diskspace import NO_SPACE, DiskFull, Reserve

from . import attempts, checkpoints, locks, oom, warm
from .jsonio import AgentError
from .jsonio import encode_line
from .layout import RunDir, Workspace
from .state import GONE, Observation, derive_state, error_records, summarize_events
from .supervisor_report import SupervisorReport

STOP_POLL_S = 0.2  # during a restart's back-off, how often stop_requested.json is looked for
# How long the notice of a killed trainer tries to reach its peers' store: a rank 0 still
# importing torch has not opened it yet.
PEER_NOTICE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class TrainerPlan:
    """Everything needed to start one trainer process."""
    workspace: Workspace
    run: RunDir
    name: Optional[str]
    release_id: str
    release_root: str
    config_source: str
    python: str
    env: Tuple[Tuple[str, str], ...]  # the trainer's whole environment
    env_keys: Tuple[str, ...]  # the --env keys (values may be secrets: not recorded)
    resources: Tuple[str, ...]
    stall_after: float
    startup_stall_after: float
    source: Optional[ReleaseSource] = None  # where the release came from, as the CLI saw it
    overrides: Tuple[str, ...] = ()  # the --set KEY=VALUE applied to the user's file
    restart: Optional[RestartPolicy] = None  # the config's restart policy (attempts.py)
    attempt: int = 0  # 0: the launch; then each resume or restart
    reason: str = "launch"  # launch | resume | restart
    resume_from: Optional[Tuple[int, str]] = None  # (step, checkpoint folder) this attempt starts from
    history: Tuple[AttemptEntry, ...] = ()  # the ended attempts' entries (run.json `attempts`)
    distributed: Optional[RunPlace] = None  # this host's place in a run on several hosts

    @property
    def argv(self) -> Tuple[str, ...]:
        resume = () if self.resume_from is None else ("--resume-from", self.resume_from[1])
        return (self.python, "-m", "dflash_train", "--config", self.run.config,
                "--run-dir", self.run.path) + resume


def log(message: str) -> None:
    """One line in agent.log, written whole or not at all: a full disk must not end the
    supervisor, which has exit.json still to write."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    try:
        os.write(2, ("%s supervisor[%d]: %s\n" % (stamp, os.getpid(), message)).encode("utf-8", "replace"))
    except OSError:
        pass


def log_error(message: str) -> None:
    """The supervisor's own failure, in one line (its newlines escaped), the form
    state.agent_error reads for `status`."""
    log("error: " + message.replace("\n", "\\n"))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "SIG%d" % signum


def _send(fd: int, message: Dict[str, Any]) -> None:
    os.write(fd, encode_line(message))


def _exec_trainer(plan: TrainerPlan, pipes: Dict[str, int], train_log_fd: int) -> None:
    """In the forked child: new session, wait for the go byte, exec. Never returns."""
    reason = "unknown"
    try:
        os.setsid()  # its own process group (pgid == pid), so stop reaches all it spawns
        for key in ("report", "go_w", "sync_r", "exec_r"):
            os.close(pipes[key])
        os.write(pipes["sync_w"], b"s")
        os.close(pipes["sync_w"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(train_log_fd, 1)
        os.dup2(train_log_fd, 2)
        os.close(devnull)
        os.close(train_log_fd)
        os.chdir(plan.run.path)
        # Every disposition at its default and an empty mask, whatever the agent was
        # started with (a signal ignored by `nohup`, or by a shell for a job it put in the
        # background, would stay ignored across the exec): the trainer starts as the warm
        # interpreter's forks start (dflash_train/warm.py), and as Python's own ignores
        # (SIGPIPE, SIGXFSZ) must not reach an exec'd program (subprocess's restore_signals).
        for signum in range(1, signal.NSIG):
            if signum in (signal.SIGKILL, signal.SIGSTOP) or signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
                continue
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                continue
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if os.read(pipes["go_r"], 1) != b"g":
            os._exit(125)  # the supervisor gave up before run.json existed: never start
        os.execvpe(plan.python, list(plan.argv), dict(plan.env, **{ATTEMPT_ENV: str(plan.attempt)}))
    except BaseException as exc:  # exec failed: say why in train.log and to the supervisor
        reason = "cannot start the trainer: %s: %s" % (type(exc).__name__, exc)
    try:
        os.write(2, ("dflash-agent: %s (argv: %r)\n" % (reason, list(plan.argv))).encode("utf-8", "replace"))
        os.write(pipes["exec_w"], reason.encode("utf-8", "replace"))
    finally:
        os._exit(127)


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def supervise(plan: TrainerPlan, report_fd: int) -> int:
    """Run the trainer, and again from the newest intact checkpoint while the run's restart
    policy says so (attempts.py); then write exit.json and release the locks. Reports
    {"ok": ...} on `report_fd` once the first attempt's run.json exists (or why it could
    not start) and closes it."""
    report: Optional[int] = report_fd
    reserve = Reserve(plan.run.file("exit.json.reserve"))
    reserve.make()
    while True:
        entry, exit_record = _run_attempt(plan, report)
        report = None
        plan_next = _next_attempt(plan, entry, exit_record)
        if plan_next is None:
            _write_exit(plan.run, exit_record, reserve)
            break
        plan = plan_next
    locks.release(plan.workspace, plan.resources, plan.run.run_id)
    _tell_peers(plan, exit_record)
    return 0


def _tell_peers(plan: TrainerPlan, exit_record: ExitRecord) -> None:
    """A trainer of a run on several hosts killed by a signal told its peers nothing:
    say it for it on their store (dflash_train.peer_notice, in the trainer's own
    environment), so they end in seconds, also while they wait in the join. After
    exit.json and the locks: this host's state is already known; the notice only
    spares the peers their timeouts."""
    if plan.distributed is None or not exit_record.signal or os.path.exists(plan.run.stop_requested):
        return
    if plan.distributed.rank == 0:  # the store lived in this trainer: the peers see it gone
        return
    rank, hosts = plan.distributed.rank, plan.distributed.hosts or ()
    # The name the peers and the CLI know this host by (the inventory's), not the machine's own.
    name = hosts[rank] if 0 <= rank < len(hosts) else socket.gethostname()
    message = "the trainer on %s was killed by %s%s" % (
        name, exit_record.signal, " (the kernel's OOM killer)" if exit_record.oom_killed else "")
    argv = [plan.python, "-m", "dflash_train.peer_notice", "--message", message,
            "--timeout-s", str(PEER_NOTICE_TIMEOUT_S)]
    log("telling the peers: %s" % message)
    try:  # its output goes where ours does: agent.log
        subprocess.run(argv, env=dict(plan.env), cwd=plan.run.path, stdin=subprocess.DEVNULL,
                       timeout=PEER_NOTICE_TIMEOUT_S + 30.0, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log("could not tell the peers: %s: %s" % (type(exc).__name__, exc))


def _report(fd: Optional[int], message: SupervisorReport) -> None:
    if fd is not None:
        _send(fd, message.to_json())
        os.close(fd)


class _ExecTrainer:
    """A trainer forked here that execs `python -m dflash_train` once it may start
    (_exec_trainer): WarmTrainer's interface."""

    def __init__(self, plan: TrainerPlan, report_fd: Optional[int]):
        self.oom_files = oom.counter_files()
        pipes = {"report": report_fd if report_fd is not None else os.open(os.devnull, os.O_RDONLY)}
        pipes["go_r"], pipes["go_w"] = os.pipe()
        pipes["sync_r"], pipes["sync_w"] = os.pipe()
        pipes["exec_r"], pipes["exec_w"] = os.pipe()  # close-on-exec: EOF without data = exec worked
        train_log_fd = os.open(plan.run.train_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pid = os.fork()
        if self.pid == 0:
            _exec_trainer(plan, pipes, train_log_fd)
        for key in ("go_r", "sync_w", "exec_w"):
            os.close(pipes[key])
        if report_fd is None:
            os.close(pipes["report"])
        os.close(train_log_fd)
        self.go_w, self.exec_r = pipes["go_w"], pipes["exec_r"]
        # Wait until the child is in its own session: from then on pgid == pid holds.
        in_session = os.read(pipes["sync_r"], 1) == b"s"
        os.close(pipes["sync_r"])
        if not in_session:
            self.go(False)
            self.wait()
            raise RuntimeError("the trainer process died before starting")

    def go(self, start: bool) -> None:
        if start:
            os.write(self.go_w, b"g")
        os.close(self.go_w)  # without the byte: the child reads EOF and exits without exec

    def wait(self) -> Tuple[Optional[int], Optional[str]]:
        """(its wait status, why the exec failed or None)."""
        exec_error = _read_all(self.exec_r).decode("utf-8", "replace") or None
        os.close(self.exec_r)
        return os.waitpid(self.pid, 0)[1], exec_error


def _warm_trainer(plan: TrainerPlan) -> Tuple[Optional[warm.WarmTrainer], Optional[warm.WarmFailed]]:
    """The trainer forked by the warm interpreter, or why there is none."""
    if warm.idle_s(dict(plan.env)) == 0:
        return None, warm.WarmFailed("%s=0: no warm interpreter" % warm.IDLE_ENV)
    where = warm.place(plan.workspace.warm, plan.release_id, plan.python)
    env = dict(plan.env, **{ATTEMPT_ENV: str(plan.attempt)})
    try:
        trainer = warm.fork_trainer(where, plan.argv[3:], env, plan.run.path, plan.run.train_log)
    except warm.WarmFailed as exc:
        return None, exc
    return trainer, None


def _start_warm(plan: TrainerPlan, failure: warm.WarmFailed) -> None:
    """After a trainer started without the warm interpreter: start one for the next
    launch, unless it is off or on its way. Its failures are lines in agent.log."""
    if warm.idle_s(dict(plan.env)) == 0 or "still importing" in str(failure):
        return
    where = warm.place(plan.workspace.warm, plan.release_id, plan.python)
    try:
        if failure.hung or failure.replace:
            warm.end(where, signal.SIGKILL if failure.hung else signal.SIGTERM)
        log(warm.start(plan.workspace.warm, where, plan.python, dict(plan.env), plan.release_id, plan.release_root,
                       warm.idle_s(dict(plan.env)), ending=failure.hung or failure.replace or failure.ends))
    except (OSError, AgentError) as exc:
        log("could not start a warm interpreter: %s: %s" % (type(exc).__name__, exc))


def _run_attempt(plan: TrainerPlan, report_fd: Optional[int]) -> Tuple[AttemptEntry, ExitRecord]:
    """Start one trainer process and wait for it: (its `attempts` entry, its exit record)."""
    trainer, failure = _warm_trainer(plan)
    while True:
        try:
            if trainer is None:
                log("not using the warm interpreter: %s; exec'ing the trainer" % failure)
                trainer = _ExecTrainer(plan, report_fd)
            oom_before = oom.oom_kill_count(trainer.oom_files)
            try:
                entry, start_ticks = _record_start(plan, trainer, failure)
            except BaseException:
                trainer.go(False)
                trainer.wait()
                raise
        except BaseException as exc:
            _report(report_fd, SupervisorReport(ok=False, error="%s: %s" % (type(exc).__name__, exc),
                                                errno=getattr(exc, "errno", None),
                                                filename=getattr(exc, "filename", None)))
            raise
        try:
            _go(plan, trainer)
            break
        except warm.WarmFailed as exc:  # only the warm one's go can fail: then exec
            trainer, failure = None, exc
    pid = trainer.pid
    log("trainer pid %d started (attempt %d) by %s: %r" % (
        pid, plan.attempt, "exec" if failure else "the warm interpreter", list(plan.argv)))
    _report(report_fd, SupervisorReport(ok=True, pid=pid, pgid=pid))
    if failure is not None:
        _start_warm(plan, failure)

    status, exec_error = trainer.wait()
    if status is None:
        exit_code, sig = None, None
        log_error(exec_error)
    elif os.WIFSIGNALED(status):
        exit_code, sig = None, signal_name(os.WTERMSIG(status))
    else:
        exit_code, sig = os.WEXITSTATUS(status), None
    exit_record = ExitRecord(
        exit_code=exit_code, signal=sig,
        oom_killed=oom.was_oom_killed(oom_before, oom.oom_kill_count(trainer.oom_files), sig, pid, start_ticks),
        ended_at=time.time(), exec_error=exec_error, attempt=plan.attempt)
    log("trainer ended: %r" % exit_record.to_json())
    return entry, exit_record


def _record_start(plan: TrainerPlan, trainer: Any,
                  failure: Optional[warm.WarmFailed]) -> Tuple[AttemptEntry, Optional[int]]:
    """run.json for the trainer forked and waiting for its go: (its `attempts` entry, its
    start time)."""
    run, pid = plan.run, trainer.pid
    start_ticks = procfs.start_time(pid)
    started_at = time.time()
    entry = AttemptEntry(attempt=plan.attempt, reason=plan.reason, started_at=started_at, pid=pid,
                         release_id=plan.release_id, started_by="exec" if failure else "warm",
                         resume_from=None if plan.resume_from is None else CheckpointRef(*plan.resume_from))
    record = RunRecord(
        run_id=run.run_id, name=plan.name, release_id=plan.release_id,
        release_dir=plan.release_root, workspace=plan.workspace.root,
        config=_read_text(run.config), config_source=plan.config_source,
        overrides=tuple(plan.overrides),
        argv=tuple(plan.argv), cwd=run.path, env_keys=tuple(plan.env_keys),
        pid=pid, pgid=pid, start_time=start_ticks, boot_id=procfs.boot_id(),
        host=socket.gethostname(), started_at=started_at,
        started_by="exec" if failure else "warm", warm_reason=None if failure is None else str(failure),
        stall_after=plan.stall_after, startup_stall_after=plan.startup_stall_after,
        resources=tuple(plan.resources),
        supervisor=ProcessRef(pid=os.getpid(), start_time=procfs.start_time(os.getpid())),
        source=plan.source, restart=plan.restart,
        distributed=plan.distributed,
        attempt=plan.attempt, attempts=tuple(plan.history) + (entry,),
    )
    write_json_atomic(run.run_json, record.to_json())
    if plan.attempt > 0:
        attempts.append_markers(run, plan.attempt, plan.reason,
                                None if plan.resume_from is None else plan.resume_from[0], plan.release_id)
    if plan.reason == "resume":
        # The run is this attempt's from here on: the previous attempt's exit.json and
        # stop_requested.json go (its entry in `attempts` keeps them). A restart has
        # neither: its attempt's exit was never written, and a stop ends restarting.
        attempts.clear_ended_attempt(run)
    return entry, start_ticks


def _go(plan: TrainerPlan, trainer: Any) -> None:
    # `stop` writes stop_requested.json, then reads run.json; this wrote run.json and now
    # reads stop_requested.json: one of the two sees the other, so a stop that came as a
    # restart began either finds the new trainer or keeps it from starting.
    trainer.go(not (plan.attempt > 0 and os.path.exists(plan.run.stop_requested)))


def _next_attempt(plan: TrainerPlan, entry: AttemptEntry, exit_record: ExitRecord) -> Optional[TrainerPlan]:
    """The plan of the restart the policy calls for, after its back-off; None when the
    run ends here."""
    run = plan.run
    errors = attempt_errors(error_records(run.errors), plan.attempt)
    step = attempts.failed_step(errors, summarize_events(run.events).step)
    cause = attempts.restart_cause(exit_record, errors)
    history = list(plan.history) + [entry]
    refusal = attempts.restart_refusal(plan.restart, history, cause, step,
                                       os.path.exists(run.stop_requested))
    if refusal is None:
        assert plan.restart is not None  # restart_refusal gives one wherever there is no policy
        delay = attempts.backoff(plan.restart, history)
        where = "" if step is None else " at step %d" % step
        attempts.log_line(run, "attempt %d ended (%s%s); restarting in %.1f s (restart %d of %d)" % (
            plan.attempt, cause, where, delay, attempts.restarts_in_a_row(history) + 1, plan.restart.max))
        if _stopped_within(run, delay):
            refusal = "it was stopped"
    if refusal is not None:
        if cause is not None and plan.restart and plan.restart.max:
            attempts.log_line(run, "attempt %d ended (%s): not restarting: %s" % (plan.attempt, cause, refusal))
        return None
    state = derive_state(Observation(started_at=entry.started_at, stall_after=plan.stall_after, now=time.time(),
                                     trainer=GONE, exit=exit_record, error_count=len(errors)))
    pick = checkpoints.newest_intact(run)
    for bad in pick.corrupt:
        attempts.log_line(run, "the checkpoint at step %d is corrupt, not restarted from: %s" % (bad.step, bad.problem))
    if pick.checkpoint is None and pick.corrupt:  # starting over would drop what the run trained
        attempts.log_line(run, "attempt %d ended (%s): not restarting: no intact checkpoint" % (plan.attempt, cause))
        return None
    return dataclasses.replace(
        plan, attempt=plan.attempt + 1, reason="restart", resume_from=pick.checkpoint or plan.resume_from,
        history=tuple(plan.history) + (attempts.closed(entry, exit_record, state, step),))


def _write_exit(run: RunDir, exit_record: ExitRecord, reserve: Reserve) -> None:
    """exit.json, then the reserve given back; on a disk with no room for it, into the
    reserve's room, with `error` saying so (null otherwise)."""
    try:
        write_json_atomic(run.exit_json, exit_record.to_json())
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        full = DiskFull(run.exit_json)  # made first: what is free without the reserve
        if not reserve.release():
            raise full from exc
        write_json_atomic(run.exit_json, dataclasses.replace(exit_record, error=str(full)).to_json())
        log_error(str(full))  # after: the line would take the room exit.json needs
    reserve.release()


def _stopped_within(run: RunDir, seconds: float) -> bool:
    """Wait `seconds`, or less if a stop is requested meanwhile (then True)."""
    deadline = time.monotonic() + seconds
    while True:
        if os.path.exists(run.stop_requested):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(STOP_POLL_S, left))


def _read_text(path: str) -> str:
    with open(path, "rb") as handle:
        return handle.read().decode("utf-8", "surrogateescape")
