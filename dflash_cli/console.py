"""Where output goes: data on stdout, everything for humans on stderr (DESIGN.md).

rich renders tables and progress on stderr; it honours NO_COLOR by itself.
"""
from __future__ import annotations

import datetime
import sys

from rich.console import Console

human = Console(stderr=True, highlight=False)


def data(text: str) -> None:
    """Write data (run ids, log lines, tracebacks, JSON) to stdout, unchanged."""
    sys.stdout.write(text)
    sys.stdout.flush()


def say(message: str) -> None:
    human.print(message, markup=False, soft_wrap=True)


def warn(message: str) -> None:
    human.print(f"warning: {message}", style="yellow", markup=False, soft_wrap=True)


def utc_time(ts: float | None, timespec: str = "seconds") -> str:
    """A Unix time as ISO-8601 in UTC, as the trainer's log lines and the traceback
    headers give times ("" for none): one form on every screen, whatever the zone of
    the host or of this machine."""
    if ts is None:
        return ""
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec=timespec)
