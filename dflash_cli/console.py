"""Where output goes: data on stdout, everything for humans on stderr (DESIGN.md).

rich renders tables and progress on stderr; it honours NO_COLOR by itself.
"""
from __future__ import annotations

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
