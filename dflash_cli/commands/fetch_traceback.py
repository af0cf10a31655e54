"""dflash fetch-traceback: the complete traceback of the thread that failed first, or,
for a run that recorded no error (hung, stopped, killed), the stacks of every thread."""
from __future__ import annotations

import dataclasses
from pathlib import Path


from dflash_contract import requests
from dflash_contract.records import attempt_errors
from dflash_contract.replies import ReportReply
from dflash_contract.states import RunState

from .. import console, diagnosis, multihost, run_hosts
from ..errors import BadOption, DflashError, ExitCode
from ..local_state import RunLogs, RunRef
from ..session import Session
from ..tracebacks import render_no_record, render_record

# A run that ended with nobody recording why: what its host knows is shown instead.


def render_stacks(session: Session, ref: RunRef, report: ReportReply) -> str | None:
    """Every thread's stack, named, under a one-line header: a fresh dump of a live run
    (the agent's `stacks`: SIGUSR1 to the trainer, whose faulthandler writes even while
    a hung thread holds the GIL), else the last dump in faulthandler.log; None when the
    run ended without leaving one. `report` is the agent's report of the run."""
    state = report.state
    if not state.terminal:  # the trainer lives: it dumps its stacks now
        where, text = "dumped now", session.agent(ref.host).call(requests.Stacks(ref.run_id)).text
    else:
        where, text = "the last dump in faulthandler.log", report.last_stacks
        if not text.strip():
            return None
    return (f"==> run {ref.run_id} on {ref.host}: stacks of every thread, {where} (state {state}) <==\n"
            + text + ("" if text.endswith("\n") else "\n"))


def _reports(session: Session, ref: RunRef) -> dict[str, ReportReply]:
    """The agent's report of every host of the run, asked in parallel, in rank order. A
    host that cannot be asked is an error for a run on one host; on several, it is
    named and left out (as is one that left the inventory), unless no host answers."""
    hosts, left = run_hosts.members(session, ref)
    replies = {**session.on_each_host(hosts, lambda host: session.agent(host.name).call(
        requests.Report(ref.run_id))), **left}
    reports = {}
    for member in ref.members:
        reply = replies[member.host]
        if isinstance(reply, DflashError):
            if not ref.multihost or all(isinstance(r, DflashError) for r in replies.values()):
                raise reply
            console.warn(f"run {ref.run_id} on {member.host}: no report: {reply.message}")
        else:
            reports[member.host] = reply
    return reports


@dataclasses.dataclass(frozen=True)
class Traceback:
    """What `fetch-traceback` found of a run. `text`: what it prints on stdout, the
    records' tracebacks under their headers, what is known of a run that failed without
    one, or every thread's stacks (None: nothing recorded). `root_cause`: (host, record)
    of the root cause shown (docs/errors.md), `diagnosis` its line for a failure dflash
    knows, `summary` the line naming the root cause's host of a run on several.
    `explained`: False for a failed run that no record explains (exit 1)."""
    run_id: str
    hosts: tuple[str, ...]  # the hosts whose report was read
    state: RunState | None
    text: str | None
    root_cause: tuple[str, dict] | None = None
    diagnosis: str | None = None
    summary: str | None = None
    explained: bool = True
    stacks: bool = False  # `text` is every thread's stacks (or there is no dump)


@dataclasses.dataclass(frozen=True)
class Fetched:
    """`fetch-traceback`: what `find` found, and the file its text was written to (-o;
    None: printed)."""
    traceback: Traceback
    written_to: Path | None = None


def fetch(session: Session, ref: RunRef, *, thread: str | None = None, all_records: bool = False,
          stacks: bool = False, output: Path | None = None) -> Fetched:
    """`find`, its text written to `output` where one is given and there is text."""
    found = find(session, ref, thread=thread, all_records=all_records, stacks=stacks)
    if output is None or found.text is None:
        return Fetched(found)
    _write(output, found.text)
    return Fetched(found, output)


