"""One run across several hosts, seen as one (docs/multihost.md): its state from
each host's, and its root cause among every host's error records."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from dflash_contract.records import ErrorRecord, ExitRecord
from dflash_contract.replies import RunStatus
from dflash_contract.states import UNKNOWN_PRECEDENCE, RunState


# How a state nobody could tell is shown (None: a host that could not be asked): exit 3
# unless another host failed.
UNKNOWN = "UNKNOWN"


def aggregate_state(states: Mapping[str, RunState | None]) -> RunState | None:
    """The run's state from each host's (None: that host could not be asked): the one
    of highest precedence (RunState's docstring)."""
    return min(states.values(), key=lambda state: UNKNOWN_PRECEDENCE if state is None else state.precedence)


def state_name(state: RunState | None) -> str:
    """How a state is shown (None: UNKNOWN)."""
    return UNKNOWN if state is None else state.value


@dataclasses.dataclass(frozen=True)
class HostStatus:
    """One host's part of a run on several hosts, as `status` shows it."""

    host: str
    rank: int
    run_id: str
    status: RunStatus | None  # the host's RunStatus; None: the host could not be asked...
    error: str | None = None  # ... and why
    silent: str | None = None  # who found this rank silent: it is STALLED whatever its host says

    @property
    def state(self) -> RunState | None:
        if self.status is None:
            return None
        return RunState.STALLED if self.silent else self.status.state

    def to_json(self) -> dict[str, Any]:
        if self.status is None:
            return {"host": self.host, "rank": self.rank, "run_id": self.run_id, "state": None, "error": self.error}
        shown = {"host": self.host, "rank": self.rank, **self.status.to_json()}
        if self.silent:
            shown.update(state=RunState.STALLED.value, silent=self.silent)
        return shown


@dataclasses.dataclass(frozen=True)
class RunOnHosts:
    """A run on several hosts as `status` sees it: the whole run's state (None: unknown,
    `aggregate_state`) and each host's part, in rank order."""

    run_id: str
    state: RunState | None
    hosts: tuple[HostStatus, ...]

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "state": state_name(self.state),
                "hosts": [host.to_json() for host in self.hosts]}


def mark_silent_ranks(statuses: list[HostStatus]) -> list[HostStatus]:
    """Every host's status (in rank order), with a rank that another found silent (its
    PeerFailed without the peer's own record: no sign of life for peer_timeout_s, or a
    collective it broke) STALLED, and `silent` saying who found it so, however alive its
    own host sees it (a peer that found it silent is believed over it): it can no longer
    train with the run."""
    marked = list(statuses)
    for witness in statuses:
        peer = witness.status.peer_failure if witness.status else None
        if peer is None or peer.peer_exc_type or not 0 <= peer.peer_rank < len(marked):
            continue
        rank = peer.peer_rank
        state = marked[rank].state
        if state is not None and not state.terminal:
            marked[rank] = dataclasses.replace(marked[rank], silent=f"{witness.host} (rank {witness.rank}) stopped "
                                                                    f"hearing from it: {peer.peer_message}")
    return marked


def in_time_order(records_by_host: Mapping[str, Sequence[ErrorRecord]]) -> list[tuple[str, ErrorRecord]]:
    """(host, record) of every host's error records. One host's keep their file order
    (appended as threads failed); several hosts' are merged by their time stamps."""
    tagged = [(host, record) for host, records in records_by_host.items() for record in records]
    if len(records_by_host) < 2:
        return tagged
    def stamp(item: tuple[str, ErrorRecord]) -> float:
        return math.inf if item[1].ts is None else item[1].ts
    return sorted(tagged, key=stamp)


def root_cause(records: Sequence[tuple[str, ErrorRecord]]) -> tuple[str, ErrorRecord] | None:
    """The run's root cause: the earliest record that is not a rank stopping because a
    peer failed, else the earliest (a peer that failed without a record of its own:
    `blamed_host` names it)."""
    for item in records:
        if item[1].exc_type != ErrorRecord.PEER_FAILED:
            return item
    return records[0] if records else None


def blamed_host(cause: tuple[str, ErrorRecord], hosts: Sequence[str]) -> str | None:
    """For a root cause that is a PeerFailed record (no rank recorded a failure of its
    own: the peer was killed, or went silent), the host of the peer it names; else None."""
    peer = cause[1].peer_failure()
    if peer is None or not 0 <= peer.peer_rank < len(hosts):
        return None
    return hosts[peer.peer_rank] if hosts[peer.peer_rank] != cause[0] else None


def blamed_line(hosts: Sequence[str], exit_info: ExitRecord | None, cause: tuple[str, ErrorRecord],
                own: Sequence[ErrorRecord] = ()) -> str:
    """What is known of a failing rank that left no record of its own (`blamed_host`):
    what the rank that noticed saw, and how its process ended (or that it still runs).
    `own`, the blamed rank's records of that attempt: when it too went unheard from a
    peer (a PeerFailed for a silence) while the witness found it silent, both were alive
    and lost each other, which is the network between them."""
    witness, record = cause
    peer = record.peer_failure()
    how = None if exit_info is None else exit_info.ended_by()
    ended = "still runs" if how is None else f"was {how}" if how.startswith("killed") else f"ended with {how}"
    lost = next((r.peer_failure() for r in own if silence(r) is not None), None)
    if lost is not None and peer is not None and peer.silence_s is not None and 0 <= peer.peer_rank < len(hosts):
        rank, other_rank = peer.peer_rank, lost.peer_rank
        other = f"{hosts[other_rank]} (rank {other_rank})" if 0 <= other_rank < len(hosts) else "its peer"
        return (f"a network partition: {hosts[rank]} (rank {rank}) and {other} stopped hearing each other while both "
                f"ran ({witness} (rank {hosts.index(witness)}): {peer.peer_message}; {hosts[rank]}: "
                f"{lost.peer_message}); its trainer {ended}")
    return (f"{(peer.peer_message if peer else None) or record.message or ''} (seen by {witness}, rank "
            f"{hosts.index(witness)}); its trainer {ended}, with no error record of its own")


def silence(record: ErrorRecord) -> float | None:
    """How long a PeerFailed record's rank heard nothing from its peer before it stopped
    (None: the peer failed, or went away: a record, a closed connection)."""
    peer = record.peer_failure()
    return None if peer is None else peer.silence_s


def peer_failed_line(record: ErrorRecord, hosts: Sequence[str]) -> str:
    """One line for a PeerFailed record: its traceback is the watchdog's, not the cause."""
    peer = record.peer_failure()
    rank = None if peer is None else peer.peer_rank
    where = f"rank {rank}" + (f" ({hosts[rank]})" if rank is not None and 0 <= rank < len(hosts) else "")
    message = peer.peer_message if peer is not None else record.message or ""
    if silence(record) is not None:  # alive or not: nothing came from it
        return f"stopped because {where} went silent: {message}"
    if peer is None or not peer.peer_exc_type:  # the peer vanished without a record (killed, store gone)
        return f"stopped because {where} is gone: {message}"
    return f"stopped because {where} failed: {peer.peer_exc_type}: {message}"
