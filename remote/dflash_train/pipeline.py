"""The threaded pipeline: prefetch -> target(s) -> drafters, plus evaluation.

    prefetch --target_queues[t]--> target-t --drafter_queues[r]--> drafter-r
                                                                      |  gradients averaged
                                                                      v  every step (Rendezvous)
    drafter-0: metrics, checkpoints, export, eval requests --eval_queue--> eval

Step s of replica r is plan entry (s-1)*G + g, g = rank*R + r its index in the run (G
replicas in all, R per process), and goes through target r % T, so each drafter receives
its micro-batches in order. Rank 0 alone reports steps, evaluates, writes checkpoints
and the export. All queues are bounded; every blocking call wakes on the stop event.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import TrainingState, replace_dir, take_snapshot
from .checkpoint_writer import CheckpointWriter
from .config import TrainConfig, resolved_yaml
from .data import BatchPlan, HostBatch, Sample, collate
from .devices import Fence, handoff, is_cuda, thread_stream
from .distributed import Layout, Peers
from .faults import FaultInjector
from .gradients import GradientExchange
from .model import DFlashDrafter, cpu_weights, export_drafter
from .replica import AppliedStep, FeatureBatch, NonFiniteStep, Replica
from .runlog import EventLog, say
from .speculative import evaluate
from .target import FeatureTap
from .threads import Rendezvous, StopLatch, StoppableQueue, StopRequested, JobThread


READY = "ready"  # the store barrier every rank arrives at once all its drafters are ready


@dataclasses.dataclass
class EvalRequest:
    step: int
    weights: dict[str, torch.Tensor]  # a snapshot of the drafter (CPU copies)
    baseline: bool = False  # the drafter as this run found it (untrained for a fresh run)
    final: bool = False


class WaitMeter:
    """Seconds each thread spent blocked (on queues or peers) since the last step report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[str, float] = {}

    def add(self, thread: str, seconds: float) -> None:
        with self._lock:
            self._waits[thread] = self._waits.get(thread, 0.0) + seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            taken, self._waits = self._waits, {}
        return {k: round(v, 4) for k, v in sorted(taken.items())}


class Evaluator:
    """Acceptance length of drafter snapshots, measured against target-0."""

    def __init__(self, run: "Run", hf_config: Any, tap: FeatureTap, device: str, embed: torch.Tensor,
                 head: torch.Tensor, prompts: list[list[int]], stop_ids: set[int]):
        self.run, self.tap, self.device = run, tap, device
        self.embed, self.head, self.prompts, self.stop_ids = embed, head, prompts, stop_ids
        self.drafter = DFlashDrafter(hf_config).to(device).eval()
        self.baseline: tuple[int, float] | None = None

    def _stepped(self) -> None:
        self.run.latch.progressed()
        self.run.latch.check()  # a long evaluation must not hold up a stopping run

    def measure(self, request: EvalRequest) -> None:
        self.drafter.load_state_dict(request.weights)
        started = time.perf_counter()
        result = evaluate(self.drafter, self.tap, self.embed, self.head, self.prompts,
                          self.run.config.eval.max_new_tokens, self.stop_ids, on_step=self._stepped)
        if request.baseline:
            self.baseline = (request.step, result.acceptance_length)
        fields: dict[str, Any] = {
            "step": request.step, **result.fields(time.perf_counter() - started),
            "baseline": request.baseline, "final": request.final}
        if self.baseline is not None:
            fields.update(baseline_step=self.baseline[0], baseline_acceptance_length=round(self.baseline[1], 4))
        self.run.events.emit("eval", **fields)
        text = f"eval at step {request.step}: {result.summary()}"
        if request.final and self.baseline is not None:
            text += (f" (at step {self.baseline[0]}, before this run trained: {self.baseline[1]:.3f}; "
                     f"gain {result.acceptance_length - self.baseline[1]:+.3f})")
        say(text)


