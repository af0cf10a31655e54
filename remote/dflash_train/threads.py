"""Threads that never die silently, and the blocking primitives they share.

Every worker body runs inside `JobThread.run`: any exception becomes an errors.jsonl
record (written, flushed and fsynced by the failing thread itself), a log entry with
the full traceback, and the run's first failure, which sets the stop event. Blocking
calls (queues, the gradient barrier) wake up on the stop event, so a failure anywhere
ends the run within seconds instead of hanging it.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable, Generic, TypeVar

from .runlog import ErrorLog, ThreadNames, error_record, say

T = TypeVar("T")


class StopRequested(Exception):
    """Raised inside a worker when the run is stopping; ends the thread without an error."""


class DrafterStartupError(RuntimeError):
    """A drafter failed before it was ready; raised `from` the drafter's own exception."""


class StopLatch:
    """The run's stop latch, shared by all threads: set once (by a signal, the end of the
    run, a peer, or the first failure, which it records) and never reset; every blocking
    call wakes on it. Also counts progress, which gates heartbeats."""

    def __init__(self, errors: ErrorLog, thread_names: ThreadNames):
        self.errors = errors
        self.thread_names = thread_names
        self.stop = threading.Event()
        self.stop_reason: str | None = None
        self.failure: tuple[str, BaseException] | None = None
        self._lock = threading.Lock()
        self._progress = 0
        self._on_stop: list[Callable[[], None]] = []

    def request_stop(self, reason: str) -> None:
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
            callbacks = list(self._on_stop)
        self.stop.set()
        for callback in callbacks:
            callback()

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the stop event is set (e.g. to break a barrier)."""
        with self._lock:
            self._on_stop.append(callback)
        if self.stop.is_set():
            callback()

    def progressed(self) -> None:
        """A thread finished a unit of work; heartbeats are only sent while this moves."""
        with self._lock:
            self._progress += 1

    @property
    def progress(self) -> int:
        return self._progress

    def record_failure(self, exc: BaseException, *, thread: str, thread_ident: int | None,
                       phase: str, step: int | None) -> None:
        """Write the errors.jsonl record first (the root cause must survive whatever
        happens next), then log it, then stop the run. A record that cannot be written
        (the disk full even after the reserve went to an earlier one) is said in the
        log: the run stops all the same."""
        try:
            self.errors.append(error_record(exc, thread=thread, thread_ident=thread_ident,
                                            phase=phase, step=step))
        except OSError as write_error:
            say(f"the error record of thread {thread} could not be written: {write_error}")
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        say(f"thread {thread} failed in phase {phase} at step {step}:\n{text}")
        with self._lock:
            if self.failure is None:
                self.failure = (thread, exc)
        self.request_stop(f"{thread} failed")

    def check(self) -> None:
        if self.stop.is_set():
            raise StopRequested(self.stop_reason or "stop requested")


class JobThread(threading.Thread):
    """A daemon thread whose body failures are recorded, never lost.

    `phase` and `step` are updated by the body and land in the error record.
    """

    def __init__(self, name: str, latch: StopLatch, body: Callable[["JobThread"], None]):
        super().__init__(name=name, daemon=True)
        self.latch = latch
        self.body = body
        self.phase = "startup"
        self.step: int | None = None
        self.done = threading.Event()  # set however the body ends
        self.failed: BaseException | None = None
        self._ready = threading.Event()  # set by the body only
        # Ready or ended, whichever comes first: what wait_until_ready wakes on. A body
        # with nothing left to do (a resume at the last step) may end as soon as it is
        # ready, before the waiter looks: that is no failure to start.
        self._settled = threading.Event()

    def mark_ready(self) -> None:
        self._ready.set()
        self._settled.set()

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def run(self) -> None:
        try:
            self.latch.thread_names.add(self)
            self.body(self)
        except StopRequested:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure is recorded, whatever its type
            self.failed = exc
            self.latch.record_failure(exc, thread=self.name, thread_ident=self.ident,
                                      phase=self.phase, step=self.step)
        finally:
            self.done.set()
            self._settled.set()  # wake wait_until_ready, which then reports how it ended

    def wait_until_ready(self, timeout: float, poll: Callable[[], None] = lambda: None) -> None:
        """Block until the thread signalled ready; re-raise its own failure, chained.
        `poll` runs every 0.1 s meanwhile (the coordinator's signals and heartbeats)."""
        deadline = time.monotonic() + timeout
        while not self._settled.wait(0.1):
            poll()
            if self.latch.stop.is_set() and self.latch.failure is None:
                raise StopRequested(self.latch.stop_reason or "stop requested")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} was not ready after {timeout:.0f}s (phase {self.phase})")
        if self.failed is not None:
            raise DrafterStartupError(
                f"{self.name} failed during {self.phase}: "
                f"{type(self.failed).__name__}: {self.failed}") from self.failed
        if not self._ready.is_set():
            raise StopRequested(f"{self.name} ended before it was ready")


class StoppableQueue(Generic[T]):
    """A bounded queue whose blocking calls give up when the run stops.

    `get` returns the item and the seconds spent waiting for it (a pipeline metric).
    """

    def __init__(self, name: str, maxsize: int, latch: StopLatch, poll_s: float):
        self.name = name
        self._queue: queue.Queue[T] = queue.Queue(maxsize)
        self._latch = latch
        self._poll_s = poll_s

    def put(self, item: T) -> float:
        start = time.perf_counter()
        while True:
            self._latch.check()
            try:
                self._queue.put(item, timeout=self._poll_s)
                return time.perf_counter() - start
            except queue.Full:
                continue

    def get(self) -> tuple[T, float]:
        start = time.perf_counter()
        while True:
            self._latch.check()
            try:
                item = self._queue.get(timeout=self._poll_s)
                return item, time.perf_counter() - start
            except queue.Empty:
                continue

    def depth(self) -> int:
        return self._queue.qsize()


class Rendezvous:
    """All data-parallel replicas of the process meet here every step to average gradients.

    `exchange(replica, value, combine)` blocks until every replica posted its value; the
    lead (replica 0) computes `combine(values)` (index = replica) and every replica gets
    its entry of the result. The barrier is broken when the run stops, so a replica
    waiting for a dead peer (or for a lead that failed) wakes up instead of hanging.
    """

    def __init__(self, parties: int, latch: StopLatch):
        self._barrier = threading.Barrier(parties)
        self._slots: list[Any] = [None] * parties
        self._result: list[Any] = []
        latch.on_stop(self._barrier.abort)
        self._latch = latch

    def exchange(self, replica: int, value: T, combine: Callable[[list[T]], list[Any]]) -> Any:
        self._slots[replica] = value
        self._wait()
        if replica == 0:
            self._result = combine(list(self._slots))
        # Nobody posts the next step's value before the lead has read them all, and the
        # lead writes the next result only after every replica posted again (so has read this one).
        self._wait()
        return self._result[replica]

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            self._latch.check()
            raise


def install_excepthook(latch: StopLatch) -> None:
    """Safety net for threads not started through JobThread (e.g. a library's own threads)."""

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:
            return
        thread = args.thread
        latch.record_failure(args.exc_value, thread=thread.name if thread else "unknown",
                             thread_ident=thread.ident if thread else None,
                             phase=getattr(thread, "phase", "unknown"), step=getattr(thread, "step", None))

    threading.excepthook = hook
