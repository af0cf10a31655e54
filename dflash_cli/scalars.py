"""The figures of a run's events that TensorBoard and the trackers draw: one extraction
for every sink (docs/cli.md "Local state", "Trackers"), so they all show the same
scalars under the same tags at the same steps."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from dflash_contract.events import ATTEMPT, EVAL, STEP, TS

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


@dataclasses.dataclass(frozen=True)
class Change:
    """What one event changed of a run's history (`History.add`): `new`, a value to add
    after what a sink holds; or `rewind`, the step from which what a sink holds is
    replaced: it drops its values from that step on and takes the history's."""
    new: Scalars | None = None
    rewind: int | None = None


class History:
    """A run's scalars as its attempts left them (docs/cli.md "Trackers"): the one rule
    of every sink. An attempt that resumes from the checkpoint of step K replaces every
    value after K (the steps it trains again, or that no longer are the run's); a value
    an attempt sends at a step where an earlier attempt's is held (the baseline eval at
    K) replaces it. So each tag has one value per step, the latest attempt's; a value of
    the same attempt received again (a second watch of the same events) changes nothing."""

    def __init__(self) -> None:
        self.attempt = 0
        # (kind, step) -> (the attempt that sent it, its scalars, its event)
        self._held: dict[tuple[str, int], tuple[int, Scalars, dict]] = {}

    def add(self, event: dict) -> Change | None:
        if ATTEMPT.matches(event):
            number, resumed = event.get(ATTEMPT.attempt), event.get(ATTEMPT.resume_step)
            if not isinstance(number, int) or number <= self.attempt:
                return None
            self.attempt = number
            start = resumed + 1 if isinstance(resumed, int) else 0
            gone = [key for key in self._held if key[1] >= start]
            for key in gone:
                del self._held[key]
            return Change(rewind=start) if gone else None
        found = scalars(event)
        if found is None:
            return None
        key = (found.kind, found.step)
        held = self._held.get(key)
        if held is not None and held[0] == self.attempt:
            return None
        self._held[key] = (self.attempt, found, event)
        return Change(rewind=found.step) if held is not None else Change(new=found)

    def values(self, start: int = 0) -> list[Scalars]:
        """The history's values at `start` and after, by step (a step's before its eval)."""
        return [found for _, found, _ in self._ordered() if found.step >= start]

    def events(self) -> list[dict]:
        """The events whose values the history holds, by step."""
        return [event for _, _, event in self._ordered()]

    def last_steps(self) -> dict[str, int]:
        """The last step of each kind the history holds."""
        last: dict[str, int] = {}
        for kind, step in self._held:
            last[kind] = max(step, last.get(kind, step))
        return last

    def _ordered(self) -> list[tuple[int, Scalars, dict]]:
        return [self._held[key] for key in sorted(self._held, key=lambda key: (key[1], key[0] != STEP.name))]


def history_of(events: Iterable[dict]) -> History:
    history = History()
    for event in events:
        history.add(event)
    return history
