"""dflash stop: SIGTERM to the run's process group, a grace period, then SIGKILL."""
from __future__ import annotations

import dataclasses

from dflash_contract import requests
from dflash_contract.replies import StopReply
from dflash_contract.states import RunState

from .. import multihost, run_hosts
from ..errors import DflashError, at_least
from ..local_state import RunRef
from ..session import Session
from . import GRACE_S


@dataclasses.dataclass(frozen=True)
class StopOptions:
    """What a stop was asked for, checked as it is made."""
    grace: float = GRACE_S  # seconds between SIGTERM and SIGKILL

    def __post_init__(self) -> None:
        at_least("grace", self.grace, 0)


@dataclasses.dataclass(frozen=True)
class StopResult:
    """A run stopped: the state of the whole run (None: no host could tell) and each
    host's outcome in rank order, its reply or why it was not stopped."""
    run_id: str
    state: RunState | None
    hosts: tuple[tuple[str, StopReply | DflashError], ...]


def stop(session: Session, ref: RunRef, options: StopOptions) -> StopResult:
    """Returns once no process of the run is left (the agent waits for that). A run on
    several hosts is stopped on all at once; a host that could not be reached, or that
    left the inventory, is in the result with its error, after the others were stopped
    (on one host, it is raised)."""
    hosts, left = run_hosts.members(session, ref)
    replies = {**session.on_each_host(hosts, lambda host: session.agent(host.name).call(
        requests.Stop(ref.run_id, options.grace), timeout=options.grace + 60)), **left}
    if not ref.multihost and isinstance(replies[ref.host], DflashError):
        raise replies[ref.host]
    outcomes = tuple((member.host, replies[member.host]) for member in ref.members)
    state = multihost.aggregate_state({host: None if isinstance(reply, DflashError) else reply.state
                                       for host, reply in outcomes})
    return StopResult(ref.run_id, state, outcomes)
