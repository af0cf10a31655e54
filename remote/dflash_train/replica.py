"""One data-parallel drafter replica: weights, optimizer, scheduler and train step.

Every replica starts from the same weights and applies the same averaged gradients
(summed in replica order, on every replica alike), so all replicas stay identical.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from .compile_policy import StepStats, TrainStep
from .config import TrainConfig
from .data import HostBatch
from .devices import Fence, is_cuda
from .model import DFlashDrafter
from .objective import DraftObjective, DrafterInputs, warmup_cosine


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


class Replica:
    def __init__(self, index: int, device: str, config: TrainConfig, hf_config: Any,
                 weights: dict[str, torch.Tensor], frozen: FrozenTargetWeights, total_steps: int):
        self.index = index
        self.device = device
        self.drafter = DFlashDrafter(hf_config)
        self.drafter.load_state_dict(weights)
        self.drafter.to(device).train()
        embed, head = frozen.on(device)
        self.objective = DraftObjective(self.drafter, embed, head, config.drafter.uses_flex)
        optim = config.optim
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(total_steps, optim.warmup_ratio))
        self.grad_clip = optim.grad_clip
        self.train_step: TrainStep | None = None  # set by the compile policy during startup
        self.completed_step = 0

    def load_training_state(self, optimizer: dict[str, Any], scheduler: dict[str, Any], step: int) -> None:
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        self.completed_step = step

    def run_step(self, batch: FeatureBatch) -> StepStats:
        assert self.train_step is not None, "the train step is built during startup"
        return self.train_step(batch.to_inputs(self.device))

    def gradients(self) -> tuple[list[torch.Tensor], Fence]:
        return [p.grad for p in self.drafter.parameters()], Fence(self.device)

    def apply(self, mean_grads: list[torch.Tensor], step: int) -> tuple[float, float]:
        """Set the averaged gradients, clip, step. Returns (lr used, grad norm before clipping)."""
        for param, grad in zip(self.drafter.parameters(), mean_grads):
            param.grad = grad
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.completed_step = step
        return lr, float(norm)


def average_gradients(posted: list[tuple[list[torch.Tensor], Fence]], device: str) -> list[torch.Tensor]:
    """Mean of every replica's gradients, in new tensors on `device`. The sum runs in
    replica order, so every replica computes bit-identical results."""
    if len(posted) == 1:
        return list(posted[0][0])
    for _, fence in posted:
        fence.wait(device)
    means = []
    for grads in zip(*(g for g, _ in posted)):
        total = grads[0].to(device, copy=True)
        for grad in grads[1:]:
            total.add_(grad.to(device, non_blocking=is_cuda(device)))
        means.append(total.div_(len(grads)))
    if is_cuda(device):
        # The owners free or overwrite their gradients right after the exchange: every
        # read of them must have finished on this stream before we report back.
        torch.cuda.current_stream(device).synchronize()
    return means
