"""dflash status / dflash runs: run states as the agent derives them on the host."""
from __future__ import annotations

import json
import shlex


from dflash_contract import requests
from dflash_contract.replies import RunStatus
from dflash_contract.states import RunState

from .. import console, multihost, provenance, run_hosts
from ..errors import DflashError, ExitCode, exit_code_for_state
from ..local_state import RunRef, latest_host
from ..multihost import HostStatus, RunOnHosts
from ..release_store import ReleaseStore, change_since
from ..session import Session
from ..tables import Column, FittedTable

# Shown in this order; left out, at a narrow terminal, from the highest priority down.
_STATE = [Column("state", 1), Column("step", 2, wrap=True), Column("errors", 3), Column("started", 6),
          Column("ended", 8)]
_CHANGES = [Column("source", 4), Column("changed since previous run", 5, wrap=True)]


def runs_table(title: str, runs: list[RunStatus], changes: dict[str, dict] | None = None) -> FittedTable:
    """One row per run; with `changes` (run id -> change_since's record), two more
    columns: the source commit (`*`: uncommitted changes) and what changed since the run
    before."""
    columns = [Column("run", 0), *_STATE, Column("release", 7)] + (_CHANGES if changes is not None else [])
    rows = []
    for r in runs:
        cells = [r.run_id, *_status_cells(r.state, r)]
        if changes is not None:
            cells += [source_commit(r.source), changes.get(r.run_id, {}).get("text", "")]
        rows.append(cells)
    return FittedTable(title, columns, rows)


def hosts_table(title: str, hosts: list[HostStatus]) -> FittedTable:
    """One row per host of a run on several hosts; a host that could not be asked shows
    why in the release column."""
    rows = [[h.host, *(_status_cells(h.state, h.status) if h.status else
                       [multihost.UNKNOWN, "", "0", "", "", h.error or ""])] for h in hosts]
    return FittedTable(title, [Column("host", 0), *_STATE, Column("release", 4, wrap=True)], rows)


def _status_cells(state: RunState, status: RunStatus) -> list[str]:
    return [state.value, step_cell(status), str(status.errors), console.utc_time(status.started_at),
            console.utc_time(status.ended_at), status.release_id or ""]


def step_cell(status: RunStatus) -> str:
    """The step, or before the first one the start-up phase under way."""
    if status.step is not None:
        return str(status.step)
    if not status.startup:
        return ""
    elapsed = status.startup_elapsed_s
    return f"start-up: {status.startup}" + (f", {elapsed:.0f} s" if elapsed is not None else "")


def overrides_line(status: RunStatus) -> str | None:
    """`overrides: --set optim.lr=1e-4 --set …`, or None for a run launched without any."""
    return "overrides: " + " ".join(f"--set {o}" for o in status.overrides) if status.overrides else None


def source_commit(source: dict | None) -> str:
    """`1a2b3c4` for a clean checkout, `1a2b3c4*` with uncommitted changes, else `-`."""
    if not source or not source.get("git_commit"):
        return "-"
    return source["git_commit"][:7] + ("*" if source.get("dirty") else "")


def resume_point(status: RunStatus) -> str:
    """How much a resume would redo: the steps done since the newest checkpoint."""
    where = f"attempt {status.attempt} of {status.attempts}; " if status.attempts > 1 else ""
    done = status.step
    if done is None:
        done = status.resume_step  # this attempt has not finished a step yet
    newest = status.checkpoint_step
    intact = " intact" if status.corrupt_checkpoints else ""
    if newest is None:
        none = "no intact checkpoint" if status.corrupt_checkpoints else "no checkpoint yet"
        return (f"{where}{none}: a resume is not possible"
                + ("" if done is None else f"; {done} steps would be redone by a new launch"))
    redo = 0 if done is None else max(done - newest, 0)
    return f"{where}newest{intact} checkpoint at step {newest}: a resume would redo {redo} step{'s' * (redo != 1)}"


def corrupt_lines(host: str, status: RunStatus) -> list[str]:
    """A line per checkpoint the host found corrupt (a resume passes over it)."""
    return [console.printable(f"{host}: the checkpoint at step {bad.step} is corrupt, a resume passes over it: "
                              f"{bad.problem} ({bad.path})") for bad in status.corrupt_checkpoints or ()]


def host_statuses(session: Session, ref: RunRef) -> list[HostStatus]:
    """Every host's status of a run on several hosts, asked in parallel, in rank order;
    a host that could not be asked, or that left the inventory, has none, and its error."""
    hosts, left = run_hosts.members(session, ref)
    replies = {**session.on_each_host(hosts, lambda host: session.agent(host.name).run_status(ref.run_id)), **left}
    out = []
    for rank, name in enumerate(ref.hosts):
        reply = replies[name]
        if isinstance(reply, DflashError):
            out.append(HostStatus(name, rank, ref.run_id, None, error=reply.message))
        else:
            out.append(HostStatus(name, rank, ref.run_id, reply))
    return out


def status_of(session: Session, ref: RunRef) -> RunStatus | RunOnHosts:
    """One run's status as its host's agent derives it; a run on several hosts: every
    host's (asked in parallel) and the state of the whole (FAILED if any host failed,
    RUNNING only if all run)."""
    if not ref.multihost:
        return session.agent(ref.host).run_status(ref.run_id)
    statuses = multihost.mark_silent_ranks(host_statuses(session, ref))
    return RunOnHosts(ref.run_id, multihost.aggregate_state({s.host: s.state for s in statuses}), tuple(statuses))


