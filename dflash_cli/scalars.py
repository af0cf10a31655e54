"""The figures of a run's events that TensorBoard and the trackers draw: one extraction
for every sink (docs/cli.md "Local state", "Trackers"), so they all show the same
scalars under the same tags at the same steps."""
from __future__ import annotations

import dataclasses
from typing import Any

from dflash_events import EVAL, STEP, TS

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Scalars:
    """One event's figures. `kind` is its type (`step` or `eval`): within a kind the
    steps of a run's events increase, except where a resume trains steps again."""
    kind: str
    step: int
    wall_time: float
    values: tuple[tuple[str, float], ...]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(event: dict) -> Scalars | None:
    """The (tag, value) figures of a step or eval event at its step, or None for an
    event that has none."""
    found: list[tuple[str, Any]] = []
    if STEP.matches(event):
        kind = STEP.name
        found += [("train/loss", event.get(STEP.loss)), ("train/lr", event.get(STEP.lr)),
                  ("train/grad_norm", event.get(STEP.grad_norm)), ("train/epoch", event.get(STEP.epoch)),
                  ("throughput/samples_per_s", event.get(STEP.samples_per_s)),
                  ("throughput/tokens_per_s", event.get(STEP.tokens_per_s))]
        accuracy = event.get(STEP.acc) or []
        if accuracy:
            found.append(("train/acc@1", accuracy[0]))
        # acc[k-1]: the accuracy of block position k (1 = the first drafted token).
        found += [(f"train/acc_by_position/{k}", value) for k, value in enumerate(accuracy, 1)]
        found += [(f"memory/peak_gib/drafter-{i}", peak / GIB if _number(peak) else None)
                  for i, peak in enumerate(event.get(STEP.peak_memory_bytes) or [])]
    elif EVAL.matches(event):
        kind = EVAL.name
        found += [("eval/acceptance_length", event.get(EVAL.acceptance_length)),
                  ("eval/mean_per_prompt", event.get(EVAL.mean_per_prompt))]
    else:
        return None
    values = tuple((tag, float(value)) for tag, value in found if _number(value))
    if not values:
        return None
    step = int(event.get(STEP.step) or 0)  # an evaluate job's eval has no step (both name it alike)
    return Scalars(kind, step, float(event.get(TS) or 0.0), values)
