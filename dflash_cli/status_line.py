"""The one line `watch` keeps at the bottom of a terminal: where the run is (step, epoch,
loss, accuracy, acceptance length, throughput, ETA) and its GPUs, from the events and
GPU samples the agent's `follow` sends."""
from __future__ import annotations

from dflash_contract.replies import Gpu
from dflash_contract.events import EVAL, PROGRESS, STARTUP, STEP, TS, StartupState
from rich.text import Text


def clock(seconds: float) -> str:
    """HH:MM:SS (hours past 99 as they are)."""
    seconds = int(round(seconds))
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RunProgress:
    """The latest figures of a run; `render` makes the status line of them."""

    def __init__(self, gpu_summary):
        self._gpu_summary = gpu_summary  # the GPUs of a sample -> one line of text
        self.step: dict | None = None  # the latest step event
        self.acceptance: float | None = None
        self.answered: dict | None = None  # the latest progress event of a regenerate job
        self.gpus: tuple[Gpu, ...] = ()
        self.starting: str | None = None  # the start-up phase under way (its `started` event), until a step
        self._first: tuple[float, int] | None = None  # (ts, step) of the first step event seen

    def update(self, events: list[dict]) -> None:
        for event in events:
            if STEP.matches(event) and isinstance(event.get(STEP.step), int):
                self.step = event
                if self._first is None:
                    self._first = (event.get(TS, 0.0), event[STEP.step])
            elif EVAL.matches(event) and event.get(EVAL.acceptance_length) is not None:
                self.acceptance = event[EVAL.acceptance_length]
            elif PROGRESS.matches(event):
                self.answered = event
            elif STARTUP.matches(event):
                under_way = event.get(STARTUP.state) in StartupState.UNDER_WAY  # alive: still working at it
                self.starting = event.get(STARTUP.label) or event.get(STARTUP.phase) if under_way else None

    def eta_s(self) -> float | None:
        """Seconds left at the pace of the steps seen so far (host clock: event times)."""
        if self.step is None or self._first is None or not self.step.get(STEP.total_steps):
            return None
        done = self.step[STEP.step] - self._first[1]
        elapsed = self.step.get(TS, 0.0) - self._first[0]
        if done <= 0 or elapsed <= 0:
            return None
        return (self.step[STEP.total_steps] - self.step[STEP.step]) * elapsed / done

    def render(self) -> Text:
        parts = []
        step, answered = self.step, self.answered
        if step is None and answered is not None:
            parts.append(f"answered {answered.get(PROGRESS.answered)}/{answered.get(PROGRESS.total)} prompts")
            if answered.get(PROGRESS.eta_s) is not None:
                parts.append(f"ETA {clock(answered[PROGRESS.eta_s])}")
        elif step is None:
            parts.append(f"start-up: {self.starting} …" if self.starting else "no step yet")
        else:
            total, done = step.get(STEP.total_steps), step[STEP.step]
            parts.append(f"step {done}/{total}" if total else f"step {done}")
            if step.get(STEP.epoch) is not None:
                parts.append(f"epoch {step[STEP.epoch]}")
            if isinstance(step.get(STEP.loss), (int, float)):
                parts.append(f"loss {step[STEP.loss]:.4f}")
            accuracy = step.get(STEP.acc) or [None]
            if accuracy[0] is not None:
                parts.append(f"acc@1 {accuracy[0]:.3f}")
        if self.acceptance is not None:
            parts.append(f"accept {self.acceptance:.2f}")
        if step is not None and step.get(STEP.samples_per_s) is not None:
            parts.append(f"{step[STEP.samples_per_s]:.1f} samples/s")
        eta = self.eta_s()
        if step is not None:
            parts.append(f"ETA {clock(eta)}" if eta is not None else "ETA ?")
        if self.gpus:
            parts.append(self._gpu_summary(self.gpus))
        return Text("  ".join(parts), style="bold", no_wrap=True, overflow="ellipsis")
