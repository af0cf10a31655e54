"""A RUN as people type it (docs/cli.md "Naming a run"): a run id, a unique prefix of
one, or a run's name (`launch --name`, by default its config's file name). A prefix or
a name that several runs have is refused naming them; a miss names the closest run."""
from __future__ import annotations

import dataclasses
import difflib
import re
import shlex

from . import console
from .errors import DflashError, ExitCode
from .local_state import RunLogs, RunRef, check_run_text, latest_run, recorded_run, recorded_runs
from .session import Session

# launch.new_run_id's form, NAME-YYYYmmdd-HHMMSS-xxxx: the run's name and when it started.
_STAMPED = re.compile(r"^(?P<name>.+)-(?P<stamp>\d{8}-\d{6})-[0-9a-f]{4}$")
SHOWN = 10  # the candidates an error names, newest first


def name_of(run_id: str) -> str | None:
    """The name a run id starts with, or None for an id not of launch's form."""
    match = _STAMPED.match(run_id)
    return match["name"] if match else None


def newest_first(run_ids: list[str]) -> list[str]:
    """By the start time the ids hold, newest first; ids without one last."""
    def key(run_id: str) -> tuple[str, str]:
        match = _STAMPED.match(run_id)
        return (match["stamp"] if match else "", run_id)
    return sorted(run_ids, key=key, reverse=True)


@dataclasses.dataclass(frozen=True)
class Known:
    """A run a RUN may name: one logs/ records, or one a host listed, and its name."""
    ref: RunRef
    name: str | None


def hosts_to_ask(session: Session, host: str | None) -> list[str]:
    """Whose runs a RUN is looked for among when logs/ holds no run of that id: `host`,
    else the latest run's host and `local` (what `dflash runs` lists without --host),
    those the inventory has."""
    if host:
        return [host]
    latest = latest_run(session.logs_dir)
    names = dict.fromkeys([*([latest.host] if latest else []), "local"])
    return [name for name in names if name in session.inventory.hosts]


def listed(session: Session, host: str) -> list[Known]:
    """The runs `host` holds, as its agent lists them (a run.json without a name: the
    name its id starts with)."""
    from dflash_contract import requests  # the protocol's types cost start-up: only when asked

    reply = session.agent(host).call(requests.Status())
    # A run whose run.json cannot be read is named all the same: a verb on it says why.
    return ([Known(RunRef(host, run.run_id), run.name or name_of(run.run_id)) for run in reply.runs]
            + [Known(RunRef(host, run.run_id), name_of(run.run_id)) for run in reply.unreadable or ()])


def find(session: Session, text: str, host: str | None, *, ask_hosts: bool = True) -> RunRef:
    """The run `text` names (RUN of the command line; `host`: --host, or None), matched
    as `pick` matches: a run id logs/ records costs no round trip; with --host, among
    the runs recorded here and those the host lists; without, among those recorded here,
    then (with `ask_hosts`) with those of each of `hosts_to_ask` in turn, until one
    names it. A host that cannot be asked is passed over, and its error is the answer
    when no host could be asked. Without `ask_hosts` (a verb that reads logs/ only) a
    RUN that matches none is taken as it is, on `host` (default local), for that verb to
    say what it lacks of it."""
    check_run_text(text)
    RunLogs(session.logs_dir, RunRef(host or "local", text))  # a RUN that cannot be a folder name is refused so
    exact = recorded_run(session.logs_dir, text, host)
    if exact is not None:
        return exact
    known = [Known(ref, name_of(ref.run_id)) for ref in recorded_runs(session.logs_dir, host)]
    asked: list[str] = []
    failed: DflashError | None = None
    # With --host the host's own list counts as well: a prefix unique here may not be there.
    ref = None if ask_hosts and host else pick(text, known, f"recorded under {session.logs_dir}")
    for name in hosts_to_ask(session, host) if ask_hosts and ref is None else ():
        try:
            known += listed(session, name)
        except DflashError as exc:
            failed = failed or exc
            continue
        asked.append(name)
        ref = pick(text, known, f"on {', '.join(asked)} or recorded under {session.logs_dir}")
        if ref is not None:
            break
    if ref is None and not ask_hosts:
        return RunRef(host or "local", text)
    if ref is None:
        if failed is not None and not asked:
            raise failed  # no host could say: why is the answer
        raise miss(text, known, f"on {', '.join(asked)} or recorded under {session.logs_dir}")
    if ref.run_id != text:
        console.say(f"{text}: run {ref.run_id} on {ref.host}")
    return ref


def pick(text: str, known: list[Known], where: str) -> RunRef | None:
    """The one run `text` names among `known`: the run of that id, else the one run of
    that name, else the one run whose id it starts; None when it names none. Several
    runs is an error naming them."""
    ids = {k.ref.run_id for k in known}
    if text in ids:
        return _one(text, known)
    chosen = sorted({k.ref.run_id for k in known if k.name == text}) or sorted(i for i in ids if i.startswith(text))
    if len(chosen) == 1:
        return _one(chosen[0], known)
    if not chosen:
        return None
    shown = newest_first(chosen)
    more = f", and {len(shown) - SHOWN} more" if len(shown) > SHOWN else ""
    raise DflashError(f"{text!r} names {len(shown)} runs {where}: {', '.join(shown[:SHOWN])}{more}",
                      ExitCode.USAGE, hint="type more of the run id, or the whole of it")


def _one(run_id: str, known: list[Known]) -> RunRef:
    """The run of that id: its record of a run on several hosts when one says so; one
    id on several hosts that are not one run's needs --host."""
    refs = {k.ref for k in known if k.ref.run_id == run_id}
    whole = [ref for ref in refs if ref.multihost]
    if whole:
        return whole[0]
    if len(refs) > 1:
        raise DflashError(f"run {run_id!r} exists on several hosts ({', '.join(sorted(r.host for r in refs))})",
                          ExitCode.USAGE, hint="pick one with --host")
    return refs.pop()


def miss(text: str, known: list[Known], where: str) -> DflashError:
    """No run of that id, name or prefix: the error names the closest id or name."""
    words = sorted({k.ref.run_id for k in known} | {k.name for k in known if k.name})
    closest = difflib.get_close_matches(text, words, n=1, cutoff=0.5)
    if closest:
        hint = f"did you mean {shlex.quote(closest[0])}?"
    else:
        hint = "`dflash runs --host HOST` lists a host's runs"
    return DflashError(f"no run {text!r} {where} (a run id, a unique prefix of one, or a run's name)",
                       ExitCode.USAGE, hint=hint)
