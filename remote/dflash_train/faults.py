"""Failures injected on purpose (`faults:` in the training config).

Each thread calls `FaultInjector.fire(name, step=...)` at startup (step None) and at
every step; a matching fault then raises a chained exception `depth` frames deep,
hangs, aborts the process or exits it with a code. Matching is by the logical thread
name, so the sequential pipeline (one thread doing every part) takes the same faults.
"""
from __future__ import annotations

import os
import threading

from .config import FaultSpec
from .runlog import say


class InjectedFault(RuntimeError):
    """The outer exception of an injected `raise`."""


class InjectedRootCause(ValueError):
    """The innermost exception of an injected `raise`: the root cause to be reported."""


class FaultInjector:
    def __init__(self, faults: tuple[FaultSpec, ...]):
        self._faults = faults

    def fire(self, thread: str, step: int | None = None) -> None:
        for fault in self._faults:
            if fault.thread == thread and fault.step == step:
                where = "startup" if step is None else f"step {step}"
                say(f"injecting fault: {fault.kind} in {thread} at {where}")
                _FIRE[fault.kind](fault, f"{thread} at {where}")


def _raise(fault: FaultSpec, where: str) -> None:
    try:
        _descend_even(fault.depth, where)
    except InjectedRootCause as exc:
        raise InjectedFault(f"injected fault in {where} (the cause is {fault.depth} frames deep)") from exc


# Two functions calling each other: a traceback collapses runs of identical frames
# ("[Previous line repeated N more times]"), and alternating frames keep all `depth` visible.
def _descend_even(remaining: int, where: str) -> None:
    if remaining <= 1:
        raise InjectedRootCause(f"injected root cause in {where}")
    _descend_odd(remaining - 1, where)


def _descend_odd(remaining: int, where: str) -> None:
    if remaining <= 1:
        raise InjectedRootCause(f"injected root cause in {where}")
    _descend_even(remaining - 1, where)


def _hang(fault: FaultSpec, where: str) -> None:
    never = threading.Event()
    while True:  # blocks forever; the stack shows up in faulthandler dumps (SIGUSR1)
        never.wait(3600)


def _abort(fault: FaultSpec, where: str) -> None:
    os.abort()


def _exit(fault: FaultSpec, where: str) -> None:
    os._exit(fault.code)


_FIRE = {"raise": _raise, "hang": _hang, "abort": _abort, "exit": _exit}