@dataclasses.dataclass
class Run:
    """What every part of a run shares."""

    config: TrainConfig
    run_dir: Path
    events: EventLog
    latch: StopLatch
    faults: FaultInjector
    samples: Sequence[Sample]  # a data.StoredSamples in a run
    plan: BatchPlan
    pad_id: int
    taps: list[FeatureTap]  # one per target device
    target_devices: list[str]
    drafter_devices: list[str]
    start_step: int
    losses: list[float]  # the loss curve, carried across resumes
    exchange: GradientExchange
    peers: Peers | None = None  # the other processes of the run, if any
    waits: WaitMeter = dataclasses.field(default_factory=WaitMeter)
    queues: list[StoppableQueue] = dataclasses.field(default_factory=list)  # reported in step events
    evaluator: Evaluator | None = None
    last_checkpoint: int = -1
    _last_report: float = dataclasses.field(default_factory=time.perf_counter)
    # when the newest checkpoint was written (or training started): checkpoint.every_minutes counts from it
    _last_checkpoint_at: float = dataclasses.field(default_factory=time.monotonic)
    checkpoints: CheckpointWriter = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.checkpoints = CheckpointWriter(self.run_dir / "checkpoints", self.config.checkpoint.keep,
                                            resolved_yaml(self.config), self.events, self.latch)

    def training_started(self) -> None:
        """Throughput and checkpoint.every_minutes count from here, not from the startup."""
        self._last_report = time.perf_counter()
        self._last_checkpoint_at = time.monotonic()

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps

    @property
    def layout(self) -> Layout:
        return self.exchange.layout

    def host_batch(self, step: int, replica: int) -> HostBatch:
        entry = self.plan.entry(step, self.layout.global_index(replica))
        batch = collate(self.samples, entry, step, replica, self.config.data, self.config.drafter,
                        self.pad_id, self.config.seed)
        return batch.pin() if is_cuda(self.target_devices[0]) else batch

    def features(self, target: int, batch: HostBatch) -> FeatureBatch:
        device, drafter_device = self.target_devices[target], self.drafter_devices[batch.replica]
        features = self.taps[target].features(batch.input_ids.to(device, non_blocking=True))
        return FeatureBatch(batch, handoff(features, drafter_device), Fence(device))

    def report_step(self, step: int, applied: AppliedStep) -> None:
        """The step event, for every replica of the run (the sizes of the micro-batches of
        other ranks come from the plan, which every rank has)."""
        now = time.perf_counter()
        elapsed, self._last_report = max(now - self._last_report, 1e-9), now
        lr, grad_norm = applied.lr, applied.grad_norm
        loss = sum(applied.losses) / len(applied.losses)
        acc = [round(c / n, 4) if n else None for c, n in zip(applied.correct, applied.counted)]
        entries = [self.plan.entry(step, g) for g in range(self.plan.replicas)]
        tokens, samples = sum(self.plan.tokens(e) for e in entries), sum(len(e.samples) for e in entries)
        self.losses.append(loss)
        self.events.emit("step", step=step, loss=round(loss, 6), acc=acc, tokens_per_s=round(tokens / elapsed, 2),
                         samples_per_s=round(samples / elapsed, 3), queue_depths={q.name: q.depth() for q in self.queues},
                         wait_s=self.waits.take(), lr=lr, grad_norm=round(grad_norm, 4), epoch=entries[0].epoch,
                         total_steps=self.total_steps, peak_memory_bytes=self.peak_memory())
        if step % self.config.log_every == 0 or step == self.total_steps:
            say(f"step {step}/{self.total_steps} loss {loss:.4f} acc@1 {acc[0]} lr {lr:.2e} "
                f"tokens/s {tokens / elapsed:.0f}")

    def peak_memory(self) -> list[int | None]:
        """torch.cuda.max_memory_allocated of each drafter's device since the start (None
        on CPU, which has no such counter); drafters sharing a device share its figure."""
        return [torch.cuda.max_memory_allocated(device) if is_cuda(device) else None
                for device in self.drafter_devices]

    # The lead replica's part of a run, the same in both pipelines; `evaluate` runs an
    # evaluation request or hands it to the evaluation thread.

    def before_training(self, lead: Replica, evaluate: Callable[[EvalRequest], None]) -> None:
        """The untrained drafter's acceptance length, the baseline of the final one."""
        if self.evaluator is not None and self.config.eval.at_start:
            evaluate(EvalRequest(self.start_step, cpu_weights(lead.drafter), baseline=True))

    @property
    def writes_outputs(self) -> bool:
        """Rank 0 reports steps, writes checkpoints and the export, and evaluates."""
        return self.layout.rank == 0

    def after_step(self, step: int, lead: Replica, applied: AppliedStep,
                   evaluate: Callable[[EvalRequest], None]) -> None:
        """Report the step, then checkpoint and evaluate when due (rank 0)."""
        if not self.writes_outputs:
            return
        self.report_step(step, applied)
        if self.checkpoint_due(step):
            self.save_checkpoint(lead)
        if self.eval_due(step):
            evaluate(EvalRequest(step, cpu_weights(lead.drafter)))

    def after_training(self, lead: Replica, evaluate: Callable[[EvalRequest], None]) -> None:
        """Export the trained drafter, then its final evaluation (rank 0); the last
        checkpoint is complete before this returns."""
        if not self.writes_outputs:
            return
        self.export(lead)
        self.checkpoints.wait()
        if self.evaluator is not None:
            evaluate(EvalRequest(self.total_steps, cpu_weights(lead.drafter), final=True))

    def checkpoint_due(self, step: int) -> bool:
        """At the last step, every `every` steps, and once `every_minutes` passed since the
        newest checkpoint, whichever comes first."""
        every, minutes = self.config.checkpoint.every, self.config.checkpoint.every_minutes
        return (step == self.total_steps or (every > 0 and step % every == 0)
                or (minutes > 0 and time.monotonic() - self._last_checkpoint_at >= minutes * 60))

    def eval_due(self, step: int) -> bool:
        every = self.config.eval.every
        return self.evaluator is not None and every > 0 and step % every == 0 and step != self.total_steps

    def save_checkpoint(self, replica: Replica) -> None:
        step = replica.completed_step  # >= 1: checkpoints follow steps
        entry = self.plan.last_entry(step)
        state = TrainingState(step=step, epoch=entry.epoch, batch_index=entry.index, replicas=self.plan.replicas,
                              losses=list(self.losses), world_size=self.layout.world_size)
        start = time.perf_counter()
        snapshot = take_snapshot(state, replica.drafter, replica.optimizer, replica.scheduler)
        self.checkpoints.submit(snapshot, held_s=time.perf_counter() - start)
        self.last_checkpoint = step
        self._last_checkpoint_at = time.monotonic()

    def export(self, replica: Replica) -> None:
        """DIR/export in `export_dtype`, replaced atomically (a previous export stays whole
        until the new one is)."""
        final = self.run_dir / "export"
        dtype = getattr(torch, self.config.export_dtype)
        replace_dir(final, lambda staging: export_drafter(replica.drafter, staging, dtype))
        self.events.emit("export", step=replica.completed_step, path=str(final))
        say(f"exported the drafter to {final}")


