"""One training step of data-parallel drafter replicas, the same wherever it runs.

A drafter thread steps its own replica, the main thread of a sequential run steps every
replica of its process (both through loop.run_steps), a test or a benchmark steps
replicas of its own; each calls `training_step` with the replicas it steps, each
one's micro-batches of the step in order, and how their gradients are exchanged:

    for each of the step's A micro-batches, for each replica:
        (the first: drafter-<i>'s fault, and whether its step is poisoned) forward + backward
    every replica posts its gradients -> exchange -> every replica applies the average

A replica posts before the average can be taken, so one thread stepping several replicas
steps all of them at once (a drafter's own thread meets the others at a
`threads.Rendezvous` instead: `at_rendezvous`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ..compiling.step_build import StepStats
from ..faults import FaultInjector
from ..threads import Rendezvous, StopRequested
from .distributed import Layout, Peers
from .gradients import Averaged, Posted
from .replica import AppliedStep, NonFiniteStep

# The posted parts of the replicas a caller steps -> what each of them applies, in that order.
Exchange = Callable[[list[Posted]], list[Averaged]]


class SteppedReplica(Protocol):
    """What a step needs of a replica; replica.Replica is the trainer's."""

    index: int  # in its process: its faults are drafter-<index>'s
    global_index: int  # in the run
    layout: Layout
    accumulate: int  # micro-batches a step

    def run_step(self, batch: Any, poison: bool, summed: StepStats | None) -> StepStats: ...

    def post(self, summed: StepStats) -> Posted: ...

    def apply(self, averaged: Averaged, step: int) -> AppliedStep: ...


def training_step(replicas: Sequence[SteppedReplica], micro_batches: Sequence[Iterable[Any]], exchange: Exchange,
                  faults: FaultInjector, step: int, *, peers: Peers | None) -> AppliedStep:
    """Step `step` of `replicas`, `micro_batches[i]` yielding replica i's micro-batches of
    the step in order; what the lead replica applied (every replica applies the same).

    A non-finite step stops it before any replica applied it: see `_stop_unless_reporter`."""
    batches = [iter(b) for b in micro_batches]
    poisons: list[bool] = [False] * len(replicas)
    sums: list[StepStats | None] = [None] * len(replicas)
    for micro in range(replicas[0].accumulate):
        for i, replica in enumerate(replicas):
            batch = next(batches[i])
            if micro == 0:
                name = f"drafter-{replica.index}"
                faults.fire(name, step)
                poisons[i] = faults.poisons(name, step)  # every micro-batch of the step
            sums[i] = replica.run_step(batch, poisons[i], sums[i])
    averaged = exchange([replica.post(summed) for replica, summed in zip(replicas, sums)])
    try:  # every replica finds a non-finite step: the first fails before any applied it
        applied = [replica.apply(mean, step) for replica, mean in zip(replicas, averaged)]
    except NonFiniteStep as exc:
        raise _stop_unless_reporter(exc, replicas, peers) from None
    return applied[0]


def at_rendezvous(rendezvous: Rendezvous, index: int, average: Exchange) -> Exchange:
    """The exchange of replica `index` stepped in a thread of its own: every replica of
    the process posts at `rendezvous`, where the lead takes the average of them all."""
    return lambda posted: [rendezvous.exchange(index, posted[0], average)]


def _stop_unless_reporter(exc: NonFiniteStep, replicas: Sequence[SteppedReplica],
                          peers: Peers | None) -> BaseException:
    """Every replica of the run found the non-finite step; the caller stepping the one it
    names records it. The others stop without a record; on another rank than the
    reporter's, the first of them records PeerFailed, the root cause being that rank's."""
    if any(replica.global_index == exc.reporter for replica in replicas):
        return exc
    layout = replicas[0].layout
    reporter_rank = exc.reporter // layout.local_replicas
    if reporter_rank != layout.rank and peers is not None:
        peers.peer_failed(reporter_rank, type(exc).__name__, str(exc))
    return StopRequested(f"{layout.replica_name(exc.reporter)} found a non-finite step")
