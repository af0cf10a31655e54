"""dflash fetch-traceback: the complete traceback of the thread that failed first."""
from __future__ import annotations

import json
import re
from pathlib import Path

from .. import console
from ..errors import DflashError, ExitCode
from ..local_state import RunLogs, RunRef
from ..session import Session

_THREAD_TAG = re.compile(r"^\S+ \[([^\]]+)\] ")


def header(record: dict, ref: RunRef) -> str:
    step = f" at step {record['step']}" if record.get("step") is not None else ""
    return (f"==> run {ref.run_id} on {ref.host}: thread {record.get('thread')} failed in "
            f"{record.get('phase')}{step} at {console.utc_time(record.get('ts', 0), 'milliseconds')} "
            f"({record.get('exc_type')}) <==\n")


def render_record(record: dict, ref: RunRef) -> str:
    """Header line, then the traceback text exactly as the thread formatted it (or, for
    a line of errors.jsonl that is not JSON, that line as it is)."""
    text = record.get("traceback", record.get("raw", ""))
    return header(record, ref) + text + ("" if text.endswith("\n") else "\n")


def render_no_record(report: dict, ref: RunRef) -> str:
    """What is known about a run that died without writing an error record."""
    out = [f"==> run {ref.run_id} on {ref.host}: no error record; state {report.get('state')} <==\n"]
    exit_info = report.get("exit")
    if exit_info:
        cause = (f"killed by {exit_info['signal']}" if exit_info.get("signal")
                 else f"exit code {exit_info.get('exit_code')}")
        if exit_info.get("oom_killed"):
            cause += " (the kernel's OOM killer)"
        out.append(f"process ended: {cause} at {console.utc_time(exit_info.get('ended_at'))}\n")
        out.append("exit.json: " + json.dumps(exit_info, sort_keys=True) + "\n")
    else:
        out.append("exit.json: absent (the supervisor did not record an exit)\n")
    fault = (report.get("faulthandler") or "").strip()
    if fault:
        out.append("--- faulthandler.log ---\n" + fault + "\n")
    by_thread: dict[str, list[str]] = {}
    for line in (report.get("log_tail") or "").splitlines():
        match = _THREAD_TAG.match(line)
        by_thread.setdefault(match.group(1) if match else "(untagged)", []).append(line)
    for thread, lines in by_thread.items():
        out.append(f"--- train.log, last lines of {thread} ---\n" + "\n".join(lines[-40:]) + "\n")
    return "".join(out)


def run(session: Session, ref: RunRef, thread: str | None, all_records: bool,
        output: Path | None) -> ExitCode:
    report = session.agent(ref.host).call("report", "--run-id", ref.run_id)
    records = report.get("errors", [])  # in file order: appended as threads failed
    logs = RunLogs(session.logs_dir, ref)
    if records:
        logs.save_errors(records)
        logs.save_traceback(records[0].get("traceback", ""))
    if thread:
        records = [r for r in records if r.get("thread") == thread]
        if not records:
            raise DflashError(f"run {ref.run_id}: no error record from thread {thread!r}",
                              ExitCode.USAGE)
    if records:
        text = "".join(render_record(r, ref) for r in (records if all_records else records[:1]))
        code = ExitCode.OK
    elif report.get("state") in ("FAILED", "LOST"):
        text, code = render_no_record(report, ref), ExitCode.RUN_FAILED
    else:
        console.say(f"run {ref.run_id} on {ref.host}: no error recorded (state {report.get('state')})")
        return ExitCode.OK
    if output:
        try:
            output.write_text(text, encoding="utf-8", errors="surrogateescape")
        except OSError as exc:
            raise DflashError(f"-o {output}: cannot write it ({exc.strerror or exc})", ExitCode.USAGE) from exc
        console.say(f"written to {output}")
    else:
        console.remote_text(text)
    return code
