"""What every tracker sink does, and what it is told of the run."""
from __future__ import annotations

import dataclasses
from typing import Any


from dflash_contract.states import RunState

from ..scalars import Scalars

# A tag every event of a kind carries: a tracker's history of it says the last step of
# that kind the tracker holds.
KIND_MARKERS = {"step": "train/loss", "eval": "eval/acceptance_length"}


@dataclasses.dataclass(frozen=True)
class TrackedRun:
    run_id: str
    host: str  # rank 0's
    name: str | None  # the run's name (its config's file name, or --name)
    config: dict[str, Any]  # the resolved training config, as config.yaml holds it
    provenance: dict[str, Any]  # run id, hosts, release, overrides, attempt, source commit and diff hash
    git_commit: str | None  # the source's, as the trackers' own field for it

    def run_name(self, template: str) -> str:
        return template.format(run_id=self.run_id, name=self.name or self.run_id, host=self.host)


class Sink:
    """One tracker. `open` makes or resumes the tracker run of `run` (`known`: the
    tracker's run id recorded by an earlier watch, or None); `send` gets rows of
    scalars no earlier call sent, `first_row` being the number of rows sent before;
    `rebuild` makes the tracker run hold the run's history (scalars.History) instead of
    what it holds. Both return the rows the tracker run holds after."""

    name = ""
    holds_when_closed = False  # True: what it was sent is kept only once `close` returned

    @property
    def destination(self) -> str:
        """Where this sink sends (trackers.json's record of another destination is not its own)."""
        raise NotImplementedError

    @property
    def run_id(self) -> str:
        raise NotImplementedError

    def where(self) -> str:
        """One line for people: the tracker run, and how to see it."""
        raise NotImplementedError

    def open(self, run: TrackedRun, known: str | None) -> None:
        raise NotImplementedError

    def last_steps(self) -> dict[str, int] | None:
        """The last step of each kind the tracker run holds, where the tracker can say."""
        return None

    def send(self, batch: list[Scalars], first_row: int) -> int:
        raise NotImplementedError

    def rebuild(self, history: list[Scalars]) -> int:
        """What the tracker run holds replaced by `history` (every value, by step): where
        the attempt that continued the run replaced values the tracker holds."""
        raise NotImplementedError

    def close(self, outcome: RunState | None) -> None:
        """`outcome`: the run's end state, or None when the run goes on without this watch."""
        raise NotImplementedError
