"""Was the trainer killed by the kernel's OOM killer? A SIGKILL alone does not say.

First choice: the memory cgroup's oom_kill counter (cgroup v2 memory.events, or v1
memory.oom_control), read before and after the run. Where no counter is readable,
best effort: the kernel log (/dev/kmsg) naming the trainer's pid.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional

CGROUP_ROOT = "/sys/fs/cgroup"
_KILLED = re.compile(r"(?:Killed process (\d+) |oom-kill:.*\bpid=(\d+)\b)")


def counter_files(pid: Optional[int] = None) -> List[str]:
    """The OOM counter files of the memory cgroup of `pid` (None: this process)."""
    try:
        with open("/proc/%s/cgroup" % ("self" if pid is None else pid)) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            # cgroup v2; on hybrid hosts the v2 tree is mounted under unified/
            files.append(CGROUP_ROOT + path.rstrip("/") + "/memory.events")
            files.append(CGROUP_ROOT + "/unified" + path.rstrip("/") + "/memory.events")
        elif "memory" in controllers.split(","):
            files.append(CGROUP_ROOT + "/memory" + path.rstrip("/") + "/memory.oom_control")
    return files


def oom_kill_count(files: Optional[List[str]] = None) -> Optional[int]:
    """OOM kills so far in the memory cgroup of `files` (counter_files; None: this
    process's), or None when unreadable."""
    for path in counter_files() if files is None else files:
        try:
            with open(path) as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def kernel_log_names_oom_kill(pid: int, since_s: float) -> bool:
    """Whether /dev/kmsg reports an OOM kill of `pid` at or after `since_s` seconds
    after boot. False where the kernel log cannot be read (containers, no privilege)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        while True:
            try:
                record = os.read(fd, 16384)  # one record per read
            except BlockingIOError:
                return False  # read everything
            except BrokenPipeError:
                continue  # records were overwritten under us; the next read resumes
            except OSError:
                return False
            if not record:
                return False
            header, _, message = record.decode("utf-8", "replace").partition(";")
            fields = header.split(",")
            try:
                stamp_s = int(fields[2]) / 1e6
            except (IndexError, ValueError):
                continue
            match = _KILLED.search(message)
            if match and stamp_s >= since_s and int(match.group(1) or match.group(2)) == pid:
                return True
    finally:
        os.close(fd)


def was_oom_killed(before: Optional[int], after: Optional[int], signal_name: Optional[str],
                   pid: int, start_ticks: Optional[int]) -> bool:
    if before is not None and after is not None:
        return after > before
    if signal_name != "SIGKILL" or start_ticks is None:
        return False
    return kernel_log_names_oom_kill(pid, start_ticks / os.sysconf("SC_CLK_TCK") - 1.0)
