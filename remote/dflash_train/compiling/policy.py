"""How a drafter thread gets its train step: `compile: off | default | cudagraphs`.

The coordinator decides once, from the config and the shapes of the run's micro-batches,
what every drafter builds (`plan_compile`: the mode, the shapes to build for, and for
cudagraphs the shape buckets to capture and whether drafters share a GPU), sets the
process-wide compiler options from that plan (`configure_compiler`), then each drafter
calls `build_train_step` once, during its startup and before it signals
ready. Building (compiling, warming up, capturing graphs) happens under one process-wide
lock, so drafters compile one at a time: torch.compile is not thread-safe overall, and
CUDA graph captures of two threads break each other.

Once every drafter is ready nothing may compile (`forbid_compiles`): a compile in one
drafter thread while the others run compiled code races on Dynamo's caches. So the
build covers every shape the run's data makes (`CompilePlan.data_shapes`, from the batch
plan, or the cudagraphs buckets that hold them all), and a step that would compile
after that fails with StrayCompile naming the shape and the guard that failed.

The train step runs forward and backward only; gradient averaging across replicas and
the optimizer step follow in the drafter thread. With `optim.accumulate` > 1 it runs once
per micro-batch: `first` starts from zero gradients, later calls add to them, and after
the `last` the sum is in every parameter's `.grad`.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import JobConfig
from ..data.batches import BatchShape
from ..devices import canonical
from ..model.objective import DraftObjective, DrafterInputs
from .stable_pickles import stable_cache_keys
from .cudagraphs import bucket_shapes, build_cudagraph_train_step
from . import precompiled as precompiled_step
from .precompiled import step_key
from .step_build import (BucketTiming, BuildReport, BuiltStep, CompilerWork, CompileShapes, StepStats,
                         inputs_of_shape, is_compile_refusal, random_inputs, shape_of, stray_shape, warm_up)

_BUILD_LOCK = threading.Lock()
# compile: default's DraftObjective.forward, compiled once for the process (under the
# build lock) and called with each replica's objective: the first drafter's build
# compiles the graphs of every shape, the others' find them.
_SHARED_FORWARD: dict[str | Callable, object] = {}  # by backend
# Held around every call of a shared forward once built. Dynamo keeps one list of cache
# entries per code object and, on torch 2.11, walks it live while a Python guard can
# hand the GIL to another thread, whose hit moves its entry to the front: the walk then
# skips the entry that would have matched, and the step compiles again (refused once
# ready). 4 drafters on an H200 and on CPU failed so within steps, reported as
# "BACKEND_MATCH failure", which 2.11 says for any miss whose guards pass on re-check.
_FORWARD_LOCK = threading.Lock()
# compile: default compiles with dynamic shapes: one graph per drafter, plus the
# re-specializations Dynamo still makes (a size of 1).
DYNAMIC_SHAPE_VARIANTS = 2


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    """What every drafter of one run builds; decided before any drafter thread starts."""

    mode: str  # off | default | cudagraphs
    num_drafters: int = 1
    buckets: tuple[BatchShape, ...] = ()  # cudagraphs: every shape a batch can have, captured at start-up
    drafters_share_a_device: bool = True  # cudagraphs: picks the capture strategy
    shapes: CompileShapes = "static"  # cudagraphs: one compile per bucket, or one for every bucket
    # default and off: every (rows, length, blocks) this process's drafters will train on,
    # largest first (data.batches.micro_batch_shapes); empty for a step built outside a run
    data_shapes: tuple[BatchShape, ...] = ()
    # compile: default: what compiles the graphs, Inductor in a run; where only Dynamo's
    # guards are in question (the tests of the build), a cheaper backend of torch's, or a
    # test's own callable
    backend: str | Callable = "inductor"
    # compile: default and cudagraphs (whole_step): the compile cache's key folder, where the
    # graphs of the step are saved and loaded (precompiled.py); None: Dynamo traces the
    # step in every process
    precompiled: Path | None = None

    def __post_init__(self) -> None:
        if self.mode == "cudagraphs" and not self.buckets:
            # Capturing only the warm-up example's shape would fail the first real batch.
            raise ValueError("compile: cudagraphs needs the shape buckets of the run (see plan_compile)")

    @property
    def shapes_per_drafter(self) -> int:
        """Graphs Dynamo may compile per drafter, at most: one per bucket for cudagraphs
        (static shapes, or dynamic ones re-specialized per bucket at worst), a dynamic
        graph and its re-specializations otherwise."""
        return max(len(self.buckets), DYNAMIC_SHAPE_VARIANTS, len(specialization_classes(self.data_shapes)))

    @property
    def dynamic_shapes(self) -> bool:
        """Whether Inductor compiles with symbolic sizes: compile: default always,
        cudagraphs with compile_shapes: dynamic."""
        return self.mode == "default" or (self.mode == "cudagraphs" and self.shapes == "dynamic")

    def build(self, objective: DraftObjective, example: DrafterInputs) -> BuiltStep:
        """One replica's train step for this plan, compiled and warmed up (not locked)."""
        precompiled = self.precompiled if self.backend == "inductor" else None
        if precompiled_step.FAILED:
            precompiled = None
        if self.mode == "cudagraphs":
            return build_cudagraph_train_step(objective, example, self.buckets, shapes=self.shapes,
                                              drafters_share_a_device=self.drafters_share_a_device,
                                              precompiled=precompiled)
        if self.mode == "default" and precompiled is not None:
            try:
                return _build_precompiled(objective, self.data_shapes or (shape_of(example),), example, precompiled)
            except Exception as exc:  # noqa: BLE001 - torch's AOT path failed: trace, as without it
                precompiled_step.give_up(exc)
                objective.drafter.zero_grad(set_to_none=True)
        if self.mode == "default":
            return _build_compiled(objective, self.data_shapes or (shape_of(example),), example, self.backend)
        return _build_eager(objective, self.data_shapes[0] if self.data_shapes else shape_of(example), example)