def exit_code(session: Session, ref: RunRef, status: RunStatus | RunOnHosts) -> ExitCode:
    """`status`'s exit code: the run state's (errors.exit_code_for_state, docs/cli.md "CLI
    exit codes"); 2 when it is unknown only for want of the hosts the inventory lost (its
    fix is the inventory's)."""
    if isinstance(status, RunOnHosts):
        unknown = {s.host for s in status.hosts if s.state is None}
        if status.state is None and unknown <= set(run_hosts.left(session, ref)):
            return ExitCode.USAGE
    return exit_code_for_state(status.state)


def _show_hosts(status: RunOnHosts) -> None:
    shown = multihost.state_name(status.state)
    console.data(f"{shown}\n")
    console.human.print(hosts_table(f"run {status.run_id} on {len(status.hosts)} hosts: {shown}", list(status.hosts)))
    for s in status.hosts:
        if s.error:
            console.warn(s.error)
        if s.silent:
            console.warn(f"{s.host} (rank {s.rank}) is {s.state}: {s.silent}")
        if s.status and s.status.reason:
            console.say(console.printable(f"{s.host}: reason: {s.status.reason}"))
        if s.state == RunState.STALLED:
            console.say(stacks_hint(status.run_id, s.host))
        for line in corrupt_lines(s.host, s.status) if s.status else ():
            console.warn(line)
    source = next((s.status.source for s in status.hosts if s.status and s.status.source), None)
    if source:
        console.say(f"source: {provenance.summary(source)}")
    first = status.hosts[0]
    if first.status and first.status.export:
        console.say(export_line(status.run_id, first.host, first.status.export))


def stacks_hint(run_id: str, host: str) -> str:
    """Where a STALLED run's threads hang is what to look at next."""
    return f"where its threads hang: dflash stacks {shlex.quote(run_id)} --host {shlex.quote(host)}"


def export_line(run_id: str, host: str, path: str) -> str:
    """Where the run's export is on its host (rank 0's): what `job: evaluate` reads."""
    return (f"export on {host}: {path} (evaluate.drafter: run:{run_id}; "
            f"dflash pull {shlex.quote(run_id)} --host {shlex.quote(host)} brings it here)")


def run_status(session: Session, ref: RunRef, *, as_json: bool) -> ExitCode:
    """Print one run's state; the exit code says it too (`exit_code`). A run on several
    hosts: the state of the whole and a row per host."""
    status = status_of(session, ref)
    if as_json:
        console.data(json.dumps(status.to_json()) + "\n")
    elif isinstance(status, RunOnHosts):
        _show_hosts(status)
    else:
        console.data(f"{status.state}\n")
        console.human.print(runs_table(f"run {ref.run_id} on {ref.host}", [status]))
        if status.source:
            console.say(f"source: {provenance.summary(status.source)}")
        if line := overrides_line(status):
            console.say(line)
        if status.reason:
            console.say(console.printable(f"reason: {status.reason}"))
        if status.state == RunState.STALLED:
            console.say(stacks_hint(ref.run_id, ref.host))
        for line in corrupt_lines(ref.host, status):
            console.warn(line)
        if status.export:
            console.say(export_line(ref.run_id, ref.host, status.export))
        if status.state != RunState.SUCCEEDED:
            console.say(resume_point(status))
    return exit_code(session, ref, status)


def run_config(session: Session, ref: RunRef, *, as_json: bool) -> ExitCode:
    """Print the config the run was started with (its config.yaml: resolved, for a run
    launched by this dflash) on stdout; its state and overrides on stderr. Exit 0 once
    printed, whatever the state: this asks for the config, not for the run's health."""
    status = session.agent(ref.host).run_status(ref.run_id, config=True)
    if status.config is None:
        raise DflashError(f"run {ref.run_id} on {ref.host} recorded no config", ExitCode.USAGE)
    if as_json:
        console.data(json.dumps(status.to_json()) + "\n")
        return ExitCode.OK
    console.data(status.config if status.config.endswith("\n") else status.config + "\n")
    console.say(f"run {ref.run_id} on {ref.host}: {status.state}")
    if line := overrides_line(status):
        console.say(line)
    return ExitCode.OK


def list_runs(session: Session, *, host_names: list[str], as_json: bool) -> ExitCode:
    """Each host's runs, newest first, with what each changed since the run before it on
    that host (MANIFESTs compared, differing files fetched once into the local cache).
    No host named: the latest run's, else local. A run whose run.json cannot be read is
    named on stderr, the others listed all the same, and the exit code is 2."""
    if not host_names:
        latest = latest_host(session.logs_dir)
        if latest not in session.inventory.hosts:  # the inventory changed since that run
            console.warn(f"the latest run's host {latest!r} is not in {session.inventory.described}: skipped; "
                         "the runs on local follow (--host HOST for another)")
            latest = "local"
        host_names = [latest]
    store = ReleaseStore(session)
    code = ExitCode.OK
    for name in host_names:
        reply = session.agent(name).call(requests.Status())
        runs = list(reply.runs)
        changes = {newer.run_id: change_since(store, name, older, newer.release_id)
                   for newer, older in zip(runs, runs[1:]) if newer.release_id and older.release_id}
        if as_json:
            for r in runs:
                console.data(json.dumps({"host": name, **r.to_json(), "changed": changes.get(r.run_id)}) + "\n")
        else:
            for r in runs:
                console.data(f"{name}\t{r.run_id}\t{r.state}\n")
            console.human.print(runs_table(f"runs on {name}", runs, changes))
        for bad in reply.unreadable or ():
            console.warn(console.printable(f"host {name}: run {bad.run_id} not listed: {bad.path} cannot be read "
                                          f"({bad.error})"))
            code = ExitCode.USAGE
    return code
