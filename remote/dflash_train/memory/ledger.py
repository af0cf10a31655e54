"""What each part of the run holds on each GPU, noted as it is built, so that a CUDA
out-of-memory error can say who held the memory (errors.jsonl `memory`, docs/errors.md).

    mark = ledger.mark("cuda:0")                 # before building a part
    ...                                          # load the target, build a drafter
    ledger.note_since(mark, "drafter-0")         # what it allocated; its CUDA-graph pools

Parts are built one at a time (the target, then each drafter before the next starts),
so the difference of the device's allocated bytes before and after is that part's. A
CUDA graph keeps its memory in a private pool of the caching allocator: the pools that
appeared during a build are that part's graphs, and what they reserve beyond their live
tensors is noted as "<part> CUDA graphs". Off CUDA nothing is noted.

torch is imported lazily: runlog imports this module before the trainer imports torch.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

DEFAULT_POOL = (0, 0)  # the caching allocator's own pool; any other is a CUDA graph's (or a MemPool's)
GRAPHS_SUFFIX = " CUDA graphs"


@dataclasses.dataclass(frozen=True)
class Held:
    part: str  # "target", "drafter-1", "drafter-1 CUDA graphs"
    device: str  # "cuda:0"
    bytes: int


@dataclasses.dataclass(frozen=True)
class Mark:
    """A device's allocator as it was before a part was built."""

    device: str
    allocated: int
    pools: frozenset[tuple[int, int]]  # the private pools that existed then


_lock = threading.Lock()
_held: list[Held] = []


def note(part: str, device: str, bytes: int) -> Held:
    held = Held(part, device, bytes)
    with _lock:
        _held.append(held)
    return held


def snapshot(part: str | None = None) -> list[dict[str, Any]]:
    """Every note so far (only those of `part` and its CUDA graphs, when given), in the
    order noted, as JSON objects."""
    with _lock:
        return [dataclasses.asdict(held) for held in _held
                if part is None or held.part in (part, part + GRAPHS_SUFFIX)]


def _pool_segments(torch, device: str) -> list[dict[str, Any]]:
    index = torch.device(device).index
    return [s for s in torch.cuda.memory_snapshot()
            if s["device"] == index and tuple(s["segment_pool_id"]) != DEFAULT_POOL]


def mark(device: str) -> Mark | None:
    """The state to measure a build against; None off CUDA (nothing is noted)."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    pools = frozenset(tuple(s["segment_pool_id"]) for s in _pool_segments(torch, device))
    return Mark(device, torch.cuda.memory_allocated(device), pools)


def note_since(before: Mark | None, part: str) -> list[dict[str, Any]]:
    """Note what `part` allocated on the device since `before`, and the reserve of the
    CUDA-graph pools made meanwhile beyond their live tensors (those count in the
    first figure). Returns the notes as JSON objects (for the start-up events)."""
    if before is None:
        return []
    import torch

    notes = [note(part, before.device, torch.cuda.memory_allocated(before.device) - before.allocated)]
    new = [s for s in _pool_segments(torch, before.device) if tuple(s["segment_pool_id"]) not in before.pools]
    if new:
        notes.append(note(part + GRAPHS_SUFFIX, before.device,
                          sum(s["total_size"] - s["allocated_size"] for s in new)))
    return [dataclasses.asdict(held) for held in notes]


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def after_oom(exc: BaseException) -> dict[str, Any] | None:
    """For a failure that is (or was raised from) a torch.OutOfMemoryError: every CUDA
    device's allocator figures now, and the ledger. None for any other failure."""
    torch = sys.modules.get("torch")  # no torch imported: no CUDA error
    if torch is None or not any(isinstance(e, torch.OutOfMemoryError) for e in _chain(exc)):
        return None
    facts: dict[str, Any] = {"devices": {}, "parts": snapshot()}
    if torch.cuda.is_initialized():  # else no CUDA work ran (an injected fault)
        try:
            for index in range(torch.cuda.device_count()):
                facts["devices"][f"cuda:{index}"] = {"allocated": torch.cuda.memory_allocated(index),
                                                     "reserved": torch.cuda.memory_reserved(index),
                                                     "max_allocated": torch.cuda.max_memory_allocated(index)}
        except Exception as error:  # noqa: BLE001 - a broken device must not cost the record
            facts["error"] = f"{type(error).__name__}: {error}"
    return facts
