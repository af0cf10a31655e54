"""dflash status / dflash runs: run states as the agent derives them on the host."""
from __future__ import annotations

import dataclasses
import shlex


from dflash_contract import requests
from dflash_contract.records import ReleaseSource
from dflash_contract.replies import RunStatus
from dflash_contract.states import RunState

from .. import console, multihost, run_hosts
from ..errors import DflashError, ExitCode
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


def source_commit(source: ReleaseSource | None) -> str:
    """`1a2b3c4` for a clean checkout, `1a2b3c4*` with uncommitted changes, else `-`."""
    return (source.commit_mark() if source else None) or "-"


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


@dataclasses.dataclass(frozen=True)
class StatusResult:
    """`status`: one run's status (`status_of`). `inventory_lost`: the run's state is
    unknown only for want of hosts the inventory lost (exit 2: its fix is the inventory's)."""
    ref: RunRef
    status: RunStatus | RunOnHosts
    inventory_lost: bool = False


def status(session: Session, ref: RunRef) -> StatusResult:
    found = status_of(session, ref)
    lost = False
    if isinstance(found, RunOnHosts) and found.state is None:
        lost = {s.host for s in found.hosts if s.state is None} <= set(run_hosts.left(session, ref))
    return StatusResult(ref, found, lost)


def stacks_hint(run_id: str, host: str) -> str:
    """Where a STALLED run's threads hang is what to look at next."""
    return f"where its threads hang: dflash stacks {shlex.quote(run_id)} --host {shlex.quote(host)}"


def export_line(run_id: str, host: str, path: str) -> str:
    """Where the run's export is on its host (rank 0's): what `job: evaluate` reads."""
    return (f"export on {host}: {path} (evaluate.drafter: run:{run_id}; "
            f"dflash pull {shlex.quote(run_id)} --host {shlex.quote(host)} brings it here)")


@dataclasses.dataclass(frozen=True)
class ConfigResult:
    """`status --config`: the run's status holding the config it was started with."""
    ref: RunRef
    status: RunStatus


def config(session: Session, ref: RunRef) -> ConfigResult:
    """The config the run was started with (its config.yaml: resolved, for a run
    launched by this dflash), with its state and overrides. Exit 0 whatever the state:
    this asks for the config, not for the run's health."""
    found = session.agent(ref.host).run_status(ref.run_id, config=True)
    if found.config is None:
        raise DflashError(f"run {ref.run_id} on {ref.host} recorded no config", ExitCode.USAGE)
    return ConfigResult(ref, found)


@dataclasses.dataclass(frozen=True)
class HostRuns:
    """One host's runs, newest first, what each changed since the run before it (run id
    -> change_since's record) and the runs whose run.json could not be read."""
    host: str
    runs: tuple[RunStatus, ...]
    changes: dict[str, dict]
    unreadable: tuple = ()


@dataclasses.dataclass(frozen=True)
class RunsListing:
    """`runs`: each host's runs (exit 2 when a run.json could not be read)."""
    hosts: tuple[HostRuns, ...]


def list_runs(session: Session, host_names: list[str]) -> RunsListing:
    """Each host's runs, newest first, with what each changed since the run before it on
    that host (MANIFESTs compared, differing files fetched once into the local cache).
    No host named: the latest run's, else local."""
    if not host_names:
        latest = latest_host(session.logs_dir)
        if latest not in session.inventory.hosts:  # the inventory changed since that run
            console.warn(f"the latest run's host {latest!r} is not in {session.inventory.described}: skipped; "
                         "the runs on local follow (--host HOST for another)")
            latest = "local"
        host_names = [latest]
    store = ReleaseStore(session)
    listed = []
    for name in host_names:
        reply = session.agent(name).call(requests.Status())
        runs = tuple(reply.runs)
        changes = {newer.run_id: change_since(store, name, older, newer.release_id)
                   for newer, older in zip(runs, runs[1:]) if newer.release_id and older.release_id}
        listed.append(HostRuns(name, runs, changes, tuple(reply.unreadable or ())))
    return RunsListing(tuple(listed))
