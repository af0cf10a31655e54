"""Error records and what is known of a run that left none, as people read them
(`fetch-traceback`, `watch`): the traceback under a one-line header, and exit.json,
the last stack dump and log lines by thread instead."""
from __future__ import annotations

import json
import re


from dflash_contract.records import ErrorRecord
from dflash_contract.replies import ReportReply

from . import console
from .local_state import RunRef

_THREAD_TAG = re.compile(r"^\S+ \[([^\]]+)\] ")


def header(record: ErrorRecord, ref: RunRef, several_attempts: bool = False) -> str:
    step = f" at step {record.step}" if record.step is not None else ""
    if several_attempts:
        step += f" of attempt {record.attempt or 0}"
    return (f"==> run {ref.run_id} on {ref.host}: thread {record.thread} failed in "
            f"{record.phase}{step} at {console.utc_time(record.ts or 0, 'milliseconds')} "
            f"({record.exc_type}) <==\n")


def render_record(record: ErrorRecord, ref: RunRef, several_attempts: bool = False) -> str:
    """Header line, then the traceback text exactly as the thread formatted it (or, for
    a line of errors.jsonl that is not JSON, that line as it is)."""
    text = record.traceback if record.traceback is not None else record.raw or ""
    return header(record, ref, several_attempts) + text + ("" if text.endswith("\n") else "\n")


def render_no_record(report: ReportReply, ref: RunRef, of_its_own: bool = False) -> str:
    """What is known about a run that died without writing an error record (`of_its_own`:
    none but records of stopping for a peer)."""
    out = [f"==> run {ref.run_id} on {ref.host}: no error record{' of its own' if of_its_own else ''}; "
           f"state {report.state} <==\n"]
    exit_info = report.exit
    if exit_info:
        out.append(f"process ended: {exit_info.ended_by()} at {console.utc_time(exit_info.ended_at)}\n")
        out.append("exit.json: " + json.dumps(exit_info.to_json(), sort_keys=True) + "\n")
    else:
        out.append("exit.json: absent (the supervisor did not record an exit)\n")
    if report.agent_error:
        out.append(f"agent.log, the supervisor's last error: {report.agent_error}\n")
    fault = report.last_stacks.strip()
    if fault:
        out.append("--- faulthandler.log, the last dump ---\n" + fault + "\n")
    by_thread: dict[str, list[str]] = {}
    for line in report.log_tail.splitlines():
        match = _THREAD_TAG.match(line)
        by_thread.setdefault(match.group(1) if match else "(untagged)", []).append(line)
    for thread, lines in by_thread.items():
        out.append(f"--- train.log, last lines of {thread} ---\n" + "\n".join(lines[-40:]) + "\n")
    return "".join(out)
