"""Work on several hosts at once as the user sees it: one live display for every host's
transfer bar, and a first Ctrl-C that stops the work at its next chunk instead of
abandoning it, so that each host's outcome is still known."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Iterator

from . import console

if TYPE_CHECKING:
    from rich.progress import Progress

#: a transfer of this many bytes or fewer draws no bar
PROGRESS_ABOVE_BYTES = 1 << 20


@contextlib.contextmanager
def cancel_on_ctrl_c(stopping: str = "the uploads") -> Iterator[threading.Event]:
    """An event the first Ctrl-C sets instead of raising KeyboardInterrupt, so that the
    uploads (or `stopping`) running in worker threads stop at their next chunk and each
    host's outcome is still known; a second Ctrl-C raises as usual."""
    cancel = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        cancel.set()
        signal.signal(signal.SIGINT, previous)
        console.say(f"interrupting: stopping {stopping} (Ctrl-C again to quit at once)")

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def transfer_bars() -> Iterator[Progress | None]:
    """One live display for every transfer's bar (deploy's uploads, to hosts in parallel,
    and pull's download; rich before 14.1 allows one live display per console), gone when
    the block ends however it ends; None off a terminal."""
    if not console.human.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn  # a terminal's only

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=console.human, transient=True) as bars:
        yield bars
