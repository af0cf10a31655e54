"""A run's hosts against the inventory. A run the local records chose (logs/latest.json, or
the run's folder under logs/) names the hosts it started on, and the inventory may have
lost one since: each verb says which host, which run chose it and which inventory lacks
it, and goes on without it only where its work allows (docs/cli.md "A run's host that
left the inventory")."""
from __future__ import annotations

import enum

from . import run_names
from .errors import DflashError, ExitCode
from .inventory import BUILTIN, Host
from .local_state import LATEST_FILE, RunLogs, RunRef, latest_or_refuse, latest_run
from .session import Session


class Reach(enum.Enum):
    """Which of the run's hosts a verb cannot do without."""
    EVERY = enum.auto()  # resume: every host's part starts together
    FIRST = enum.auto()  # rank 0 (pull, status --config, diff): it holds the export, the config, the release
    ANY = enum.auto()  # watch, status, stop, fetch-traceback, stacks: the hosts still there go on


def left(session: Session, ref: RunRef) -> list[str]:
    """`ref`'s hosts, in rank order, that the inventory does not have."""
    return [member.host for member in ref.members if member.host not in session.inventory.hosts]


def refusal(session: Session, ref: RunRef, names: list[str]) -> DflashError:
    """The error for `names`, hosts of `ref` (a run the local records chose) that left the
    inventory: the run, where it is recorded, those hosts and the inventory."""
    latest = latest_run(session.logs_dir)
    if latest is not None and latest.run_id == ref.run_id:
        run = f"the latest run {ref.run_id} ({session.logs_dir / LATEST_FILE})"
    else:
        run = f"run {ref.run_id} ({RunLogs(session.logs_dir, ref).dir})"
    hosts = ", ".join(f"{name} (rank {ref.hosts.index(name)} of {len(ref.hosts)})" if ref.multihost else name
                      for name in names)
    inventory = session.inventory
    add_to = inventory.source if inventory.source != BUILTIN else "an inventory (--hosts FILE)"
    return DflashError(f"{run} ran on {hosts}, which {'is' if len(names) == 1 else 'are'} not in "
                       f"{inventory.described}", ExitCode.USAGE,
                       hint=f"add {', '.join(names)} back to {add_to}, or name a run on a host the inventory "
                            "has (`dflash runs --host HOST` lists a host's runs)")


def check(session: Session, ref: RunRef, reach: Reach) -> None:
    """Refuse (exit 2) a verb whose run the local records chose when a host it cannot do
    without left the inventory; with Reach.ANY only when none of the run's hosts is left."""
    gone = left(session, ref)
    needed = {Reach.EVERY: gone, Reach.FIRST: [name for name in gone if name == ref.host],
              Reach.ANY: gone if len(gone) == len(ref.members) else []}[reach]
    if needed:
        raise refusal(session, ref, needed)


def chosen_run(session: Session, run_id: str | None, host_name: str | None, reach: Reach, naming: str) -> RunRef:
    """The run a verb was given (`run_id`, `host_name`: either may be None): a RUN as
    run_names.find reads it, else the latest run (`naming`: how that verb names a run
    and its host, for the error when there is none). Without a
    host the local records chose the run's hosts, and the inventory may have lost one
    since: a verb that cannot do without it (`reach`) is refused naming the run, the host
    and the inventory."""
    ref = (latest_or_refuse(session.logs_dir, host_name, naming) if run_id is None
           else run_names.find(session, run_id, host_name))
    if host_name is None:
        check(session, ref, reach)
    return ref


def members(session: Session, ref: RunRef) -> tuple[list[Host], dict[str, DflashError]]:
    """For a verb that goes on with the hosts it has: the run's hosts in the inventory, in
    rank order, and for each one that left it, the error saying so (that host's outcome).
    A run on one host is its host, an unknown name refused as the inventory refuses it (the
    command line named it: `check` refused one the local records chose)."""
    if not ref.multihost:
        return [session.host(ref.host)], {}
    gone = left(session, ref)
    return ([session.host(name) for name in ref.hosts if name not in gone],
            {name: refusal(session, ref, [name]) for name in gone})


def note_left(session: Session, ref: RunRef) -> str | None:
    """For a verb that reads the local records only (plot): the line saying that `ref`'s
    host left the inventory, so those records are all there will be; None while it is in
    the inventory, or when the inventory cannot be read (such a verb needs none, and a
    broken one is refused by the verbs that do)."""
    try:
        known = session.inventory.hosts
    except DflashError:
        return None
    if ref.host in known:
        return None
    return (f"{refusal(session, ref, [ref.host]).message}: what was watched here is all there is "
            "until it is back")
