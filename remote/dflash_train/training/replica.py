"""One data-parallel drafter replica: weights, optimizer, scheduler and train step.

Every replica starts from the same weights and applies the same averaged gradients (one
tensor, summed by the lead replica and copied to every replica: gradients.py), so all
replicas stay identical, in one process or in every process of a run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import threading
from typing import Any

import torch

from ..compiling.step_build import StepStats, TrainStep
from ..config import JobConfig
from ..data.batches import HostBatch
from ..devices import CAPTURE_LOCK, Fence, is_cuda
from ..model.drafter import drafter_on
from ..model.objective import DraftObjective, DrafterInputs
from .distributed import Layout
from .gradients import Averaged, Posted, step_facts
from .optimizer_step import OptimizerStep, optimizer_form


@dataclasses.dataclass
class FeatureBatch:
    """A micro-batch with its target features, handed from a target to a drafter thread."""

    host: HostBatch
    features: torch.Tensor  # (B, S, n*H) on the drafter's device
    fence: Fence

    def to_inputs(self, device: str) -> DrafterInputs:
        self.fence.wait(device, self.features)
        host = self.host
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return DrafterInputs(move(host.input_ids), self.features, move(host.anchors), move(host.anchor_valid),
                             move(host.labels), move(host.weights))


class FrozenTargetWeights:
    """The target's input embedding and LM head, one copy per device, shared by replicas."""

    def __init__(self, targets: dict[str, torch.nn.Module]):
        self._targets = targets  # device -> the target model living there
        self._copies: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def on(self, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if device not in self._copies:
                model = self._targets[device] if device in self._targets else next(iter(self._targets.values()))
                embed = model.get_input_embeddings().weight.detach()
                head = model.get_output_embeddings().weight.detach()
                self._copies[device] = (embed.to(device), head.to(device))
            return self._copies[device]


@dataclasses.dataclass(frozen=True)
class AppliedStep:
    """What one optimizer step read back to the host, about every replica of the run."""

    lr: float  # the learning rate it used
    grad_norm: float  # of the averaged gradients, before clipping
    losses: list[float]  # every replica's loss, in the run's replica order
    correct: list[float]  # (bs-1,) hits per block position, summed over the replicas
    counted: list[float]  # (bs-1,) learnable tokens per block position, summed over the replicas


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; its update was not applied.

    Every replica reads the same values (all losses, the norm of the shared averaged
    gradients), so all of them find it at the same step. `reporter` is the replica (its
    index in the run) that records it: the first whose loss is non-finite, else the lead. `detail` goes into the
    errors.jsonl record (non-finite numbers as the strings "nan", "inf", "-inf")."""

    def __init__(self, message: str, reporter: int, detail: dict[str, Any]):
        super().__init__(message)
        self.reporter = reporter
        self.detail = detail


NONFINITE_NAMES_SHOWN = 8


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


class Replica:
    def __init__(self, index: int, device: str, config: JobConfig, hf_config: Any,
                 weights: dict[str, torch.Tensor], frozen: FrozenTargetWeights, total_steps: int,
                 layout: Layout = Layout()):
        self.index = index  # in this process: drafter-<index>
        self.layout = layout
        self.global_index = layout.global_index(index)  # in the run: which micro-batches it trains on
        self.device = device
        self.drafter = drafter_on(hf_config, device)
        self.drafter.load_state_dict(weights)
        self.drafter.train()
        embed, head = frozen.on(device)
        self.objective = DraftObjective(self.drafter, embed, head, config.uses_flex)
        self.optimizer_step = OptimizerStep(list(self.drafter.parameters()), config.optim, total_steps,
                                            optimizer_form(config.compile, device))
        self.optimizer, self.scheduler = self.optimizer_step.optimizer, self.optimizer_step.scheduler
        self.accumulate = config.optim.accumulate  # micro-batches per optimizer step
        self.train_step: TrainStep | None = None  # set by the compile policy during startup
        self.completed_step = 0

    def load_training_state(self, optimizer: dict[str, Any], scheduler: dict[str, Any], step: int) -> None:
        self.optimizer_step.load_state_dict(optimizer, scheduler)  # a copy per replica
        self.completed_step = step

    def prepare_optimizer(self) -> None:
        """AdamW's state made, and under compile: cudagraphs its graph captured: in the
        replica's thread at start-up, after its train step (and any checkpoint) is loaded."""
        if self.optimizer_step.form != "graph":
            self.optimizer_step.prepare()
            return
        with CAPTURE_LOCK, torch.cuda.device(self.device):
            self.optimizer_step.prepare()

    def run_step(self, batch: FeatureBatch, poison: bool = False, summed: StepStats | None = None) -> StepStats:
        """Forward and backward of micro-batch `batch.host.micro` of a step: the first
        starts from zero gradients, the others add theirs. `summed`: the stats of the
        step's earlier micro-batches; returned with this one's added. `poison` (the
        `nonfinite` fault) feeds NaN target features, so the loss and the gradients come
        out NaN as from a forward that diverged."""
        assert self.train_step is not None, "the train step is built during startup"
        micro = batch.host.micro
        inputs = batch.to_inputs(self.device)
        if poison:
            inputs.features = torch.full_like(inputs.features, math.nan)
        stats = self.train_step(inputs, first=micro == 0, last=micro == self.accumulate - 1)
        return stats if summed is None else summed.plus(stats)

    def post(self, summed: StepStats) -> Posted:
        """This step's gradients and facts, for the gradient exchange: the mean over the
        step's micro-batches of their gradients and losses (each micro-batch's loss is
        already its own weighted mean), the accuracy counts summed."""
        grads = [p.grad for p in self.drafter.parameters()]
        if self.accumulate > 1:
            torch._foreach_div_(grads, self.accumulate)
            summed = StepStats(summed.loss / self.accumulate, summed.correct, summed.counted)
        return Posted(grads, step_facts(summed, grads[0].dtype), Fence(self.device), self.device)

    def apply(self, averaged: Averaged, step: int) -> AppliedStep:
        """Set the averaged gradients, check them and every replica's loss, clip, step.

        The norm and the facts of every replica (loss, accuracy counts) come to the host
        in one read: the one host sync a step has always taken here (clipping and AdamW
        after it take none: optimizer_step.py). NonFiniteStep if the
        norm or a loss is NaN or infinite, before the optimizer step, so the weights never
        take a non-finite update."""
        averaged.fence.wait(self.device, averaged.flat)
        norm = torch.nn.utils.get_total_norm(averaged.grads)
        grad_norm, *facts = torch.cat([norm.reshape(1), averaged.facts.reshape(-1).to(norm.dtype)]).tolist()
        width = averaged.facts.shape[1]  # 1 + 2 (bs - 1)
        rows = [facts[i:i + width] for i in range(0, len(facts), width)]
        losses = [row[0] for row in rows]
        if not all(math.isfinite(value) for value in (grad_norm, *losses)):
            raise self._non_finite(step, grad_norm, losses, averaged.grads)
        lr = self.optimizer_step.apply(averaged.grads, norm)
        self.completed_step = step
        positions = (width - 1) // 2
        return AppliedStep(lr, grad_norm, losses, [sum(r[1 + k] for r in rows) for k in range(positions)],
                           [sum(r[1 + positions + k] for r in rows) for k in range(positions)])

    def _non_finite(self, step: int, grad_norm: float, losses: list[float],
                    grads: list[torch.Tensor]) -> NonFiniteStep:
        """The failure path only: which parameters' averaged gradients are non-finite."""
        names = [name for name, _ in self.drafter.named_parameters()]
        finite = torch.stack([torch.isfinite(grad).all() for grad in grads]).tolist()
        bad = [name for name, ok in zip(names, finite) if not ok]
        bad_loss = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
        if bad_loss is not None:
            reporter, quantity, value = bad_loss, "loss", losses[bad_loss]
            what = f"the loss of {self.layout.replica_name(bad_loss)} is {value} (gradient norm {grad_norm:.6g})"
        else:
            reporter, quantity, value = 0, "grad_norm", grad_norm
            what = f"the gradient norm is {value} (losses {', '.join(f'{x:.6g}' for x in losses)})"
        if bad:
            shown = ", ".join(bad[:NONFINITE_NAMES_SHOWN]) + (", …" if len(bad) > NONFINITE_NAMES_SHOWN else "")
            where = f"non-finite gradients first in {shown} ({len(bad)} of {len(names)} parameters)"
        elif math.isfinite(grad_norm):
            where = "the gradients are finite"
        else:
            where = "every gradient is finite (their norm overflowed)"
        detail = {"quantity": quantity, "value": _json_number(value), "replica": reporter,
                  "grad_norm": _json_number(grad_norm), "losses": [_json_number(x) for x in losses],
                  "nonfinite_grads": bad[:NONFINITE_NAMES_SHOWN], "nonfinite_grad_count": len(bad),
                  "parameters": len(names)}
        return NonFiniteStep(f"step {step}: {what}; {where}; the update was not applied", reporter, detail)


class ReplicasDiverged(RuntimeError):
    """Data-parallel replicas that should be bit-identical are not."""


def weights_checksum(module: torch.nn.Module) -> str:
    """sha256 over every tensor of the state dict: names, dtypes, shapes and raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        flat = tensor.detach().reshape(-1).to("cpu").contiguous()
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def verify_replicas_identical(replicas: list[Replica]) -> list[str]:
    """Every replica's checksum, or ReplicasDiverged naming the ones that differ from replica 0.

    Replicas start from one set of weights and apply the same averaged gradients in the
    same order, so after any step they must agree to the bit; if not, the gradient
    exchange is broken and the export (replica 0) is not what the others trained."""
    for device in {replica.device for replica in replicas if is_cuda(replica.device)}:
        torch.cuda.synchronize(device)  # each replica's last update ran on its own thread's stream
    checksums = [weights_checksum(replica.drafter) for replica in replicas]
    differing = [r.index for r, c in zip(replicas, checksums) if c != checksums[0]]
    if differing:
        raise ReplicasDiverged(
            f"drafter replicas {differing} differ from replica 0 after step {replicas[0].completed_step} "
            f"(sha256 of the weights: {', '.join(f'{r.index}={c[:16]}' for r, c in zip(replicas, checksums))})")
    return checksums
