"""The one way a test waits: for a condition, polled, with a generous deadline. The deadline
only turns a hang into a failure that says what never happened; nothing is asserted about
how long anything took (CI machines are slow and loaded: figures belong in bench/)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: long enough for the slowest loaded machine, short of pytest-timeout's 300 s
DEFAULT_TIMEOUT_S = 120.0


#: the first poll follows at once, then every FIRST_INTERVAL_S growing to MAX_INTERVAL_S:
#: what comes true at once is seen at once, and a condition that is a round trip to a host
#: (a status over SSH: an ssh, a pct, an interpreter) is not asked hundreds of times while
#: a run takes its tens of seconds; the suite is CPU-bound, every poll is another test's wait
FIRST_INTERVAL_S = 0.02
MAX_INTERVAL_S = 0.5


def wait_until(condition: Callable[[], T], timeout: float = DEFAULT_TIMEOUT_S, what: str = "the condition",
               *, interval: float | None = None, give_up: Callable[[], str | None] | None = None) -> T:
    """Call `condition()` until it returns a true value, and return that value; `interval`:
    a fixed time between polls instead of the growing one.

    Fails (AssertionError naming `what`) after `timeout` seconds, or at once when `give_up()`
    returns a reason (e.g. "the process exited"): waiting longer could not help then."""
    deadline = time.monotonic() + timeout
    pause = interval or FIRST_INTERVAL_S
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
        time.sleep(pause)
        if interval is None:
            pause = min(pause * 1.5, MAX_INTERVAL_S)
