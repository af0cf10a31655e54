"""dflash status / dflash runs: run states as the agent derives them on the host."""
from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from .. import console, provenance
from ..errors import ExitCode, exit_code_for_state
from ..local_state import RunRef
from ..session import Session


def runs_table(title: str, runs: list[dict]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("run", "state", "step", "errors", "started", "ended", "release"):
        table.add_column(column)
    for r in runs:
        cells = (r["run_id"], r["state"], "" if r.get("step") is None else str(r["step"]),
                 str(r.get("errors", 0)), console.utc_time(r.get("started_at")),
                 console.utc_time(r.get("ended_at")), r.get("release_id") or "")
        table.add_row(*map(Text, cells))  # plain text: run names may hold [brackets]
    return table


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


def run_status(session: Session, ref: RunRef, as_json: bool) -> ExitCode:
    """Print one run's state; the exit code says it too (0 fine, 1 failed, lost, degraded
    or stalled, 4 stopped)."""
    reply = session.agent(ref.host).call("status", "--run-id", ref.run_id)
    status = reply["runs"][0]
    if as_json:
        console.data(json.dumps(status) + "\n")
    else:
        console.data(f"{status['state']}\n")
        console.human.print(runs_table(f"run {ref.run_id} on {ref.host}", [status]))
        if status.get("source"):
            console.say(f"source: {provenance.summary(status['source'])}")
        if status["state"] != "SUCCEEDED":
            console.say(resume_point(status))
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
