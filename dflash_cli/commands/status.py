"""dflash status / dflash runs: run states as the agent derives them on the host."""
from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from .. import console, multihost, provenance
from ..errors import DflashError, ExitCode, exit_code_for_state
from ..local_state import RunRef
from ..session import Session


def runs_table(title: str, runs: list[dict], first: str = "run") -> Table:
    """One row per run, or with first="host" one per host of a run on several hosts."""
    table = Table(title=title, title_justify="left")
    for column in (first, "state", "step", "errors", "started", "ended", "release"):
        table.add_column(column)
    for r in runs:
        cells = (r[first if first == "host" else "run_id"], r.get("state") or multihost.UNKNOWN,
                 "" if r.get("step") is None else str(r["step"]),
                 str(r.get("errors", 0)), console.utc_time(r.get("started_at")),
                 console.utc_time(r.get("ended_at")), r.get("release_id") or r.get("error", ""))
        table.add_row(*map(Text, cells))  # plain text: run names may hold [brackets]
    return table


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
    statuses = host_statuses(session, ref)
    state = multihost.aggregate_state({s["host"]: s["state"] for s in statuses})
    if as_json:
        console.data(json.dumps({"run_id": ref.run_id, "state": state, "hosts": statuses}) + "\n")
    else:
        console.data(f"{state}\n")
        console.human.print(runs_table(f"run {ref.run_id} on {len(statuses)} hosts: {state}", statuses, "host"))
        for s in statuses:
            if s.get("error"):
                console.warn(s["error"])
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
    return exit_code_for_state(status["state"])


def list_runs(session: Session, host_names: list[str], as_json: bool) -> ExitCode:
    for name in host_names:
        runs = session.agent(name).call("status")["runs"]
        if as_json:
            for r in runs:
                console.data(json.dumps({"host": name, **r}) + "\n")
        else:
            for r in runs:
                console.data(f"{name}\t{r['run_id']}\t{r['state']}\n")
            console.human.print(runs_table(f"runs on {name}", runs))
    return ExitCode.OK
