"""dflash status / dflash runs: run states as the agent derives them on the host."""
from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from .. import console, multihost, provenance
from ..errors import DflashError, ExitCode, exit_code_for_state
from ..local_state import RunRef
from ..release_store import ReleaseStore, summary
from ..session import Session


def runs_table(title: str, runs: list[dict], changes: dict[str, dict] | None = None, first: str = "run") -> Table:
    """One row per run, or with first="host" one per host of a run on several hosts; with
    `changes` (run id -> change_since's record), two more columns: the source commit
    (`*`: uncommitted changes) and what changed since the run before."""
    table = Table(title=title, title_justify="left")
    columns = [first, "state", "step", "errors", "started", "ended", "release"]
    for column in columns + (["source", "changed since previous run"] if changes is not None else []):
        table.add_column(column)
    for r in runs:
        cells = [r[first if first == "host" else "run_id"], r.get("state") or multihost.UNKNOWN,
                 step_cell(r),
                 str(r.get("errors", 0)), console.utc_time(r.get("started_at")),
                 console.utc_time(r.get("ended_at")), r.get("release_id") or r.get("error", "")]
        if changes is not None:
            cells += [source_commit(r.get("source")), changes.get(r["run_id"], {}).get("text", "")]
        table.add_row(*map(Text, cells))  # plain text: run names may hold [brackets]
    return table


def step_cell(status: dict) -> str:
    """The step, or before the first one the start-up phase under way."""
    if status.get("step") is not None:
        return str(status["step"])
    if not status.get("startup"):
        return ""
    elapsed = status.get("startup_elapsed_s")
    return f"start-up: {status['startup']}" + (f", {elapsed:.0f} s" if isinstance(elapsed, (int, float)) else "")


def overrides_line(status: dict) -> str | None:
    """`overrides: --set optim.lr=1e-4 --set …`, or None for a run launched without any."""
    overrides = status.get("overrides") or []
    return "overrides: " + " ".join(f"--set {o}" for o in overrides) if overrides else None


def source_commit(source: dict | None) -> str:
    """`1a2b3c4` for a clean checkout, `1a2b3c4*` with uncommitted changes, else `-`."""
    if not source or not source.get("git_commit"):
        return "-"
    return source["git_commit"][:7] + ("*" if source.get("dirty") else "")


def change_since(store: ReleaseStore, host: str, previous: dict, release_id: str) -> dict:
    """What release `release_id` changed from the one run `previous` used, both on `host`:
    {"since", "same_release", "files", "added", "removed", "text"}; "text" reads
    `same release as RUN` or `changed since RUN: 2 files (+14 −3)`."""
    since = previous["run_id"]
    if previous.get("release_id") == release_id:
        return {"since": since, "same_release": True, "files": 0, "added": 0, "removed": 0,
                "text": f"same release as {since}"}
    try:
        diffs = store.diff((host, previous["release_id"]), (host, release_id))
    except DflashError as exc:
        return {"since": since, "same_release": False, "text": f"changed since {since}: unknown ({exc.message})"}
    return {"since": since, "same_release": False, "files": len(diffs), "added": sum(d.added for d in diffs),
            "removed": sum(d.removed for d in diffs), "text": f"changed since {since}: {summary(diffs)}"}


def resume_point(status: dict) -> str:
    """How much a resume would redo: the steps done since the newest checkpoint."""
    attempts = status.get("attempts") or 1
    where = f"attempt {status.get('attempt', 0)} of {attempts}; " if attempts > 1 else ""
    done = status.get("step")
    if done is None:
        done = status.get("resume_step")  # this attempt has not finished a step yet
    newest = status.get("checkpoint_step")
    if newest is None:
        return (f"{where}no checkpoint yet: a resume is not possible"
                + ("" if done is None else f"; {done} steps would be redone by a new launch"))
    redo = 0 if done is None else max(done - newest, 0)
    return f"{where}newest checkpoint at step {newest}: a resume would redo {redo} step{'s' * (redo != 1)}"