def plan_compile(config: JobConfig, data_shapes: tuple[BatchShape, ...] = ()) -> CompilePlan:
    """The run's compile plan, for the micro-batch shapes its data makes. Devices compare
    canonically ("cuda" is "cuda:0"), so two drafters written as cuda and cuda:0 count as
    sharing a GPU."""
    drafters = [canonical(d) for d in config.devices.drafters]
    buckets = bucket_shapes(config.data, config.drafter) if config.compile == "cudagraphs" else ()
    return CompilePlan(mode=config.compile, num_drafters=len(drafters), buckets=buckets,
                       drafters_share_a_device=len(set(drafters)) < len(drafters), shapes=config.compiled_shapes,
                       data_shapes=() if config.compile == "cudagraphs" else data_shapes)


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

    # Past the limit Dynamo would run the step eagerly without a word: fail instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
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
    # graphs of earlier runs in the host's compile cache (cache.py) instead of
    # compiling again: on by default in the torch releases we run, set here so an
    # environment variable (TORCHINDUCTOR_FX_GRAPH_CACHE=0, ...) cannot turn a warm start
    # cold unnoticed. Dynamo still traces every graph in every process, but compile:
    # default's when they are loaded precompiled (precompiled.py).
    if dynamic_shapes:
        # Duck sizing gives dimensions equal at the first trace one symbol, and a later batch
        # where they differ a recompile: sizes of a micro-batch coincide by chance.
        torch.fx.experimental._config.use_duck_shape = False
    torch._inductor.config.fx_graph_cache = True
    torch._inductor.config.autotune_local_cache = True
    torch._functorch.config.enable_autograd_cache = True
    stable_cache_keys()  # a forked trainer finds what an exec'd one compiled, and the other way round
    # The precompiled train step (precompiled.py) compiles with torch.compile(...).aot_compile,
    # which torch 2.11 and 2.12 give a compiled function only with this set (2.13 sets it).
    torch._dynamo.config.enable_aot_compile = True


def example_inputs(objective: DraftObjective, seq_len: int, num_features: int, device: str) -> DrafterInputs:
    """A small, valid micro-batch: 2 rows, at least 16 tokens, 8 blocks. The shapes a step
    is built for are made like it (feature width, dtypes, device); it is the shape itself
    only for a step built outside a run, which has no data shapes (benchmarks)."""
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
        if plan.mode == "off":
            return plan.build(objective, example)
        before = CompilerWork.snapshot()
        built = plan.build(objective, example)
        return dataclasses.replace(built, report=dataclasses.replace(built.report, compiler=CompilerWork.since(before)))


def forbid_compiles() -> None:
    """From now on, in every thread of the process, a call that would make Dynamo compile a
    compiled function again fails instead (BuiltStep turns that into StrayCompile): once
    the drafters are ready.

    Dynamo's `error_on_recompile`: its RecompileError is told from other errors by type."""
    torch._dynamo.config.error_on_recompile = True


