"""How a drafter thread gets its train step: `compile: off | default | cudagraphs`.

The coordinator decides once, from the config, what every drafter builds (`plan_compile`:
the mode, and for cudagraphs the shape buckets to capture and whether drafters share a
GPU), sets the process-wide compiler options from that plan (`configure_compiler`), then
each drafter calls `build_train_step` once, during its startup and before it signals
ready. Building (compiling, warming up, capturing graphs) happens under one process-wide
lock, so drafters compile one at a time: torch.compile is not thread-safe overall, and
CUDA graph captures of two threads break each other.

The train step runs forward and backward only; gradient averaging across replicas and
the optimizer step follow in the drafter thread. With `optim.accumulate` > 1 it runs once
per micro-batch: `first` starts from zero gradients, later calls add to them, and after
the `last` the sum is in every parameter's `.grad`.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from .config import TrainConfig
from .devices import canonical
from .objective import DraftObjective, DrafterInputs, block_labels, position_weights

if TYPE_CHECKING:
    from .cudagraphs import BatchShape

_BUILD_LOCK = threading.Lock()
# compile: default compiles with dynamic shapes: one graph per drafter, plus the
# re-specializations Dynamo still makes (a size of 1, sizes equal at the first trace).
DYNAMIC_SHAPE_VARIANTS = 2


@dataclasses.dataclass
class StepStats:
    loss: torch.Tensor  # () detached
    correct: torch.Tensor  # (bs-1,) hits per block position
    counted: torch.Tensor  # (bs-1,) learnable tokens per block position

    def plus(self, other: "StepStats") -> "StepStats":
        """Two micro-batches' stats summed (the loss too: the replica averages it)."""
        return StepStats(self.loss + other.loss, self.correct + other.correct, self.counted + other.counted)


