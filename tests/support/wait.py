"""The one way a test waits: for a condition, polled, with a generous deadline. The deadline
only turns a hang into a failure that says what never happened; nothing is asserted about
how long anything took (CI machines are slow and loaded: figures belong in bench/)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: long enough for the slowest loaded machine, short of pytest-timeout's 300 s
DEFAULT_TIMEOUT_S = 120.0


def wait_until(condition: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, what: str = "the condition",
               *, interval: float = 0.02, give_up: Callable[[], str | None] | None = None) -> T:
    """Call `condition()` until it returns a true value, and return that value.

    Fails (AssertionError naming `what`) after `timeout` seconds, or at once when `give_up()`
    returns a reason (e.g. "the process exited"): waiting longer could not help then."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        reason = give_up() if give_up is not None else None
        if reason is not None:
            value = condition()  # it may have come true just before the reason did
            if value:
                return value
            raise AssertionError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
