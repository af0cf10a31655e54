"""The step loop, one for both pipeline modes: a drafter thread runs it over its own
replica (pipeline.drafter_body), the main thread of a sequential run over every replica
of its process (jobs/coordinator.py). Each step:

    before_step(step); training_step(replicas, their micro-batches of the step, exchange)
    the lead (drafter-0's caller): after the first step, the baseline evaluation; then
        the step's report, checkpoint and evaluation when due (schedule.OutputSchedule)

The baseline is of the starting weights whenever it runs; it is asked for once the first
step is taken so that it never shares the GPU with that step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from .replica import FeatureBatch, Replica
from .run_context import Run
from .schedule import EvalRequest, OutputSchedule
from .step import Exchange, training_step

MicroBatches = Callable[[int, Replica], Iterable[FeatureBatch]]  # (step, replica) -> its micro-batches, in order


def run_steps(run: Run, schedule: OutputSchedule, replicas: Sequence[Replica], micro_batches: MicroBatches,
              exchange: Exchange, evaluate: Callable[[EvalRequest], None],
              before_step: Callable[[int], None]) -> None:
    """Steps start_step + 1 to total_steps of `replicas` (the lead replica first, if the
    caller steps it); `evaluate` runs an evaluation request or hands it on."""
    lead = replicas[0] if replicas[0].index == 0 else None
    for step in range(run.start_step + 1, run.total_steps + 1):
        before_step(step)
        applied = training_step(replicas, [micro_batches(step, replica) for replica in replicas], exchange,
                                run.faults, step, peers=run.peers)
        run.latch.progressed()
        if lead is not None:
            if step == run.start_step + 1:
                schedule.evaluate_baseline(evaluate)
            schedule.after_step(step, lead, applied, evaluate)