def host_statuses(session: Session, ref: RunRef) -> list[dict]:
    """Every host's RunStatus of a run on several hosts, asked in parallel, in rank
    order, each with "host" and "rank"; a host that could not be asked has state None
    and "error", its message."""
    hosts = [session.host(name) for name in ref.hosts]
    replies = session.on_each_host(
        hosts, lambda host: session.agent(host.name).call("status", "--run-id", ref.run_id)["runs"][0])
    out = []
    for rank, name in enumerate(ref.hosts):
        reply = replies[name]
        if isinstance(reply, DflashError):
            out.append({"host": name, "rank": rank, "run_id": ref.run_id, "state": None, "error": reply.message})
        else:
            out.append({"host": name, "rank": rank, **reply})
    return out


def _status_of_hosts(session: Session, ref: RunRef, as_json: bool) -> ExitCode:
    statuses = multihost.mark_silent_ranks(host_statuses(session, ref))
    state = multihost.aggregate_state({s["host"]: s["state"] for s in statuses})
    if as_json:
        console.data(json.dumps({"run_id": ref.run_id, "state": state, "hosts": statuses}) + "\n")
    else:
        console.data(f"{state}\n")
        console.human.print(runs_table(f"run {ref.run_id} on {len(statuses)} hosts: {state}", statuses, first="host"))
        for s in statuses:
            if s.get("error"):
                console.warn(s["error"])
            if s.get("silent"):
                console.warn(f"{s['host']} (rank {s['rank']}) is {s['state']}: {s['silent']}")
            if s.get("reason"):
                console.say(console.printable(f"{s['host']}: reason: {s['reason']}"))
        source = next((s["source"] for s in statuses if s.get("source")), None)
        if source:
            console.say(f"source: {provenance.summary(source)}")
    return exit_code_for_state(state)


def run_status(session: Session, ref: RunRef, as_json: bool) -> ExitCode:
    """Print one run's state; the exit code says it too (0 fine, 1 failed, lost, degraded
    or stalled, 4 stopped). A run on several hosts: the state of the whole (FAILED if
    any host failed, RUNNING only if all run) and a row per host."""
    if ref.multihost:
        return _status_of_hosts(session, ref, as_json)
    reply = session.agent(ref.host).call("status", "--run-id", ref.run_id)
    status = reply["runs"][0]
    if as_json:
        console.data(json.dumps(status) + "\n")
    else:
        console.data(f"{status['state']}\n")
        console.human.print(runs_table(f"run {ref.run_id} on {ref.host}", [status]))
        if status.get("source"):
            console.say(f"source: {provenance.summary(status['source'])}")
        if line := overrides_line(status):
            console.say(line)
        if status.get("reason"):
            console.say(console.printable(f"reason: {status['reason']}"))
        if status["state"] != "SUCCEEDED":
            console.say(resume_point(status))
    return exit_code_for_state(status["state"])


def run_config(session: Session, ref: RunRef, as_json: bool) -> ExitCode:
    """Print the config the run was started with (its config.yaml: resolved, for a run
    launched by this dflash) on stdout; its state and overrides on stderr. Exit 0 once
    printed, whatever the state: this asks for the config, not for the run's health."""
    status = session.agent(ref.host).call("status", "--run-id", ref.run_id, "--config")["runs"][0]
    if status.get("config") is None:
        raise DflashError(f"run {ref.run_id} on {ref.host} recorded no config", ExitCode.USAGE)
    if as_json:
        console.data(json.dumps(status) + "\n")
        return ExitCode.OK
    console.data(status["config"] if status["config"].endswith("\n") else status["config"] + "\n")
    console.say(f"run {ref.run_id} on {ref.host}: {status['state']}")
    if line := overrides_line(status):
        console.say(line)
    return ExitCode.OK


def list_runs(session: Session, host_names: list[str], as_json: bool) -> ExitCode:
    """Each host's runs, newest first, with what each changed since the run before it on
    that host (MANIFESTs compared, differing files fetched once into the local cache)."""
    store = ReleaseStore(session)
    for name in host_names:
        runs = session.agent(name).call("status")["runs"]
        changes = {newer["run_id"]: change_since(store, name, older, newer["release_id"])
                   for newer, older in zip(runs, runs[1:]) if newer.get("release_id") and older.get("release_id")}
        if as_json:
            for r in runs:
                console.data(json.dumps({"host": name, **r, "changed": changes.get(r["run_id"])}) + "\n")
        else:
            for r in runs:
                console.data(f"{name}\t{r['run_id']}\t{r['state']}\n")
            console.human.print(runs_table(f"runs on {name}", runs, changes))
    return ExitCode.OK
