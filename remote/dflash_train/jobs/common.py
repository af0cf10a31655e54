"""What every job (`job:` train, regenerate, evaluate) takes from one place: its main
thread's signals, phases and heartbeats (JobControl), the exit codes, the error for a
failed worker and the report of threads that outlived a stop, and what a job finds before
it loads anything (the target, the data files, the CPU threads, the tokens that end an
answer).

Each job's coordinator (coordinator.Coordinator, regenerate.Regeneration,
evaluation.EvaluationJob; __main__.JOBS) is a JobControl built with (config, run_dir,
events, latch, fault_log); its `run()` returns the exit code: EXIT_OK, EXIT_FAILED, or
128+signal when stopped by SIGTERM or SIGINT.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from dflash_contract.events import HEARTBEAT, PHASE

from .. import startup_phases
from ..config import JobConfig, cache_root, resolve_path
from ..data.tiny import TARGET_DATA, ensure_tiny_assets
from ..runlog import EventLog, dump_header, emit_done, say
from ..threads import StopLatch

EXIT_OK, EXIT_FAILED = 0, 1


class JobControl:
    """What the main thread of every job does alike: it notes a signal in the handler and
    acts on it in its own loop, names its phase, and sends heartbeats while the run makes
    progress."""

    def __init__(self, events: EventLog, latch: StopLatch, heartbeat_s: float):
        self.events, self.latch, self.heartbeat_s = events, latch, heartbeat_s
        self.phase = "startup"
        self._signal: int | None = None
        self._heartbeat = (0.0, -1)  # (time, progress) of the last heartbeat

    def on_signal(self, signum: int, frame) -> None:
        """Only note it: the handler runs between two bytecodes of the main thread, which
        may hold a lock that stopping the run needs. `act_on_signal` acts on it."""
        self._signal = signum

    def act_on_signal(self, stopping: str) -> None:
        """Stop the run once for a noted signal; `stopping` says how, in the log line."""
        if self._signal is not None and not self.latch.stop.is_set():
            say(f"received {signal.Signals(self._signal).name}: {stopping}")
            self.latch.request_stop(signal.Signals(self._signal).name)

    def heartbeat_if_due(self, **fields: Any) -> None:
        """A heartbeat event with `fields`, at most every heartbeat_s and only after progress."""
        now, progress = time.monotonic(), self.latch.progress
        last_time, last_progress = self._heartbeat
        if progress != last_progress and now - last_time >= self.heartbeat_s:
            self.heartbeat(**fields)

    def heartbeat(self, **fields: Any) -> None:
        """A heartbeat event now, whenever the last one was."""
        self.events.emit(HEARTBEAT, **fields)
        self._heartbeat = (time.monotonic(), self.latch.progress)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.events.emit(PHASE, phase=phase)
        if phase != "startup":
            startup_phases.end_pulse()


class ThreadFailed(RuntimeError):
    """The coordinator's own error when a worker failed; chained from the worker's exception."""


def report_threads_still_running(alive: list[str], grace_s: float, fault_log) -> None:
    """Say which threads outlived the stop and dump every thread's stack to faulthandler.log."""
    if not alive:
        return
    say(f"threads still running after {grace_s:.0f}s: {', '.join(alive)}; their stacks are in faulthandler.log")
    try:
        fault_log.write(dump_header(f"threads still running after the stop: {', '.join(alive)}"))
        fault_log.flush()  # faulthandler writes to the descriptor, past this buffer
    except OSError:
        pass  # a full disk: the dump below is written (or not) all the same, the exit must not wait
    faulthandler.dump_traceback(file=fault_log, all_threads=True)


def end_now(events: EventLog, fault_log, grace_s: float, code: int) -> None:
    """A peer ended the run, and this process did not follow (its main thread is in a
    startup step that does not look at the stop event): stacks, the done event, exit."""
    alive = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    report_threads_still_running(alive, grace_s, fault_log)
    startup_phases.end_pulse()
    emit_done(events, code, alive)
    os._exit(code)


def install_signal_handlers(job) -> None:
    """`job`: the job's coordinator, whose on_signal notes the signal for its main loop."""
    signal.signal(signal.SIGTERM, job.on_signal)
    signal.signal(signal.SIGINT, job.on_signal)


def torch_threads(config: JobConfig) -> int:
    """Intra-op threads: the cores divided among the threads that compute on the CPU at once."""
    if config.runtime.torch_threads is not None:
        return config.runtime.torch_threads
    cores = len(os.sched_getaffinity(0))
    if not config.devices.cpu_only:
        return min(cores, 8)
    busy = 1 if config.pipeline.mode == "sequential" else (
        len(config.devices.drafters) + len(config.devices.target) + (1 if config.eval.num_prompts else 0))
    return max(1, cores // busy)


def sources(config: JobConfig, run_dir: Path) -> tuple[str, Path | None, Path | None]:
    """(target folder or hub id, train jsonl, eval jsonl); the jsonl files None when not
    given (an evaluate job may have no data section, a regenerate job has none)."""
    data = config.data
    train = resolve_path(data.train) if data is not None and data.train else None
    evaluation = resolve_path(data.eval) if data is not None and data.eval else None
    if config.target.tiny is not None:
        # The tiny target is built with synthetic data; a data.train file (say, what job:
        # regenerate wrote with this same target) takes the synthetic samples' place.
        synthetic = data.synthetic if data is not None and data.synthetic is not None else TARGET_DATA
        assets = ensure_tiny_assets(config.target.tiny, synthetic, cache_root(run_dir))
        return str(assets.target_dir), train or assets.train_path, evaluation or assets.eval_path
    assert config.target.path is not None
    folder = resolve_path(config.target.path)
    # A path that is not there locally may be a hub id, found in the host's HF cache.
    target = str(folder) if folder.exists() else config.target.path
    return target, train, evaluation


def stop_ids(tokenizer) -> set[int]:
    """The tokens that end an answer: the tokenizer's end of sequence and Qwen's end of turn."""
    return {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
            if i is not None and i != tokenizer.unk_token_id}
