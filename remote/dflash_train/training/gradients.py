"""Averaging the replicas' gradients over every replica of every process, once a step.

The lead replica's thread (or the main thread, sequential) does all of it:

    replica i: flat_i = [its gradients | its facts in row g of a (G, K) block]   on its device
    lead:      total = sum_i flat_i          torch.cuda.comm.reduce_add on CUDA, replica order on CPU
               all-reduce(total) over the ranks, in buckets (Peers.all_reduce_sum); then
               the gradient part / G (G: replicas in the whole run)
    back:      total to every other replica's device (torch.cuda.comm.broadcast / a copy);
               each replica's averaged gradients are views of its own copy

Every replica thus applies the bits of one tensor: replicas stay identical by
construction, in one process or many. The gradients are flattened once, up front, into
the buffer the all-reduce needs anyway (the *_coalesced functions would flatten and
unflatten per call, and the all-reduce flatten again). The facts are what every replica
must read alike (the loss of every replica, for the non-finite check and the report; the
per-position accuracy counts): G rows of K = 1 + 2 (bs - 1) numbers, summed with the
gradients where each replica filled only its own row, so the all-reduce carries them at
no extra collective.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.cuda.comm  # a submodule `import torch` does not load (AttributeError on the H200's torch 2.11)

from ..compiling.step_build import StepStats
from ..devices import Fence, is_cuda
from .distributed import Layout, Peers


@dataclasses.dataclass
class Posted:
    """One replica's part of a step, as it hands it to the exchange."""

    grads: list[torch.Tensor]  # one per parameter, on `device`
    facts: torch.Tensor  # (K,) on `device`: loss, correct (bs-1), counted (bs-1)
    fence: Fence  # the replica's stream at the end of its backward
    device: str


@dataclasses.dataclass
class Averaged:
    """What a replica applies: the mean gradients and every replica's facts."""

    grads: list[torch.Tensor]  # one per parameter, views of `flat`, on the replica's device
    facts: torch.Tensor  # (G, K), row g: replica g of the run
    flat: torch.Tensor  # the buffer both are views of (kept alive for its stream)
    fence: Fence  # the replica's stream waits on it before reading


def step_facts(stats: StepStats, dtype: torch.dtype) -> torch.Tensor:
    """(K,) = loss, correct (bs-1), counted (bs-1) of one replica's step, in `dtype`."""
    return torch.cat([stats.loss.reshape(1).to(dtype), stats.correct.to(dtype), stats.counted.to(dtype)])


class GradientExchange:
    def __init__(self, layout: Layout, peers: Peers | None):
        self.layout, self.peers = layout, peers

    def average(self, posted: list[Posted]) -> list[Averaged]:
        """The averaged gradients and the facts, for each posted replica (in local order)."""
        layout = self.layout
        if layout.global_replicas == 1:  # one replica in the run: nothing to exchange, nothing copied
            only = posted[0]
            return [Averaged(only.grads, only.facts[None], only.facts, only.fence)]
        lead = posted[0].device
        for part in posted:  # this thread's streams wait for every replica's backward
            part.fence.wait(part.device)
        flats = [self._flatten(layout.global_index(i), part) for i, part in enumerate(posted)]
        total = _sum_onto(flats, lead)
        if self.peers is not None:
            self.peers.all_reduce_sum(total)
        sizes = [g.numel() for g in posted[0].grads]
        total[:sum(sizes)].div_(layout.global_replicas)
        copies = _spread(total, [part.device for part in posted])
        if is_cuda(lead):
            # Every read of the replicas' own gradients and every copy must be done before
            # they go on: their owners free or overwrite those gradients next.
            for device in {part.device for part in posted}:
                torch.cuda.current_stream(device).synchronize()
        return [self._unflatten(copy, part, sizes) for copy, part in zip(copies, posted)]

    def _flatten(self, global_index: int, part: Posted) -> torch.Tensor:
        """(P + G*K,): the gradients, then this replica's facts in its row of zeros."""
        rows = part.facts.new_zeros(self.layout.global_replicas, part.facts.numel())
        rows[global_index] = part.facts
        return torch.cat([*(g.reshape(-1) for g in part.grads), rows.reshape(-1)])

    def _unflatten(self, flat: torch.Tensor, part: Posted, sizes: list[int]) -> Averaged:
        grads = [piece.view_as(g) for piece, g in zip(flat[:sum(sizes)].split(sizes), part.grads)]
        facts = flat[sum(sizes):].view(self.layout.global_replicas, part.facts.numel())
        return Averaged(grads, facts, flat, Fence(part.device))


def _sum_onto(flats: list[torch.Tensor], lead: str) -> torch.Tensor:
    """The sum of `flats` in a new tensor on `lead` (flats[0]'s device)."""
    if is_cuda(lead) and len(flats) > 1:
        return torch.cuda.comm.reduce_add(flats, destination=torch.device(lead).index)
    total = flats[0]  # a fresh buffer already, ours to overwrite
    for flat in flats[1:]:
        total.add_(flat.to(lead))
    return total


def _spread(total: torch.Tensor, devices: list[str]) -> list[torch.Tensor]:
    """A copy of `total` for every replica (the lead keeps `total` itself): one per device
    by broadcast, and a clone for each further replica on a device already served."""
    lead = devices[0]
    others = [torch.device(d).index for d in dict.fromkeys(devices[1:]) if d != lead]
    on_device = {lead: total}
    if is_cuda(lead) and others:
        copies = torch.cuda.comm.broadcast(total, devices=[torch.device(lead).index, *others])
        on_device.update({f"cuda:{index}": copy for index, copy in zip(others, copies[1:])})
    result = []
    for device in devices:
        copy = on_device.pop(device, None)
        result.append(copy if copy is not None else total.to(device, copy=True))
    return result
