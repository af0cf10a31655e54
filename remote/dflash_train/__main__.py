"""python -m dflash_train --config FILE --run-dir DIR

The config's `job` picks the work: train (the threaded trainer) or evaluate (evaluation.py).

Logging, errors.jsonl, events.jsonl and faulthandler are set up before torch or
transformers is imported, so their output is prefixed too and a crash while importing
them still leaves stacks in faulthandler.log.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import threading
from pathlib import Path

from .runlog import ErrorLog, EventLog, ThreadNames, install_line_writers, say


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_train",
                                     description="Train a DFlash drafter, or evaluate one (job: evaluate).")
    parser.add_argument("--config", required=True, help="training config (YAML)")
    parser.add_argument("--run-dir", required=True, help="the run directory (DESIGN.md layout)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    writers = install_line_writers()
    threading.main_thread().name = "coordinator"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # \r-redrawn bars are not log lines
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    events = EventLog(run_dir / "events.jsonl")
    errors = ErrorLog(run_dir / "errors.jsonl")
    thread_names = ThreadNames(run_dir / "threads.json")
    thread_names.add(threading.main_thread())
    fault_log = open(run_dir / "faulthandler.log", "a", encoding="utf-8")  # kept open for the process's life
    faulthandler.enable(file=fault_log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=fault_log, all_threads=True, chain=False)
    say(f"dflash_train pid {os.getpid()} run dir {run_dir} config {args.config}")

    from .config import load_train_config
    from .threads import RunState, install_excepthook

    state = RunState(errors, thread_names)
    install_excepthook(state)
    try:
        config = load_train_config(args.config)
        from transformers.utils import logging as hf_logging

        from .coordinator import Coordinator, install_signal_handlers
        from .evaluation import EvaluationJob
    except BaseException as exc:  # noqa: BLE001 - a bad config or a broken install is this run's failure too
        state.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(), phase="startup", step=None)
        finish(events, writers, fault_log, 1, [])

    hf_logging.disable_progress_bar()
    if config.job == "evaluate":  # one drafter measured in this thread: no worker threads
        job = EvaluationJob(config, run_dir, events, state)
        install_signal_handlers(job)
        finish(events, writers, fault_log, job.run(), [])
    coordinator = Coordinator(config, run_dir, events, state, fault_log)
    install_signal_handlers(coordinator)
    finish(events, writers, fault_log, coordinator.run(), coordinator.alive)


def finish(events: EventLog, writers, fault_log, code: int, alive: list[str]) -> None:
    """Report and leave at once: os._exit, because a hung daemon thread must not be able to
    delay or crash interpreter shutdown."""
    events.emit("done", exit_code=code, threads_alive=alive)
    say(f"exit code {code}")
    for writer in writers:
        writer.flush_all()
    fault_log.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
