"""The threaded pipeline: prefetch -> target(s) -> drafters, plus evaluation.

    prefetch --target_queues[t]--> target-t --drafter_queues[r]--> drafter-r
                                                                      |  gradients averaged
                                                                      v  every step (Rendezvous)
    drafter-0: metrics, checkpoints, export, eval requests --eval_queue--> eval
               (schedule.OutputSchedule decides when)

Micro-batch m of step s of replica r is plan entry ((s-1)*A + m)*G + g, g = rank*R + r
its index in the run (G replicas in all, R per process, A = optim.accumulate micro-batches
a step), and goes through target r % T, so each drafter receives its micro-batches in
order; the gradients are exchanged and applied once a step, after its A micro-batches.
Rank 0 alone reports steps, evaluates, writes checkpoints and the export. All queues are
bounded; every blocking call wakes on the stop event.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import dflash_contract.events

from ..devices import thread_stream
from ..memory import ledger
from ..threads import Rendezvous, StoppableQueue, JobThread
from .gradients import Averaged, Posted
from .loop import run_steps
from .replica import FeatureBatch, Replica
from .run_context import Run
from .schedule import EvalRequest, Evaluator, OutputSchedule
from .step import at_rendezvous

READY = "ready"  # the store barrier every rank arrives at once all its drafters are ready


@dataclasses.dataclass
class Channels:
    target_queues: list[StoppableQueue]
    drafter_queues: list[StoppableQueue]
    eval_queue: StoppableQueue | None
    rendezvous: Rendezvous

    @property
    def queues(self) -> list[StoppableQueue]:
        """The queues whose depths step events report."""
        return [*self.target_queues, *self.drafter_queues]


def make_channels(run: Run, evaluates: bool) -> Channels:
    """The queues between the threads of `run` and its drafters' rendezvous; an
    evaluation queue when the run `evaluates`."""
    latch, pipe = run.latch, run.config.pipeline
    return Channels(
        target_queues=[StoppableQueue(f"target-{t}", pipe.queue_size, latch, pipe.poll_s)
                       for t in range(len(run.target_devices))],
        drafter_queues=[StoppableQueue(f"drafter-{r}", pipe.queue_size, latch, pipe.poll_s)
                        for r in range(len(run.drafter_devices))],
        eval_queue=StoppableQueue("eval", 2, latch, pipe.poll_s) if evaluates else None,
        rendezvous=Rendezvous(len(run.drafter_devices), latch))


def prefetch_body(run: Run, channels: Channels):
    def body(worker: JobThread) -> None:
        run.faults.fire(worker.name)
        worker.phase = "train"
        targets = len(channels.target_queues)
        for step in range(run.start_step + 1, run.total_steps + 1):
            worker.step = step
            run.faults.fire(worker.name, step)
            for micro in range(run.plan.accumulate):
                for replica in range(len(channels.drafter_queues)):
                    batch = run.host_batch(step, replica, micro)
                    run.waits.add(worker.name, channels.target_queues[replica % targets].put(batch))
                    run.latch.progressed()
        worker.phase = "shutdown"
        for target_queue in channels.target_queues:
            target_queue.put(None)  # end of data
    return body


def target_body(run: Run, channels: Channels, index: int):
    def body(worker: JobThread) -> None:
        with thread_stream(run.target_devices[index]):
            run.faults.fire(worker.name)
            worker.phase = "train"
            while True:
                batch, waited = channels.target_queues[index].get()
                run.waits.add(worker.name, waited)
                if batch is None:
                    break
                worker.step = batch.step
                if batch.micro == 0:
                    run.faults.fire(worker.name, batch.step)
                run.waits.add(worker.name, channels.drafter_queues[batch.replica].put(run.features(index, batch)))
                run.latch.progressed()
            worker.phase = "shutdown"
    return body


def drafter_body(run: Run, schedule: OutputSchedule, channels: Channels, index: int, start_replica):
    """`start_replica(index)` builds the replica and its train step (weights on the
    device, compile warm-up): the startup that `wait_until_ready` waits for."""

    def body(worker: JobThread) -> None:
        with thread_stream(run.drafter_devices[index]):
            run.faults.fire(worker.name)
            replica = start_replica(index)
            worker.mark_ready()
            run.events.emit(dflash_contract.events.READY, replica=replica.index, device=replica.device,
                            compile=run.config.compile, rank=run.layout.rank, world_size=run.layout.world_size,
                            memory=ledger.snapshot(worker.name))
            run.latch.progressed()
            worker.phase = "train"
            lead = replica.index == 0
            exchange = at_rendezvous(channels.rendezvous, index, run.exchange.average)

            def evaluate(request: EvalRequest) -> None:  # on the evaluation thread (which exists if needed)
                channels.eval_queue.put(request)

            def waited_exchange(posted: list[Posted]) -> list[Averaged]:  # time at the rendezvous is waiting
                started = time.perf_counter()
                averaged = exchange(posted)
                run.waits.add(worker.name, time.perf_counter() - started)
                return averaged

            if lead and run.peers is not None:  # the first all-reduce must not time out on a slower host's warm-up
                run.peers.wait_for_all(READY, run.config.runtime.ready_timeout_s)

            def queued(step: int, _: Replica) -> Iterator[FeatureBatch]:
                return _queued(run, channels.drafter_queues[index], worker.name, step)

            def before_step(step: int) -> None:
                worker.step = step

            run_steps(run, schedule, [replica], queued, waited_exchange, evaluate, before_step)
            worker.phase = "shutdown"
            if lead:
                schedule.after_training(replica, evaluate)
    return body


def _queued(run: Run, queue: StoppableQueue, thread: str, step: int) -> Iterator[FeatureBatch]:
    """A drafter's micro-batches of `step`, as its target thread hands them over."""
    for micro in range(run.plan.accumulate):
        feature_batch, waited = queue.get()
        run.waits.add(thread, waited)
        assert (feature_batch.host.step, feature_batch.host.micro) == (step, micro), \
            (feature_batch.host.step, feature_batch.host.micro, step, micro)
        yield feature_batch


def eval_body(run: Run, channels: Channels, evaluator: Evaluator):
    def body(worker: JobThread) -> None:
        assert channels.eval_queue is not None
        with thread_stream(evaluator.device):
            run.faults.fire(worker.name)
            while True:
                worker.phase = "train"
                request, _ = channels.eval_queue.get()
                worker.phase, worker.step = "eval", request.step
                evaluator.measure(request)
                if request.final:
                    break
    return body
