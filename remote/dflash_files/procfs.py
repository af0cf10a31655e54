"""What /proc says about processes: identity (pid + start time + boot id, because pids
are reused), liveness, process-group members, and installed signal handlers."""
from __future__ import annotations

import os
from typing import List, NamedTuple, Optional

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class ProcStat(NamedTuple):
    pid: int
    state: str  # R, S, D, Z, ...
    ppid: int
    pgrp: int
    session: int
    start_time: int  # field 22: clock ticks after boot; with the pid, names one process


def boot_id() -> Optional[str]:
    try:
        with open(BOOT_ID_PATH) as handle:
            return handle.read().strip()
    except OSError:
        return None


def read_stat(pid: int) -> Optional[ProcStat]:
    """/proc/<pid>/stat, or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:  # gone (ENOENT), or exiting while we read (ESRCH)
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and ')'.
    fields = text[text.rindex(")") + 2:].split()
    return ProcStat(pid=pid, state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]),
                    session=int(fields[3]), start_time=int(fields[19]))


def start_time(pid: int) -> Optional[int]:
    stat = read_stat(pid)
    return stat.start_time if stat else None


def is_running(stat: Optional[ProcStat]) -> bool:
    """Exists and is not a zombie (a zombie has exited; only its exit status is left)."""
    return stat is not None and stat.state not in ("Z", "X")


def identity_alive(pid: Optional[int], expected_start: Optional[int]) -> Optional[bool]:
    """True: that very process runs. False: it exited. None: the pid now belongs to
    another process (reused)."""
    if not pid:
        return False
    stat = read_stat(pid)
    if stat is None:
        return False
    if expected_start is not None and stat.start_time != expected_start:
        return None
    return is_running(stat)


def group_members(pgid: int) -> List[ProcStat]:
    """Running (non-zombie) processes whose process group is `pgid`."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = read_stat(int(name))
        if stat is not None and stat.pgrp == pgid and is_running(stat):
            members.append(stat)
    return members


def group_is_ours(pgid: int, leader_start: Optional[int]) -> bool:
    """Whether signalling process group `pgid` reaches the run's processes and nothing
    else. The trainer called setsid, so pgid == its pid. While any member lives the
    kernel keeps that number reserved; once the group is empty it may be handed to a new
    process, which we recognise by its different start time."""
    leader = read_stat(pgid)
    if leader is not None and leader.start_time != leader_start:
        return False
    return bool(group_members(pgid))


def catches_signal(pid: int, signum: int) -> bool:
    """Whether the process installed a handler for `signum` (SigCgt in /proc/<pid>/status).
    Sending SIGUSR1 to a process that has not would kill it."""
    try:
        with open("/proc/%d/status" % pid) as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        return False
    return False
