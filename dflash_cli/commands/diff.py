"""dflash diff: what differs between the code (or configs) two runs ran, from their releases."""
from __future__ import annotations

import dataclasses

from dflash_contract import requests

from .. import console, run_hosts, run_names
from ..errors import DflashError, ExitCode
from ..local_state import RunRef
from ..release_store import FileChange, FileDiff, ReleaseStore, file_diff
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


@dataclasses.dataclass(frozen=True)
class RunsDiff:
    """What RUN_B's release (or config.yaml) changed from RUN_A's: the runs, their
    releases ((host, release id) each; none for `config`), and each file that differs.
    `stat`: shown as lines added and removed per file rather than as the diff."""
    refs: tuple[RunRef, RunRef]
    releases: tuple[tuple[str, str], ...]
    config: bool
    diffs: tuple[FileDiff, ...]
    stat: bool = False


def diff(session: Session, run_a: str, run_b: str, *, host: str | None = None, paths: tuple[str, ...] = (),
         stat: bool = False, config: bool = False) -> RunsDiff:
    """The releases' files compared (fetched once into <logs>/releases/), or the runs'
    config.yaml; no difference is no error."""
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
    return RunsDiff((refs[0], refs[1]), tuple(releases), config, tuple(diffs), stat)
