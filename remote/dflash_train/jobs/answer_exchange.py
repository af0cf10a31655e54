"""job: regenerate on several hosts: each prompt answered once, one output file on rank 0.

The hosts of a run join as a training run's do (training/distributed.py: the store rank 0
hosts, the watchdog that ends every rank when one fails or goes silent). On the store,
under the run's prefix:

    answered        rank 0's output's answered prompt indices, as [first, last] ranges:
                    what every rank leaves out (a resumed run answers only the rest)
    answer/<i>      prompt i's answer from the rank that made it ({"text", "truncated",
                    "tokens"}); rank 0 reads it, writes it in its place and deletes it
    sent/<r>        rank r has sent every answer it will: how many

Rank r answers the prompts whose index is r modulo the number of hosts. Rank 0 writes the
one output file (`regenerate.output` on its host), in prompt order, its own answers and
the others' as they arrive; the other ranks write no file. A rank that dies takes the
answers it had not sent with it, and the run ends (PeerFailed on the others); rank 0's
output keeps every answer up to the first one missing, and `dflash resume` or a relaunch
answers the rest.
"""
from __future__ import annotations

import json
import time
from typing import Callable

WAIT_S = 0.02  # rank 0's poll for the next answer of another rank


def as_ranges(indices: set[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for index in sorted(indices):
        if ranges and ranges[-1][1] == index - 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ranges


def from_ranges(ranges: list[list[int]]) -> set[int]:
    return {index for first, last in ranges for index in range(first, last + 1)}


def share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """The prompts rank `rank` answers: every world_size-th, by index."""
    return [index for index in indices if index % world_size == rank]


def answered_on_rank0(peers, answered: set[int] | None, timeout_s: float) -> set[int]:
    """Rank 0 publishes its output's answered indices (`answered`); every other rank reads them."""
    if peers.rank == 0:
        assert answered is not None
        peers.store.set("answered", json.dumps(as_ranges(answered)))
        return answered
    [ranges] = [json.loads(value) for value in _wait_get(peers, ["answered"], timeout_s)]
    return from_ranges(ranges)


def _wait_get(peers, keys: list[str], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not peers.store.check(keys):
        peers.latch.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no {', '.join(keys)} within {timeout_s:.0f}s")
        time.sleep(WAIT_S)
    return [peers.store.get(key).decode() for key in keys]


class Sender:
    """A rank > 0's sink: its answers go to rank 0 through the store."""

    def __init__(self, peers):
        self.peers = peers
        self.sent = 0

    def send(self, index: int, text: str, truncated: bool, tokens: int) -> None:
        self.peers.store.set(f"answer/{index}",
                             json.dumps({"text": text, "truncated": truncated, "tokens": tokens}, ensure_ascii=False))
        self.sent += 1

    def done(self) -> None:
        self.peers.store.set(f"sent/{self.peers.rank}", str(self.sent))


def receive(peers, indices: list[int], deliver: Callable[[int, dict], None], stopped: Callable[[], bool]) -> None:
    """Rank 0: the other ranks' answers of `indices`, in order, each to `deliver(index,
    answer)` as it arrives. Ends when all came, or when one will not come: every other
    rank said it sent all it will (a stopped run), or the run failed (`stopped`)."""
    others = [r for r in range(peers.layout.world_size) if r != 0]
    for index in indices:
        key = f"answer/{index}"
        while not peers.store.check([key]):
            if stopped() or peers.store.check([f"sent/{r}" for r in others]):
                if not peers.store.check([key]):  # the last look: it may have come meanwhile
                    return
                break
            time.sleep(WAIT_S)
        deliver(index, json.loads(peers.store.get(key)))
        peers.store.delete_key(key)