def _write(output: Path, text: str) -> None:
    try:
        output.write_text(text, encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise DflashError(f"-o {output}: cannot write it ({exc.strerror or exc})", ExitCode.USAGE) from exc


def find(session: Session, ref: RunRef, *, thread: str | None = None, all_records: bool = False,
         stacks: bool = False) -> Traceback:
    """The root cause's traceback, for a run on one host or on several: there the root
    cause is the earliest record that is not a rank stopping for a peer's failure
    (PeerFailed), on whichever host it is, and the summary names that host. The records
    are kept under logs/<host>/<run>/ (errors.jsonl, traceback.txt)."""
    if stacks and (thread or all_records):
        raise BadOption("{stacks} shows every thread's stack; it does not combine with "
                        "{thread} or {all_records}", "stacks", "thread", "all_records")
    reports = _reports(session, ref)
    every = {host: list(report.errors) for host, report in reports.items()}  # file order, attempt after attempt
    # The state is the latest attempt's, and so is the root cause; --all shows earlier attempts' too.
    attempts = {host: report.run.attempt_number for host, report in reports.items()}
    latest = {host: attempt_errors(records, attempts[host]) for host, records in every.items()}
    for host, records in every.items():
        logs = RunLogs(session.logs_dir, RunRef(host, ref.run_id))
        if records:
            logs.save_errors(records)
        if latest[host]:
            logs.save_traceback(multihost.root_cause([(host, r) for r in latest[host]])[1].traceback or "")
    records = multihost.in_time_order(every if all_records else latest)
    several_attempts = any(attempt > 0 for attempt in attempts.values())
    if thread:
        threads = sorted({str(r.thread) for _, r in records})
        records = [(host, r) for host, r in records if r.thread == thread]
        if not records:
            have = (f"threads with records: {', '.join(threads)}" if threads else
                    "no thread has a record" + ("" if all_records else " in the latest attempt (--all: every one)"))
            raise DflashError(f"run {ref.run_id}: no error record from thread {thread!r}; {have}",
                              ExitCode.USAGE)
    state = multihost.aggregate_state({host: report.state for host, report in reports.items()})
    found = Traceback(ref.run_id, tuple(reports), state, None)
    if stacks or (not records and state is not None and state.told_by_stacks):
        # A hang records no error: where every thread is (now, or at the last dump) is the
        # diagnosis.
        texts = [render_stacks(session, RunRef(host, ref.run_id), report) for host, report in reports.items()]
        return dataclasses.replace(found, text="".join(t for t in texts if t) or None, stacks=True)
    if not records:
        if state is None or not state.failed:
            return found
        text = "".join(render_no_record(report, RunRef(host, ref.run_id)) for host, report in reports.items()
                       if report.state is not None and report.state.failed)
        return dataclasses.replace(found, text=text, explained=False)
    cause = multihost.root_cause(records)
    latest_cause = multihost.root_cause(multihost.in_time_order(latest))
    # No rank recorded its own failure: the one that died or went silent is the cause.
    blamed = multihost.blamed_host(latest_cause, ref.hosts) if ref.multihost and latest_cause else None
    summary = None
    explained = True
    if blamed in reports and not all_records:
        summary = (f"root cause on {blamed} (rank {ref.hosts.index(blamed)} of {len(ref.hosts)}): "
                   + multihost.blamed_line(ref.hosts, reports[blamed].exit, latest_cause, latest[blamed]))
        text = render_no_record(reports[blamed], RunRef(blamed, ref.run_id), of_its_own=bool(latest[blamed]))
        explained = False  # as for a run without a record: no traceback says why
    else:
        if ref.multihost and not all_records:
            summary = f"root cause on {cause[0]} (rank {ref.hosts.index(cause[0])} of {len(ref.hosts)})"
        text = "".join(render_record(r, RunRef(host, ref.run_id), several_attempts)
                       for host, r in (records if all_records else [cause]))
    if all_records:  # and what is known of each host whose latest attempt failed without a record
        text += "".join(render_no_record(report, RunRef(host, ref.run_id), of_its_own=bool(latest[host]))
                        for host, report in reports.items()
                        if report.state is not None and report.state.failed and (not latest[host] or host == blamed))
    diagnosed = latest_cause or cause  # the latest attempt's root cause shown
    line = diagnosis.diagnose(diagnosis.Failure(diagnosed[1], ref.run_id, diagnosed[0], _run_hosts(ref, reports)))
    return dataclasses.replace(found, text=text, root_cause=diagnosed, diagnosis=line, summary=summary,
                               explained=explained)


def _run_hosts(ref: RunRef, reports: dict[str, ReportReply]) -> tuple[str, ...]:
    """The run's hosts in rank order, also when asked for one host's part (--host): from
    the run.json of a host of a run on several (its `distributed`)."""
    for report in reports.values():
        hosts = report.run.distributed.hosts if report.run.distributed else None
        if hosts:
            return tuple(hosts)
    return ref.hosts