def _steps_from(forward, objective: DraftObjective):
    def train_step(inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats:
        if first:  # backward adds to .grad: a step starts from none
            objective.drafter.zero_grad(set_to_none=True)
        loss, correct, counted = forward(inputs)
        loss.backward()
        return StepStats(loss.detach(), correct, counted)
    return train_step


def _build_eager(objective: DraftObjective, largest: BatchShape, like: DrafterInputs) -> BuiltStep:
    """compile: off: one step at the largest shape, so the allocator holds the run's peak
    from the start (an out-of-memory shows at start-up, not hours in)."""
    train_step = _steps_from(objective, objective)
    [(seconds, graphs)] = warm_up(train_step, [inputs_of_shape(objective, largest, like, seed=0)], steps=1)
    objective.drafter.zero_grad(set_to_none=True)
    return BuiltStep(train_step, BuildReport("off", "dynamic", (BucketTiming(largest, seconds, 0.0, graphs),)))


def specialization_classes(shapes: tuple[BatchShape, ...]) -> tuple[BatchShape, ...]:
    """The largest of `shapes` (given largest first) in each class Dynamo compiles apart
    under dynamic shapes: a dimension of size 1 is specialized (rows of 1, one block)."""
    classes: dict[tuple[bool, ...], BatchShape] = {}
    for shape in shapes:
        classes.setdefault((shape.rows == 1, shape.length == 1, shape.blocks == 1), shape)
    return tuple(classes.values())


def _build_compiled(objective: DraftObjective, data_shapes: tuple[BatchShape, ...], like: DrafterInputs,
                    backend: str | Callable) -> BuiltStep:
    """compile: default, dynamic shapes, built for every shape of the data.

    First a step at the largest shape of each specialization class compiles the graphs
    (forward and backward). Then every other shape the data makes runs a forward with
    Dynamo's error_on_recompile: one that the graphs' guards refuse (a guard that
    the classes did not foresee, such as one Inductor put on a size) gets a step of its
    own, which compiles it now. So the drafter trains on shapes that are all compiled."""
    if backend not in _SHARED_FORWARD:
        _SHARED_FORWARD[backend] = torch.compile(DraftObjective.forward, dynamic=True, backend=backend)
    shared = _SHARED_FORWARD[backend]

    def forward(inputs: DrafterInputs):
        with _FORWARD_LOCK:
            return shared(objective, inputs)

    train_step = _steps_from(forward, objective)
    timings = []
    for shape in specialization_classes(data_shapes):
        [(seconds, graphs)] = warm_up(train_step, [inputs_of_shape(objective, shape, like, seed=0)], steps=1)
        timings.append(BucketTiming(shape, seconds, 0.0, graphs))
    warmed = {timing.shape for timing in timings}
    checked = 0
    for shape in data_shapes:
        if shape in warmed:
            continue
        inputs = inputs_of_shape(objective, shape, like, seed=0)
        try:
            with torch._dynamo.config.patch(error_on_recompile=True):
                forward(inputs)  # the guards pass: this shape runs the compiled graphs
            checked += 1
        except RuntimeError as exc:
            if not is_compile_refusal(exc):
                raise
            [(seconds, graphs)] = warm_up(train_step, [inputs], steps=1)
            timings.append(BucketTiming(shape, seconds, 0.0, graphs))
    objective.drafter.zero_grad(set_to_none=True)
    return BuiltStep(train_step, BuildReport("default", "dynamic", tuple(timings), checked=checked))


def _build_precompiled(objective: DraftObjective, data_shapes: tuple[BatchShape, ...], like: DrafterInputs,
                       folder: Path) -> BuiltStep:
    """compile: default from the saved graphs of the key folder (precompiled.py), by the
    rules of _build_compiled: a step at the largest shape of each specialization class,
    then each other shape of the data checked against the graphs' guards; a shape no graph
    serves gets a graph of its own, traced now. New graphs are saved (a failed save is said;
    the run goes on)."""
    precompiled = precompiled_step.shared_step(folder, step_key(objective, like, "default"))
    had = len(precompiled.functions)

    def forward(inputs: DrafterInputs):
        with _FORWARD_LOCK:
            function = precompiled.find(objective, inputs)
            if function is None:
                raise stray_shape(inputs, precompiled.refusal(objective, inputs))
            return function(objective, inputs)

    train_step = _steps_from(forward, objective)

    def step_at(shape: BatchShape, inputs: DrafterInputs) -> BucketTiming:
        started, graphs = time.perf_counter(), len(precompiled.functions)
        if precompiled.find(objective, inputs) is None:
            precompiled.compile(objective, inputs)
        train_step(inputs)
        return BucketTiming(shape, time.perf_counter() - started, 0.0, len(precompiled.functions) - graphs)

    timings = [step_at(shape, inputs_of_shape(objective, shape, like, seed=0))
               for shape in specialization_classes(data_shapes)]
    warmed = {timing.shape for timing in timings}
    checked = 0
    for shape in data_shapes:
        if shape in warmed:
            continue
        inputs = inputs_of_shape(objective, shape, like, seed=0)
        if precompiled.find(objective, inputs) is not None:
            checked += 1
        else:
            timings.append(step_at(shape, inputs))
    objective.drafter.zero_grad(set_to_none=True)
    precompiled_step.save_new(precompiled, had)
    return BuiltStep(train_step, BuildReport("default", "dynamic", tuple(timings), checked=checked,
                                             graphs_loaded=had))
