"""Failures injected on purpose (`faults:` in the training config).

Each thread calls `FaultInjector.fire(name, step=...)` at startup (step None) and at
every step; a matching fault then raises a chained exception `depth` frames deep,
hangs, works the CPU for `seconds` (busy: a slow phase that is working), aborts the
process or exits it with a code. A drafter also asks
`poisons(name, step)` before its forward: `nonfinite` makes that step's loss and
gradients NaN (Replica.run_step), the failure a diverging run meets. Matching is by the
logical thread name, so the sequential pipeline (one thread doing every part) takes the
same faults. A fault with `attempt: N` fires only in attempt N of the run (DFLASH_ATTEMPT),
so a test can fail the launch and let its restart or resume succeed; one with `rank: N`
only in the process of that rank (a host of a multi-host run). Without them, everywhere.
A `raise` with `exception: module.Name` raises that class with `message` instead of the
InjectedFault chain: the type and text a real failure has (torch.OutOfMemoryError, say).
"""
from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Callable

from .config import FaultSpec
from .runlog import attempt_number, say


class InjectedFault(RuntimeError):
    """The outer exception of an injected `raise`."""


class InjectedRootCause(ValueError):
    """The innermost exception of an injected `raise`: the root cause to be reported."""


class FaultInjector:
    def __init__(self, faults: tuple[FaultSpec, ...], rank: int = 0, attempt: int | None = None):
        attempt = attempt_number() if attempt is None else attempt
        self._faults = tuple(f for f in faults if (f.attempt is None or f.attempt == attempt)
                             and (f.rank is None or f.rank == rank))
        for fault in self._faults:  # a name that imports nothing fails the start, not the step it names
            if fault.exception is not None:
                exception_class(fault.exception)

    def fire(self, thread: str, step: int | None = None) -> None:
        for fault in self._matching(thread, step, poison=False):
            _FIRE[fault.kind](fault, self._announce(fault, thread, step))

    def poisons(self, thread: str, step: int) -> bool:
        """Whether `thread` is to make step `step` non-finite (a `nonfinite` fault)."""
        faults = self._matching(thread, step, poison=True)
        for fault in faults:
            self._announce(fault, thread, step)
        return bool(faults)

    def _matching(self, thread: str, step: int | None, poison: bool) -> list[FaultSpec]:
        return [f for f in self._faults
                if f.thread == thread and f.step == step and (f.kind == "nonfinite") == poison]

    @staticmethod
    def _announce(fault: FaultSpec, thread: str, step: int | None) -> str:
        where = f"{thread} at {'startup' if step is None else f'step {step}'}"
        say(f"injecting fault: {fault.kind} in {where}")
        return where


def exception_class(name: str) -> type[BaseException]:
    """The exception class a fault's `exception` names ("module.Name")."""
    module, _, attribute = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"faults: exception {name!r} cannot be found ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        raise ValueError(f"faults: exception {name!r} is not an exception class")
    return found


def _raise(fault: FaultSpec, where: str) -> None:
    if fault.exception is not None:  # as torch or a library raises it: alone, no wrapper
        named = exception_class(fault.exception)
        _descend_even(fault.depth, lambda: named() if fault.message is None else named(fault.message))
    try:
        _descend_even(fault.depth, lambda: InjectedRootCause(f"injected root cause in {where}"))
    except InjectedRootCause as exc:
        raise InjectedFault(f"injected fault in {where} (the cause is {fault.depth} frames deep)") from exc


# Two functions calling each other: a traceback collapses runs of identical frames
# ("[Previous line repeated N more times]"), and alternating frames keep all `depth` visible.
def _descend_even(remaining: int, make: Callable[[], BaseException]) -> None:
    if remaining <= 1:
        raise make()
    _descend_odd(remaining - 1, make)


def _descend_odd(remaining: int, make: Callable[[], BaseException]) -> None:
    if remaining <= 1:
        raise make()
    _descend_even(remaining - 1, make)


def _hang(fault: FaultSpec, where: str) -> None:
    never = threading.Event()
    while True:  # blocks forever; the stack shows up in faulthandler dumps (SIGUSR1)
        never.wait(3600)


def _busy(fault: FaultSpec, where: str) -> None:
    deadline = time.monotonic() + fault.seconds
    while time.monotonic() < deadline:  # work, not a wait: the CPU time is what shows it
        sum(i * i for i in range(10_000))


def _abort(fault: FaultSpec, where: str) -> None:
    os.abort()


def _exit(fault: FaultSpec, where: str) -> None:
    os._exit(fault.code)


_FIRE = {"raise": _raise, "hang": _hang, "abort": _abort, "exit": _exit, "busy": _busy}
