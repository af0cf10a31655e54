"""dflash diff: what differs between the code (or configs) two runs ran, from their releases."""
from __future__ import annotations

from rich.table import Table


from dflash_contract import requests

from .. import console, run_hosts, run_names
from ..errors import DflashError, ExitCode
from ..local_state import RunRef
from ..release_store import FileChange, ReleaseStore, file_diff, summary
from ..session import Session


def parse_run(session: Session, text: str, host: str | None) -> RunRef:
    """RUN or HOST/RUN (a run id holds no '/'), as the other commands resolve RUN."""
    if "/" in text:
        host_name, run_id = text.split("/", 1)
        session.host(host_name)  # an unknown host is refused by name
        return run_names.find(session, run_id, host_name)
    ref = run_names.find(session, text, host)
    if host is None:  # the local records chose the host: the release is asked of rank 0's
        run_hosts.check(session, ref, run_hosts.Reach.FIRST)
    return ref


def run(session: Session, *, run_a: str, run_b: str, host: str | None, paths: tuple[str, ...],
        stat: bool, config: bool, as_json: bool = False) -> ExitCode:
    """The unified diff on stdout (or --stat's table; with `as_json`, one JSON object:
    the runs, their releases and each file's diff and counts); exit 0 whether or not
    they differ."""
    refs = [parse_run(session, text, host) for text in (run_a, run_b)]
    releases: list[tuple[str, str]] = []
    if config:
        texts = [session.agent(r.host).call(requests.RunConfig(r.run_id)).config for r in refs]
        change = FileChange("config.yaml", None, None)
        diffs = [file_diff(change, texts[0].encode("utf-8", "surrogateescape"),
                           texts[1].encode("utf-8", "surrogateescape"),
                           labels=(f"{refs[0].run_id}/config.yaml", f"{refs[1].run_id}/config.yaml"))]
        diffs = [d for d in diffs if d.text]
    else:
        for ref in refs:
            release_id = session.agent(ref.host).run_status(ref.run_id).release_id
            if not release_id:
                raise DflashError(f"run {ref.run_id} on {ref.host} records no release", ExitCode.USAGE)
            releases.append((ref.host, release_id))
        console.say(f"{refs[0].run_id}: release {releases[0][1]} on {refs[0].host}; "
                    f"{refs[1].run_id}: release {releases[1][1]} on {refs[1].host}")
        diffs = ReleaseStore(session).diff(releases[0], releases[1], paths)
    if as_json:
        runs = [{"host": ref.host, "run_id": ref.run_id, "release_id": release[1] if release else None}
                for ref, release in zip(refs, releases or [None, None])]
        console.data(console.json_line({
            "run_a": runs[0], "run_b": runs[1], "config": config, "summary": summary(diffs),
            "files": [{"path": d.change.path, "added": d.added if d.compared else None,
                       "removed": d.removed if d.compared else None, "compared": d.compared, "diff": d.text}
                      for d in diffs]}))
    elif stat:
        table = Table(title=f"{refs[0].run_id} → {refs[1].run_id}: {summary(diffs)}", title_justify="left")
        for column in ("file", "+", "−"):
            table.add_column(column, justify="left" if column == "file" else "right")
        for d in diffs:
            added, removed = (str(d.added), str(d.removed)) if d.compared else ("-", "-")  # as git --numstat
            table.add_row(d.change.path, added, removed)
            console.data(f"{added}\t{removed}\t{d.change.path}\n")
        console.human.print(table)
    else:
        for d in diffs:
            console.data(d.text)
        if not diffs:
            console.say("no difference")
    return ExitCode.OK
