"""Waiting out a dropped connection: the transports reconnect on the next command, so
a read-only call is simply made again, after a growing pause, for a bounded time."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from . import console
from .errors import ConnectionLost, UnreachableError

T = TypeVar("T")

#: how long `watch` and deploy's probe keep retrying once the connection dropped
RETRY_FOR_S = 60.0


class Reconnects:
    """Pauses between attempts: 0.5 s doubling up to 8 s; gives up `retry_for` s after
    the first failure since the connection last made progress."""

    def __init__(self, retry_for: float):
        self.retry_for = retry_for
        self.delay = 0.5
        self.down_since: float | None = None

    def progressed(self) -> None:
        """The last connection worked for a while: start counting afresh."""
        self.delay, self.down_since = 0.5, None

    def wait(self, exc: UnreachableError, after_giving_up: str) -> None:
        """Sleep before the next attempt, or raise when the time is up; `after_giving_up`
        tells the user where things stand then."""
        self.down_since = self.down_since or time.monotonic()
        if time.monotonic() - self.down_since > self.retry_for:
            raise UnreachableError(f"{exc.message}; gave up after {self.retry_for:.0f} s of retries "
                                   f"({after_giving_up})")
        console.warn(f"{exc.message}; reconnecting in {self.delay:.1f} s")
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 8.0)


def retry_dropped(call: Callable[[], T], retry_for: float = RETRY_FOR_S) -> T:
    """`call()` (which must be idempotent), made again after a dropped connection; a host
    that cannot be reached at all fails at once, with no retry."""
    reconnects = None
    while True:
        try:
            return call()
        except UnreachableError as exc:
            if reconnects is None:
                if not isinstance(exc, ConnectionLost):
                    raise
                reconnects = Reconnects(retry_for)
            reconnects.wait(exc, "nothing was changed on the host")
