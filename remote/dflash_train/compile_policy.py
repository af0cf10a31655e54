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
import threading

import torch

from .config import TrainConfig
from .cudagraphs import bucket_shapes, build_cudagraph_train_step
from .devices import canonical
from .objective import DraftObjective, DrafterInputs
from .train_step import (BatchShape, BucketTiming, BuildReport, BuiltStep, CompileShapes, StepStats, random_inputs,
                         shape_of, warm_up)

_BUILD_LOCK = threading.Lock()
# compile: default compiles with dynamic shapes: one graph per drafter, plus the
# re-specializations Dynamo still makes (a size of 1, sizes equal at the first trace).
DYNAMIC_SHAPE_VARIANTS = 2


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """What every drafter of one run builds; decided before any drafter thread starts."""

    mode: str  # off | default | cudagraphs
    num_drafters: int = 1
    buckets: tuple[BatchShape, ...] = ()  # cudagraphs: every shape a batch can have, captured at start-up
    drafters_share_a_device: bool = True  # cudagraphs: picks the capture strategy
    shapes: CompileShapes = "static"  # cudagraphs: one compile per bucket, or one for every bucket

    def __post_init__(self) -> None:
        if self.mode == "cudagraphs" and not self.buckets:
            # Capturing only the warm-up example's shape would fail the first real batch.
            raise ValueError("compile: cudagraphs needs the shape buckets of the run (see plan_compile)")

    @property
    def shapes_per_drafter(self) -> int:
        """Graphs Dynamo may compile per drafter, at most: one per bucket for cudagraphs
        (static shapes, or dynamic ones re-specialized per bucket at worst), a dynamic
        graph and its re-specializations otherwise."""
        return max(len(self.buckets), DYNAMIC_SHAPE_VARIANTS)

    @property
    def dynamic_shapes(self) -> bool:
        """Whether Inductor compiles with symbolic sizes: compile: default always,
        cudagraphs with compile_shapes: dynamic."""
        return self.mode == "default" or (self.mode == "cudagraphs" and self.shapes == "dynamic")

    def build(self, objective: DraftObjective, example: DrafterInputs) -> BuiltStep:
        """One replica's train step for this plan, compiled and warmed up (not locked)."""
        if self.mode == "cudagraphs":
            return build_cudagraph_train_step(objective, example, self.buckets, shapes=self.shapes,
                                              drafters_share_a_device=self.drafters_share_a_device)
        return _build_eager_or_compiled(self.mode, objective, example)


def plan_compile(config: TrainConfig) -> CompilePlan:
    """The run's compile plan. Devices compare canonically ("cuda" is "cuda:0"), so two
    drafters written as cuda and cuda:0 count as sharing a GPU."""
    drafters = [canonical(d) for d in config.devices.drafters]
    buckets = bucket_shapes(config.data, config.drafter) if config.compile == "cudagraphs" else ()
    return CompilePlan(mode=config.compile, num_drafters=len(drafters), buckets=buckets,
                       drafters_share_a_device=len(set(drafters)) < len(drafters), shapes=config.compiled_shapes)


def recompile_limit(num_drafters: int, shapes_per_drafter: int) -> int:
    """Dynamo's cache entries per code object. Every replica compiles the same
    DraftObjective.forward, each shape of each replica is an entry, and past the limit
    Dynamo silently runs the code eagerly: size it to the run, with room to spare."""
    return max(8, 2 * num_drafters * shapes_per_drafter)


def configure_compiler(mode: str, num_drafters: int, shapes_per_drafter: int = DYNAMIC_SHAPE_VARIANTS,
                       dynamic_shapes: bool = False) -> None:
    """Process-wide compiler settings, set once before any drafter thread starts (never
    patched inside a worker). `dynamic_shapes`: whether any graph compiles with symbolic
    sizes (CompilePlan.dynamic_shapes); it turns off what is unsafe only for those."""
    if mode == "off":
        return
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config

    limit = recompile_limit(num_drafters, shapes_per_drafter)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = limit
    else:  # older releases name it cache_size_limit
        torch._dynamo.config.cache_size_limit = limit
    # Inductor's coalescing analysis "does not yet apply to dynamic shapes" (its own config
    # comment) yet runs on them, and asserts in get_pw_red_splits on this step (torch 2.11, CUDA).
    torch._inductor.config.triton.coalesce_tiling_analysis = False
    if dynamic_shapes and hasattr(torch._inductor.config.triton, "mix_order_reduction"):
        # Its workspace is sized from one shape's hints and reshaped for another: at the
        # Qwen3-8B drafter shape with rows and length dynamic the compiled backward fails
        # "shape '[1728, 128]' is invalid for input of size 1536" (torch 2.11, H200).
        torch._inductor.config.triton.mix_order_reduction = False
    # A relaunch finds the compiled graphs, autotuning results and AOTAutograd's joint
    # graphs of earlier runs in the host's compile cache (compile_cache.py) instead of
    # compiling again: on by default in the torch releases we run, set here so an
    # environment variable (TORCHINDUCTOR_FX_GRAPH_CACHE=0, ...) cannot turn a warm start
    # cold unnoticed. Dynamo still traces every graph in every process.
    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.autotune_local_cache = True
    torch._functorch.config.enable_autograd_cache = True


def example_inputs(objective: DraftObjective, seq_len: int, num_features: int, device: str) -> DrafterInputs:
    """A small, valid micro-batch to warm a step up with: 2 rows, at least 16 tokens, 8 blocks.

    No dimension is 1: torch.compile specializes sizes 0 and 1, so a warm-up with one
    sequence would be recompiled by the first real batch, in every thread at once."""
    return random_inputs(2, max(seq_len, 16), 8, block_size=objective.drafter.block_size,
                         vocab=objective.embed_weight.shape[0], num_features=num_features,
                         features_dtype=objective.embed_weight.dtype, device=device, seed=0)


def build_train_step(plan: CompilePlan | str, objective: DraftObjective, example: DrafterInputs) -> BuiltStep:
    """The forward+backward callable for one replica, built and warmed up under the lock,
    with the report of what building it took.

    A bare mode ("off", "default") stands for a plan of that mode, for callers that build
    a step outside a run (benchmarks); cudagraphs needs a whole plan (its buckets)."""
    if isinstance(plan, str):
        plan = CompilePlan(plan)
    with _BUILD_LOCK:
        return plan.build(objective, example)


def _build_eager_or_compiled(mode: str, objective: DraftObjective, example: DrafterInputs) -> BuiltStep:
    # dynamic=True: micro-batch shapes vary with the data; one graph serves them all.
    forward = objective if mode == "off" else torch.compile(objective, dynamic=True)

    def train_step(inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats:
        if first:  # backward adds to .grad: a step starts from none
            objective.drafter.zero_grad(set_to_none=True)
        loss, correct, counted = forward(inputs)
        loss.backward()
        return StepStats(loss.detach(), correct, counted)

    # Compiles now, not in the first training step.
    [(seconds, graphs)] = warm_up(train_step, [example], steps=1)
    objective.drafter.zero_grad(set_to_none=True)
    report = BuildReport(mode, "dynamic", (BucketTiming(shape_of(example), seconds, 0.0, graphs),))
    return BuiltStep(train_step, report)