@dataclasses.dataclass
class Channels:
    target_queues: list[StoppableQueue]
    drafter_queues: list[StoppableQueue]
    eval_queue: StoppableQueue | None
    rendezvous: Rendezvous


def prefetch_body(run: Run, channels: Channels):
    def body(worker: JobThread) -> None:
        run.faults.fire(worker.name)
        worker.phase = "train"
        targets = len(channels.target_queues)
        for step in range(run.start_step + 1, run.total_steps + 1):
            worker.step = step
            run.faults.fire(worker.name, step)
            for replica in range(len(channels.drafter_queues)):
                batch = run.host_batch(step, replica)
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
                run.faults.fire(worker.name, batch.step)
                run.waits.add(worker.name, channels.drafter_queues[batch.replica].put(run.features(index, batch)))
                run.latch.progressed()
            worker.phase = "shutdown"
    return body


def drafter_body(run: Run, channels: Channels, index: int, start_replica):
    """`start_replica(index)` builds the replica and its train step (weights on the
    device, compile warm-up): the startup that `wait_until_ready` waits for."""

    def body(worker: JobThread) -> None:
        with thread_stream(run.drafter_devices[index]):
            run.faults.fire(worker.name)
            replica = start_replica(index)
            worker.mark_ready()
            run.events.emit("ready", replica=replica.index, device=replica.device, compile=run.config.compile,
                            rank=run.layout.rank, world_size=run.layout.world_size)
            run.latch.progressed()
            worker.phase = "train"
            lead = replica.index == 0

            def evaluate(request: EvalRequest) -> None:  # on the evaluation thread (which exists if needed)
                channels.eval_queue.put(request)

            if lead:
                run.before_training(replica, evaluate)
                if run.peers is not None:  # the first all-reduce must not time out on a slower host's warm-up
                    run.peers.wait_for_all(READY, run.config.runtime.ready_timeout_s)
            for step in range(run.start_step + 1, run.total_steps + 1):
                worker.step = step
                feature_batch, waited = channels.drafter_queues[replica.index].get()
                run.waits.add(worker.name, waited)
                assert feature_batch.host.step == step, (feature_batch.host.step, step)
                run.faults.fire(worker.name, step)
                stats = replica.run_step(feature_batch, poison=run.faults.poisons(worker.name, step))
                started = time.perf_counter()
                averaged = channels.rendezvous.exchange(replica.index, replica.post(stats), run.exchange.average)
                run.waits.add(worker.name, time.perf_counter() - started)
                try:
                    applied = replica.apply(averaged, step)
                except NonFiniteStep as exc:
                    raise stop_unless_reporter(run, replica, exc) from None
                run.latch.progressed()
                if lead:
                    run.after_step(step, replica, applied, evaluate)
            worker.phase = "shutdown"
            if lead:
                run.after_training(replica, evaluate)
    return body


def stop_unless_reporter(run: Run, replica: Replica, exc: NonFiniteStep) -> BaseException:
    """Every replica of the run found the non-finite step; the one it names records it.
    The others stop without a record; on another rank than the reporter's, the first of
    them records PeerFailed, the root cause being that rank's."""
    if exc.reporter == replica.global_index:
        return exc
    reporter_rank = exc.reporter // run.layout.local_replicas
    if reporter_rank != run.layout.rank and run.peers is not None:
        run.peers.peer_failed(reporter_rank, type(exc).__name__, str(exc))
    return StopRequested(f"{run.layout.replica_name(exc.reporter)} found a non-finite step")


def eval_body(run: Run, channels: Channels):
    def body(worker: JobThread) -> None:
        assert run.evaluator is not None and channels.eval_queue is not None
        with thread_stream(run.evaluator.device):
            run.faults.fire(worker.name)
            while True:
                worker.phase = "train"
                request, _ = channels.eval_queue.get()
                worker.phase, worker.step = "eval", request.step
                run.faults.fire(worker.name, request.step)
                run.evaluator.measure(request)
                if request.final:
                    break
    return body
