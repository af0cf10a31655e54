"""`evaluate.drafter: run:RUN`: the export of a run on the launch's host, found by the CLI
as the launch starts (docs/jobs.md "job: evaluate"); the host gets the folder's path."""
from __future__ import annotations

import dataclasses

from dflash_train.config import JobConfig

from . import console, run_names
from .errors import DflashError, ExitCode
from .session import Session

RUN_FORM = "run:"


def resolved(session: Session, host_name: str, config: JobConfig) -> JobConfig:
    """`config` with `evaluate.drafter: run:RUN` made the export folder of that run on
    `host_name` (RUN: a run id, a unique prefix or a run's name, as for every verb);
    refused (exit 2) when that host holds no such run, or the run no export yet."""
    if config.evaluate is None or not config.evaluate.drafter.startswith(RUN_FORM):
        return config
    text = config.evaluate.drafter[len(RUN_FORM):]
    try:
        ref = run_names.find(session, text, host_name)
    except DflashError as exc:
        raise DflashError(f"evaluate.drafter {config.evaluate.drafter!r}: {exc.message}", exc.exit_code,
                          hint=exc.hint) from exc
    status = session.agent(host_name).run_status(ref.run_id)
    if status.export is None:
        raise DflashError(f"evaluate.drafter {config.evaluate.drafter!r}: run {ref.run_id} on {host_name} has no "
                          f"export yet ({status.state}: a run exports when its training ends)", ExitCode.USAGE)
    console.say(f"evaluate.drafter: the export of run {ref.run_id}, {status.export} on {host_name}")
    return dataclasses.replace(config, evaluate=dataclasses.replace(config.evaluate, drafter=status.export))