class TrainStep(Protocol):
    def __call__(self, inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats: ...



StepBuilder = Callable[[DraftObjective, DrafterInputs], TrainStep]


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """What every drafter of one run builds; decided before any drafter thread starts."""

    mode: str  # off | default | cudagraphs
    num_drafters: int = 1
    buckets: tuple[BatchShape, ...] = ()  # cudagraphs: every shape a batch can have, captured at start-up
    drafters_share_a_device: bool = True  # cudagraphs: picks the capture strategy

    def __post_init__(self) -> None:
        if self.mode == "cudagraphs" and not self.buckets:
            # Capturing only the warm-up example's shape would fail the first real batch.
            raise ValueError("compile: cudagraphs needs the shape buckets of the run (see plan_compile)")

    @property
    def shapes_per_drafter(self) -> int:
        """Graphs Dynamo compiles per drafter: one per bucket for the static cudagraphs
        compile, a dynamic graph and its re-specializations otherwise."""
        return len(self.buckets) if self.mode == "cudagraphs" else DYNAMIC_SHAPE_VARIANTS

    def builder(self) -> StepBuilder:
        """The function that builds one replica's train step for this plan."""
        if self.mode == "cudagraphs":
            from .cudagraphs import build_cudagraph_train_step

            return functools.partial(build_cudagraph_train_step, buckets=self.buckets,
                                     drafters_share_a_device=self.drafters_share_a_device)
        return functools.partial(_build_eager_or_compiled, self.mode)


def plan_compile(config: TrainConfig) -> CompilePlan:
    """The run's compile plan. Devices compare canonically ("cuda" is "cuda:0"), so two
    drafters written as cuda and cuda:0 count as sharing a GPU."""
    drafters = [canonical(d) for d in config.devices.drafters]
    buckets: tuple[BatchShape, ...] = ()
    if config.compile == "cudagraphs":
        from .cudagraphs import bucket_shapes

        buckets = bucket_shapes(config.data, config.drafter)
    return CompilePlan(mode=config.compile, num_drafters=len(drafters), buckets=buckets,
                       drafters_share_a_device=len(set(drafters)) < len(drafters))


def recompile_limit(num_drafters: int, shapes_per_drafter: int) -> int:
    """Dynamo's cache entries per code object. Every replica compiles the same
    DraftObjective.forward, each shape of each replica is an entry, and past the limit
    Dynamo silently runs the code eagerly: size it to the run, with room to spare."""
    return max(8, 2 * num_drafters * shapes_per_drafter)


def configure_compiler(mode: str, num_drafters: int, shapes_per_drafter: int = DYNAMIC_SHAPE_VARIANTS) -> None:
    """Process-wide compiler settings, set once before any drafter thread starts (never
    patched inside a worker)."""
    if mode == "off":
        return
    import torch._dynamo
    import torch._inductor.config

    limit = recompile_limit(num_drafters, shapes_per_drafter)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = limit
    else:  # older releases name it cache_size_limit
        torch._dynamo.config.cache_size_limit = limit
    # Inductor's coalescing analysis "does not yet apply to dynamic shapes" (its own config
    # comment) yet runs on them, and asserts in get_pw_red_splits on this step (torch 2.11, CUDA).
    torch._inductor.config.triton.coalesce_tiling_analysis = False


def random_inputs(rows: int, length: int, blocks: int, *, block_size: int, vocab: int, num_features: int,
                  features_dtype: torch.dtype, device: str | torch.device, seed: int) -> DrafterInputs:
    """A valid micro-batch of random tokens and features: input_ids (rows, length), blocks
    anchors a row, of which the first min(blocks, length - 2) are real (an anchor needs a
    token before and after it) and the rest invalid padding."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    real = min(blocks, length - 2)
    anchors = torch.zeros((rows, blocks), dtype=torch.long)
    anchors[:, :real] = torch.stack([torch.sort(torch.randperm(length - 2, generator=generator)[:real]).values
                                     for _ in range(rows)]) + 1
    anchor_valid = torch.arange(blocks).expand(rows, -1) < real
    labels, weights = block_labels(input_ids, torch.zeros_like(input_ids), anchors, anchor_valid,  # one turn
                                   position_weights(block_size, 7.0))
    features = torch.randn(rows, length, num_features, generator=generator).to(features_dtype)
    return DrafterInputs(*(t.to(device) for t in (input_ids, features, anchors, anchor_valid, labels, weights)))


def example_inputs(objective: DraftObjective, seq_len: int, num_features: int, device: str) -> DrafterInputs:
    """A small, valid micro-batch to warm a step up with: 2 rows, at least 16 tokens, 8 blocks.

    No dimension is 1: torch.compile specializes sizes 0 and 1, so a warm-up with one
    sequence would be recompiled by the first real batch, in every thread at once."""
    return random_inputs(2, max(seq_len, 16), 8, block_size=objective.drafter.block_size,
                         vocab=objective.embed_weight.shape[0], num_features=num_features,
                         features_dtype=objective.embed_weight.dtype, device=device, seed=0)


def build_train_step(plan: CompilePlan | str, objective: DraftObjective, example: DrafterInputs) -> TrainStep:
    """The forward+backward callable for one replica, built and warmed up under the lock.

    A bare mode ("off", "default") stands for a plan of that mode, for callers that build
    a step outside a run (benchmarks); cudagraphs needs a whole plan (its buckets)."""
    if isinstance(plan, str):
        plan = CompilePlan(plan)
    with _BUILD_LOCK:
        return plan.builder()(objective, example)


def _build_eager_or_compiled(mode: str, objective: DraftObjective, example: DrafterInputs) -> TrainStep:
    # dynamic=True: micro-batch shapes vary with the data; one graph serves them all.
    forward = objective if mode == "off" else torch.compile(objective, dynamic=True)

    def train_step(inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats:
        if first:  # backward adds to .grad: a step starts from none
            objective.drafter.zero_grad(set_to_none=True)
        loss, correct, counted = forward(inputs)
        loss.backward()
        return StepStats(loss.detach(), correct, counted)

    train_step(example)  # compiles now, not in the first training step
    objective.drafter.zero_grad(set_to_none=True)
    return train_step
