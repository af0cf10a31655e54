"""The `status` and `report` verbs: what the CLI shows and what fetch-traceback needs."""
from __future__ import annotations

import os
from typing import Optional


from dflash_contract.replies import ReportReply, StatusReply, UnreadableRun

from . import stackdump
from .jsonio import decode_bytes, read_tail_text
from .layout import RunDir, Workspace
from .state import UnreadableRecord, agent_error, derive_state, error_records, observe, read_record, run_status

FAULTHANDLER_MAX_BYTES = 4 * 1024 * 1024


def status(ws: Workspace, run_id: Optional[str], with_config: bool = False) -> StatusReply:
    if run_id is not None:
        return StatusReply(runs=(run_status(ws.existing_run(run_id), with_config, verify=True),))
    runs = []
    unreadable = []
    for run in ws.all_runs():
        try:
            runs.append(run_status(run))
        except FileNotFoundError:
            continue  # removed while we looked
        except UnreadableRecord as exc:  # named; the other runs are listed all the same
            unreadable.append(UnreadableRun(run_id=run.run_id, path=run.run_json, error=exc.problem))
    runs.sort(key=lambda r: (r.started_at or 0.0, r.run_id), reverse=True)
    return StatusReply(runs=tuple(runs), unreadable=tuple(sorted(unreadable, key=lambda u: u.run_id)) or None)


def _read_end(path: str, max_bytes: int) -> str:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - max_bytes))
            return decode_bytes(handle.read())
    except FileNotFoundError:
        return ""


def report(run: RunDir, log_lines: int) -> ReportReply:
    record = read_record(run)
    obs = observe(run, record)
    faulthandler = stackdump.name_threads(_read_end(run.faulthandler, FAULTHANDLER_MAX_BYTES),
                                          stackdump.thread_names(run))
    return ReportReply(
        run_id=run.run_id,
        state=derive_state(obs),
        run=record,
        exit=obs.exit,
        errors=tuple(error_records(run.errors)),
        faulthandler=faulthandler,
        last_stacks=stackdump.last_dump(faulthandler),
        log_tail=read_tail_text(run.train_log, log_lines),
        agent_error=agent_error(run, record),
    )

