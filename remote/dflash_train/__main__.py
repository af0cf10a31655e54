"""python -m dflash_train --config FILE --run-dir DIR: the job the config names (`job:`).

Logging, errors.jsonl, events.jsonl and faulthandler are set up before torch or
transformers is imported, so their output is prefixed too and a crash while importing
them still leaves stacks in faulthandler.log.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import os
import signal
import threading
import time
from pathlib import Path


from dflash_contract.names import ERRORS_JSONL, EVENTS_JSONL

from .runlog import ErrorLog, EventLog, ThreadNames, emit_done, install_line_writers, say
from . import startup_phases
from .startup_phases import process_age_s, record, record_to, start_pulse

_LOADED = time.monotonic()  # when /proc cannot tell the process's start

# config.job -> (module, class) of the job's coordinator: built with (config, run_dir, events,
# latch, fault_log), `run()` returns the exit code, `on_signal` and `alive` as Coordinator's.
JOBS = {"train": (".jobs.coordinator", "Coordinator"), "regenerate": (".jobs.regenerate", "Regeneration"),
        "evaluate": (".jobs.evaluation", "EvaluationJob")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_train",
                                     description="Run the job of a config: train a DFlash drafter, regenerate data, or evaluate a drafter.")
    parser.add_argument("--config", required=True, help="the job's config (YAML)")
    parser.add_argument("--run-dir", required=True, help="the run directory (docs/layout.md)")
    parser.add_argument("--resume-from", metavar="CHECKPOINT",
                        help="resume from this checkpoint folder instead of the config's checkpoint.resume "
                             "(the agent passes it to a resumed or restarted attempt; on rank > 0 of a run on several "
                             "hosts it only says that the run resumes: rank 0 sends its checkpoint)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    writers = install_line_writers()
    threading.main_thread().name = "coordinator"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # \r-redrawn bars are not log lines
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    events = EventLog(run_dir / EVENTS_JSONL)
    record_to(events)
    start_pulse()
    errors = ErrorLog(run_dir / ERRORS_JSONL)
    thread_names = ThreadNames(run_dir / "threads.json")
    thread_names.add(threading.main_thread())
    fault_log = open(run_dir / "faulthandler.log", "a", encoding="utf-8")  # kept open for the process's life
    faulthandler.enable(file=fault_log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=fault_log, all_threads=True, chain=False)
    say(f"dflash_train pid {os.getpid()} run dir {run_dir} config {args.config}")

    from .config import load_job_config
    from .threads import StopLatch, install_excepthook

    latch = StopLatch(errors, thread_names)
    install_excepthook(latch)
    try:
        config = load_job_config(args.config)
        if args.resume_from is not None:
            config = dataclasses.replace(
                config, checkpoint=dataclasses.replace(config.checkpoint, resume=args.resume_from))
        from transformers.utils import logging as hf_logging

        from .jobs.common import install_signal_handlers
        module, name = JOBS[config.job]
        job_class = getattr(importlib.import_module(module, __package__), name)
        # From the process's start: the interpreter's own start and torch's and transformers' imports.
        age = process_age_s()
        if startup_phases.warm_import_s is not None:  # forked after the imports (warm.py)
            record("import", age if age is not None else 0.0, since="warm interpreter",
                   warm_import_s=startup_phases.warm_import_s)
        else:
            record("import", age if age is not None else time.monotonic() - _LOADED,
                   since="process start" if age is not None else "trainer start")
    except BaseException as exc:  # noqa: BLE001 - a bad config or a broken install is this run's failure too
        latch.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(), phase="startup", step=None)
        finish(events, errors, writers, fault_log, 1, [])

    hf_logging.disable_progress_bar()
    coordinator = job_class(config, run_dir, events, latch, fault_log)
    install_signal_handlers(coordinator)
    finish(events, errors, writers, fault_log, coordinator.run(), coordinator.alive)


def finish(events: EventLog, errors: ErrorLog, writers, fault_log, code: int, alive: list[str]) -> None:
    """Report and leave at once: os._exit, because a hung daemon thread must not be able to
    delay or crash interpreter shutdown. Nothing written here may keep it from exiting
    with `code`: on a full disk the `done` event is said to be missing, in the log."""
    startup_phases.end_pulse()  # a start-up that failed ends with its run
    emit_done(events, code, alive)
    say(f"exit code {code}")
    for writer in writers:
        writer.flush_all()
    try:
        fault_log.flush()
    except OSError:
        pass  # faulthandler.log is best effort; its dumps are written past this buffer anyway
    errors.reserve.release()  # the process is done with it
    os._exit(code)


if __name__ == "__main__":
    main()
