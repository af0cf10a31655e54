"""What rank 0 does besides training, and when: the step report, checkpoints, evaluation
requests and the export.

The step loop (loop.run_steps) calls `evaluate_baseline` and `after_step` with the lead
replica (drafter-0), its caller `after_training` (drafter-0's thread, or the main thread
in a sequential run); `evaluate` runs an evaluation request or hands it to the
evaluation thread, where an `Evaluator` measures it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from dflash_contract.events import EVAL, EXPORT, STEP

from dflash_files.checkpoint_files import CHECKPOINTS_DIR, EXPORT_DIR

from ..checkpoint.folders import replace_dir, snapshot_layout, take_snapshot
from ..checkpoint.state import TrainingState
from ..checkpoint.writer import CheckpointWriter
from ..config import EvalConfig, resolved_yaml
from ..devices import is_cuda
from ..faults import FaultInjector
from ..model.drafter import cpu_weights, drafter_on, export_drafter
from ..model.speculative import evaluate, evaluation_decoder
from ..model.target import FeatureTap
from ..runlog import EventLog, say
from ..threads import StopLatch, StoppableQueue
from .replica import AppliedStep, Replica
from .run_context import Run


@dataclasses.dataclass
class EvalRequest:
    step: int
    weights: dict[str, torch.Tensor]  # a snapshot of the drafter (CPU copies)
    baseline: bool = False  # the drafter as this run found it (untrained for a fresh run)
    final: bool = False


class Evaluator:
    """Acceptance length of drafter snapshots, measured against target-0, as the `eval`
    thread (or the main thread of a sequential run) measures them: its fault at step:N
    fires as the evaluation of step N starts, the baseline of a run resumed at N included."""

    def __init__(self, events: EventLog, latch: StopLatch, faults: FaultInjector, spec: EvalConfig,
                 hf_config: Any, tap: FeatureTap, device: str, embed: torch.Tensor, head: torch.Tensor,
                 prompts: list[list[int]], stop_ids: set[int]):
        self.events, self.latch, self.faults, self.spec = events, latch, faults, spec
        self.device, self.prompts, self.stop_ids = device, prompts, stop_ids
        # Built once: the decoder's buffers and CUDA graphs (captured at the first evaluation)
        # serve every evaluation; a snapshot is loaded into this drafter's tensors in place.
        self.drafter = drafter_on(hf_config, device).eval()
        capacity = max(map(len, prompts), default=0) + spec.max_new_tokens + self.drafter.block_size
        self.decoder, refused = evaluation_decoder(self.drafter, tap, embed, head, capacity, spec.cuda_graphs,
                                                   spec.compile_steps)
        if refused:
            say(f"evaluation: {refused}: decoding with the reference path (transformers' KV cache, eager)")
        # Start-up runs in the main thread before the pipeline's threads start: a capture
        # then overlaps no other thread's work on the GPU (docs/cuda-graphs-in-threads.md).
        self.decoder.capture(alone=spec.speedup)
        self.baseline: tuple[int, float] | None = None

    def _stepped(self) -> None:
        self.latch.progressed()
        self.latch.check()  # a long evaluation must not hold up a stopping run

    def measure(self, request: EvalRequest) -> None:
        self.faults.fire("eval", request.step)
        self.drafter.load_state_dict(request.weights)
        started = time.perf_counter()
        result = evaluate(self.decoder, self.prompts, self.spec.max_new_tokens, self.stop_ids, on_step=self._stepped,
                          speedup=self.spec.speedup)
        if request.baseline:
            self.baseline = (request.step, result.acceptance_length)
        fields: dict[str, Any] = {
            "step": request.step, **result.fields(time.perf_counter() - started),
            "baseline": request.baseline, "final": request.final, "cuda_graphs": self.decoder.cuda_graphs,
            "compiled": self.decoder.compiled}
        if self.baseline is not None:
            fields.update(baseline_step=self.baseline[0], baseline_acceptance_length=round(self.baseline[1], 4))
        self.events.emit(EVAL, **fields)
        text = f"eval at step {request.step}: {result.summary()}"
        if request.final and self.baseline is not None:
            text += (f" (at step {self.baseline[0]}, before this run trained: {self.baseline[1]:.3f}; "
                     f"gain {result.acceptance_length - self.baseline[1]:+.3f})")
        say(text)


class OutputSchedule:
    """Rank 0's step reports, checkpoints, evaluations and export, each when it is due.

    `evaluator` is None when the run has no eval prompts (or on another rank); `queues`
    are reported in step events (none in a sequential run); `losses` is the loss curve
    so far (carried across resumes, saved in checkpoints); `starting_weights` the CPU
    weights every replica is loaded from, the baseline evaluation's.
    """

    def __init__(self, run: Run, evaluator: Evaluator | None, queues: list[StoppableQueue], losses: list[float],
                 starting_weights: dict[str, torch.Tensor]):
        self.run, self.evaluator, self.queues, self.losses = run, evaluator, queues, losses
        self._starting_weights: dict[str, torch.Tensor] | None = starting_weights
        self.config, self.run_dir, self.events, self.plan = run.config, run.run_dir, run.events, run.plan
        self.checkpoints = CheckpointWriter(self.run_dir / CHECKPOINTS_DIR, self.config.checkpoint.keep,
                                            resolved_yaml(self.config), self.events, run.latch)
        self.last_checkpoint = run.start_step  # the newest checkpoint's step (the resumed one's; 0 for none)
        self._last_report = time.perf_counter()
        # when the newest checkpoint was written (or training started): checkpoint.every_minutes counts from it
        self._last_checkpoint_at = time.monotonic()

    @property
    def total_steps(self) -> int:
        return self.run.total_steps

    @property
    def writes_outputs(self) -> bool:
        """Rank 0 reports steps, writes checkpoints and the export, and evaluates."""
        return self.run.layout.rank == 0

    def training_started(self) -> None:
        """Throughput and checkpoint.every_minutes count from here, not from the startup."""
        self._last_report = time.perf_counter()
        self._last_checkpoint_at = time.monotonic()

    @property
    def nothing_to_train(self) -> bool:
        """An attempt resumed from the last step's checkpoint: it only finishes the run."""
        return self.run.start_step == self.total_steps

    def evaluate_baseline(self, evaluate: Callable[[EvalRequest], None]) -> None:
        """The untrained drafter's acceptance length, the baseline of the final one (none
        when nothing is left to train: the drafter as found is the final one). Of the CPU
        weights the replicas were loaded from, kept here, so it may run after training
        has begun: a copy back from the lead's GPU (4 GiB at the Qwen3-8B drafter shape)
        would share the bus with the next drafter's set-up."""
        weights, self._starting_weights = self._starting_weights, None
        if self.evaluator is not None and self.config.eval.at_start and not self.nothing_to_train:
            evaluate(EvalRequest(self.run.start_step, weights, baseline=True))

    def after_step(self, step: int, lead: Replica, applied: AppliedStep,
                   evaluate: Callable[[EvalRequest], None]) -> None:
        """Report the step, then checkpoint and evaluate when due (rank 0)."""
        if not self.writes_outputs:
            return
        self.report_step(step, applied)
        if step == self.run.start_step + 1:  # the optimizer's state exists from here
            self.checkpoints.reserve(snapshot_layout(lead.drafter, lead.optimizer, lead.scheduler))
        if self.checkpoint_due(step):
            self.save_checkpoint(lead)
        if self.eval_due(step):
            evaluate(EvalRequest(step, cpu_weights(lead.drafter)))

    def after_training(self, lead: Replica, evaluate: Callable[[EvalRequest], None]) -> None:
        """Export the trained drafter, then its final evaluation (rank 0); the last
        checkpoint is complete before this returns."""
        if not self.writes_outputs:
            return
        final = self.run_dir / EXPORT_DIR
        if self.nothing_to_train and final.is_dir():
            # Written whole (replace_dir) from these weights by the attempt that trained
            # the last step: a finished export is not touched again.
            say(f"nothing left to train after step {self.total_steps}: the export in {final} is kept")
        else:
            self.export(lead)
        self.checkpoints.wait()
        if self.evaluator is not None:
            evaluate(EvalRequest(self.total_steps, cpu_weights(lead.drafter), final=True))

    def report_step(self, step: int, applied: AppliedStep) -> None:
        """The step event, for every replica of the run and every micro-batch of the step
        (the sizes of the micro-batches of other ranks come from the plan, which every rank has)."""
        now = time.perf_counter()
        elapsed, self._last_report = max(now - self._last_report, 1e-9), now
        lr, grad_norm = applied.lr, applied.grad_norm
        loss = sum(applied.losses) / len(applied.losses)
        acc = [round(c / n, 4) if n else None for c, n in zip(applied.correct, applied.counted)]
        entries = self.plan.step_entries(step)
        tokens, samples = sum(self.plan.tokens(e) for e in entries), sum(len(e.samples) for e in entries)
        self.losses.append(loss)
        self.events.emit(STEP, step=step, loss=round(loss, 6), acc=acc, tokens_per_s=round(tokens / elapsed, 2),
                         samples_per_s=round(samples / elapsed, 3), queue_depths={q.name: q.depth() for q in self.queues},
                         wait_s=self.run.waits.take(), lr=lr, grad_norm=round(grad_norm, 4), epoch=entries[0].epoch,
                         total_steps=self.total_steps, peak_memory_bytes=self.peak_memory(),
                         micro_batches=len(entries), samples=samples, tokens=tokens)
        if step % self.config.log_every == 0 or step == self.total_steps:
            say(f"step {step}/{self.total_steps} loss {loss:.4f} acc@1 {acc[0]} lr {lr:.2e} "
                f"tokens/s {tokens / elapsed:.0f}")

    def peak_memory(self) -> list[int | None]:
        """torch.cuda.max_memory_allocated of each drafter's device since the start (None
        on CPU, which has no such counter); drafters sharing a device share its figure."""
        return [torch.cuda.max_memory_allocated(device) if is_cuda(device) else None
                for device in self.run.drafter_devices]

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
                              losses=list(self.losses), world_size=self.run.layout.world_size,
                              accumulate=self.plan.accumulate)
        self.checkpoints.save(lambda buffers: take_snapshot(state, replica.drafter, replica.optimizer,
                                                            replica.scheduler, buffers))
        self.last_checkpoint = step
        self._last_checkpoint_at = time.monotonic()

    def export(self, replica: Replica) -> None:
        """DIR/export in `export_dtype`, replaced atomically (a previous export stays whole
        until the new one is)."""
        final = self.run_dir / EXPORT_DIR
        dtype = getattr(torch, self.config.export_dtype)
        replace_dir(final, lambda staging: export_drafter(replica.drafter, staging, dtype))
        self.events.emit(EXPORT, step=replica.completed_step, path=str(final))
        say(f"exported the drafter to {final}")
