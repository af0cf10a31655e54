"""The `stop` and `stacks` verbs: signals to a run's own processes, and nothing else
(identity is checked against run.json first, because pids are reused)."""
from __future__ import annotations

import os
import signal
import time

from dflash_contract.records import RunRecord
from dflash_contract.replies import StacksReply, StopReply
from dflash_files import procfs
from dflash_files.atomic import write_json_atomic

from . import stackdump
from .jsonio import AgentError, decode_bytes
from .layout import RunDir
from .state import ALIVE, derive_state, observe, read_record, trainer_liveness

POLL_S = 0.05
KILL_WAIT_S = 30.0  # after SIGKILL: only uninterruptible sleep (D state) can delay exit
EXIT_JSON_WAIT_S = 10.0


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # the group emptied meanwhile


def stop(run: RunDir, grace: float) -> StopReply:
    record = read_record(run)
    state = derive_state(observe(run, record))
    if state.terminal:
        return StopReply(run_id=run.run_id, state=state, killed=False)
    write_json_atomic(run.stop_requested, {"requested_at": time.time(), "grace_s": grace})
    killed = False
    signalled = set()
    # A supervisor restarting the run writes the new attempt's run.json, then looks for
    # stop_requested.json before letting it start: reading run.json again after writing
    # that file finds any trainer that started all the same.
    while record.pgid not in signalled:
        signalled.add(record.pgid)
        killed = _end_group(run, record, grace) or killed
        record = read_record(run)
    # exit.json comes from the supervisor, if it is alive to write it.
    supervisor = record.supervisor
    _wait(lambda: os.path.exists(run.exit_json)
          or not procfs.identity_alive(supervisor.pid, supervisor.start_time),
          EXIT_JSON_WAIT_S)
    return StopReply(run_id=run.run_id, state=derive_state(observe(run, record)), killed=killed)


def _end_group(run: RunDir, record: RunRecord, grace: float) -> bool:
    """SIGTERM to the trainer's process group, SIGKILL after `grace`; True if it took that."""
    pgid, leader_start = record.pgid, record.start_time
    if record.boot_id != procfs.boot_id() or not procfs.group_is_ours(pgid, leader_start):
        return False

    def group_empty() -> bool:
        return not procfs.group_members(pgid)

    _signal_group(pgid, signal.SIGTERM)
    if _wait(group_empty, grace):
        return False
    _signal_group(pgid, signal.SIGKILL)
    if not _wait(group_empty, KILL_WAIT_S):
        raise AgentError("run %r: processes of group %d still exist %.0f s after SIGKILL"
                         % (run.run_id, pgid, KILL_WAIT_S), "internal")
    return True


def stacks(run: RunDir, timeout: float) -> StacksReply:
    record = read_record(run)
    pid = record.pid
    if trainer_liveness(record) != ALIVE:
        raise AgentError("run %r is not running (%s)" % (run.run_id, derive_state(observe(run, record))),
                         "conflict")
    if not procfs.catches_signal(pid, signal.SIGUSR1):
        # Its default action would kill the trainer.
        raise AgentError("run %r has no SIGUSR1 handler yet (faulthandler is registered during "
                         "start-up); try again shortly" % run.run_id, "conflict")
    # Both this and the trainer's faulthandler append (O_APPEND): the header lands
    # right before the dump it announces.
    fd = os.open(run.faulthandler, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, stackdump.header("requested (SIGUSR1)").encode("utf-8"))
    finally:
        os.close(fd)
    before = _size(run.faulthandler)
    os.kill(pid, signal.SIGUSR1)
    if not _wait(lambda: _size(run.faulthandler) > before, timeout):
        raise AgentError("run %r: no stack dump in %s within %.1f s" % (run.run_id, run.faulthandler, timeout),
                         "internal")
    # The handler writes the dump in many small writes: wait until the size settles.
    size = _size(run.faulthandler)
    while True:
        time.sleep(0.1)
        now = _size(run.faulthandler)
        if now == size:
            break
        size = now
    with open(run.faulthandler, "rb") as handle:
        handle.seek(before)
        text = decode_bytes(handle.read(size - before))
    return StacksReply(run_id=run.run_id, text=stackdump.name_threads(text, stackdump.thread_names(run)))


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
