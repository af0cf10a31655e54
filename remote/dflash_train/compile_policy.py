"""How a drafter thread gets its train step: `compile: off | default | cudagraphs`.

A drafter calls `build_train_step` once, during its startup and before it signals ready.
Building (compiling, warming up, capturing graphs) happens under one process-wide lock,
so drafters compile one at a time: torch.compile is not thread-safe overall, and CUDA
graph captures of two threads break each other. `cudagraphs` is provided by
`cudagraphs.build_cudagraph_train_step(objective, example)` with the same contract.

The train step runs forward and backward only; gradient averaging across replicas and
the optimizer step follow in the drafter thread.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch

from .objective import DraftObjective, DrafterInputs, block_labels, position_weights

_BUILD_LOCK = threading.Lock()


@dataclasses.dataclass
class StepStats:
    loss: torch.Tensor  # () detached
    correct: torch.Tensor  # (bs-1,) hits per block position
    counted: torch.Tensor  # (bs-1,) learnable tokens per block position


TrainStep = Callable[[DrafterInputs], StepStats]


def configure_compiler(mode: str, num_drafters: int) -> None:
    """Process-wide compiler settings, set once before any drafter thread starts (never
    patched inside a worker). Every replica's module is a distinct guard target, so the
    recompile limit grows with the number of drafters."""
    if mode == "off":
        return
    import torch._dynamo
    import torch._inductor.config

    limit = max(8, 4 * num_drafters)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = limit
    else:  # older releases name it cache_size_limit
        torch._dynamo.config.cache_size_limit = limit
    # Inductor's coalescing analysis "does not yet apply to dynamic shapes" (its own config
    # comment) yet runs on them, and asserts in get_pw_red_splits on this step (torch 2.11, CUDA).
    torch._inductor.config.triton.coalesce_tiling_analysis = False


def example_inputs(objective: DraftObjective, seq_len: int, num_features: int, device: str) -> DrafterInputs:
    """A small, valid micro-batch to warm a step up with (random tokens and features).

    No dimension is 1: torch.compile specializes sizes 0 and 1, so a warm-up with one
    sequence would be recompiled by the first real batch, in every thread at once."""
    generator = torch.Generator().manual_seed(0)
    block_size, batch, seq_len = objective.drafter.block_size, 2, max(seq_len, 16)
    vocab = objective.embed_weight.shape[0]
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    anchors = torch.stack([torch.sort(torch.randperm(seq_len - 2, generator=generator)[:8] + 1).values
                           for _ in range(batch)])  # (2, 8)
    anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
    labels, weights = block_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool), anchors,
                                   anchor_valid, position_weights(block_size, 7.0))
    features = torch.randn(batch, seq_len, num_features, generator=generator).to(objective.embed_weight.dtype)
    return DrafterInputs(*(t.to(device) for t in (input_ids, features, anchors, anchor_valid, labels, weights)))


def build_train_step(mode: str, objective: DraftObjective, example: DrafterInputs) -> TrainStep:
    """The forward+backward callable for one replica, built and warmed up under the lock."""
    with _BUILD_LOCK:
        if mode == "cudagraphs":
            from .cudagraphs import build_cudagraph_train_step

            return build_cudagraph_train_step(objective, example)
        # dynamic=True: micro-batch shapes vary with the data; one graph serves them all.
        forward = objective if mode == "off" else torch.compile(objective, dynamic=True)

        def train_step(inputs: DrafterInputs) -> StepStats:
            loss, correct, counted = forward(inputs)
            loss.backward()
            return StepStats(loss.detach(), correct, counted)

        train_step(example)  # compiles now, not in the first training step
        objective.drafter.zero_grad(set_to_none=True)
        return train_step
