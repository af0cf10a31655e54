"""What every way of building a drafter's train step shares: its result (`StepStats`),
random valid inputs of the shapes it is built for (data/batches.py's `BatchShape`) to warm
it up with, the one Inductor compile of the objective for a set of shapes, the report of
what building cost (`BuildReport`) and the running torch's version.

policy.py picks how a step is built and cudagraphs.py captures one; both import
from here, and nothing here imports either of them.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..config import CompileShapes
from ..data.batches import BatchShape
from ..model.objective import DraftObjective, DrafterInputs, block_labels, position_weights

# The fields of DrafterInputs and the dimensions a bucket's shape sets in each (the rest,
# feature width and block positions, are the model's and never change).
_SHAPED_DIMS = {"input_ids": ("rows", "length"), "features": ("rows", "length"), "anchors": ("rows", "blocks"),
                "anchor_valid": ("rows", "blocks"), "labels": ("rows", "blocks"), "weights": ("rows", "blocks")}


@dataclasses.dataclass
class StepStats:
    loss: torch.Tensor  # () detached
    correct: torch.Tensor  # (bs-1,) hits per block position
    counted: torch.Tensor  # (bs-1,) learnable tokens per block position

    def plus(self, other: StepStats) -> StepStats:
        """Two micro-batches' stats summed (the loss too: the replica averages it)."""
        return StepStats(self.loss + other.loss, self.correct + other.correct, self.counted + other.counted)


class TrainStep(Protocol):
    """Forward and backward of one micro-batch: `first` starts the gradients from none,
    `last` is the micro-batch after which the optimizer steps."""

    def __call__(self, inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats: ...


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of the running torch, or of `version` ("2.11.0+cu130")."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def shape_of(inputs: DrafterInputs) -> BatchShape:
    rows, length = inputs.input_ids.shape
    return BatchShape(rows, length, inputs.anchors.shape[1])


@dataclasses.dataclass(frozen=True)
class BucketTiming:
    """One bucket's start-up: warm-up steps (the compile, when this bucket needed one) and
    its CUDA-graph capture (0 where nothing is captured)."""

    shape: BatchShape
    warmup_s: float
    capture_s: float
    graphs_compiled: int  # Dynamo graphs its warm-up compiled: 0 when an earlier bucket's graph served


# torch's own timers (torch._dynamo.utils.compilation_time_metrics; the same names in
# torch 2.11 through 2.13). All of a compile: a traced frame's, an AOT-compiled function's
# (precompiled.py) and a backward's that AOTAutograd compiles lazily at its first call.
_COMPILE_TIMERS = ("_compile.compile_inner", "fullgraph_capture", "backward._backward_impl")
# Inductor's part of it, forward and backward: compiling a traced graph (its FX graph
# cache looked up first) or loading it through AOTAutograd's cache.
_INDUCTOR_TIMERS = ("compile_fx_inner", "AOTAutogradCache.inductor_load")


@dataclasses.dataclass(frozen=True)
class CompilerWork:
    """What torch's compiler did during one build, by its own timers and counters: where a
    build's seconds went, and whether the caches of a warm start answered."""

    trace_s: float  # Dynamo and AOTAutograd tracing the step: what a warm start still pays
    inductor_s: float  # Inductor compiling the traced graphs, or loading them from its caches
    inductor_hits: int  # Inductor's FX graph cache: graphs loaded compiled
    inductor_misses: int  # graphs Inductor compiled
    autograd_hits: int  # AOTAutograd's cache: forward+backward pairs loaded
    autograd_misses: int

    @staticmethod
    def snapshot() -> dict[str, float]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        def seconds(names: tuple[str, ...]) -> float:
            return sum(sum(compilation_time_metrics.get(name, ())) for name in names)

        return {"compile_s": seconds(_COMPILE_TIMERS), "inductor_s": seconds(_INDUCTOR_TIMERS),
                "inductor_hits": counters["inductor"]["fxgraph_cache_hit"],
                "inductor_misses": counters["inductor"]["fxgraph_cache_miss"],
                "autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
                "autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}

    @classmethod
    def since(cls, before: dict[str, float]) -> CompilerWork:
        """The work between `before` (a snapshot) and now: in this process, so a build
        measured so must be the only one compiling (policy's build lock)."""
        now = cls.snapshot()
        moved = {key: now[key] - before[key] for key in now}
        return cls(trace_s=round(max(0.0, moved["compile_s"] - moved["inductor_s"]), 3),
                   inductor_s=round(moved["inductor_s"], 3),
                   inductor_hits=int(moved["inductor_hits"]), inductor_misses=int(moved["inductor_misses"]),
                   autograd_hits=int(moved["autograd_hits"]), autograd_misses=int(moved["autograd_misses"]))

    def describe(self) -> str:
        return (f"tracing {self.trace_s:.1f} s, Inductor {self.inductor_s:.1f} s (its cache: {self.inductor_hits} "
                f"hit(s), {self.inductor_misses} miss(es); AOTAutograd's: {self.autograd_hits} hit(s), "
                f"{self.autograd_misses} miss(es))")


@dataclasses.dataclass(frozen=True)
class BuildReport:
    """What building one replica's train step cost, for the log now and start-up events later."""

    mode: str  # off | default | whole_step | upstream
    shapes: CompileShapes
    buckets: tuple[BucketTiming, ...]  # the shapes a step was run at to build it
    checked: int = 0  # compile: default: other shapes of the data found to run the compiled graphs
    graphs_loaded: int = 0  # graphs loaded precompiled from the compile cache
    compiler: CompilerWork | None = None  # None: compile off

    @property
    def graphs_compiled(self) -> int:
        return sum(b.graphs_compiled for b in self.buckets)

    @property
    def seconds(self) -> float:
        return self.warmup_s + self.capture_s

    @property
    def warmup_s(self) -> float:
        return sum(b.warmup_s for b in self.buckets)

    @property
    def capture_s(self) -> float:
        return sum(b.capture_s for b in self.buckets)

    def event_detail(self) -> dict[str, object]:
        """The `build train step` event's fields of this build (dflash_contract.events STARTUP)."""
        detail: dict[str, object] = {"graphs_traced": self.graphs_compiled, "graphs_loaded": self.graphs_loaded,
                                     "warmup_s": round(self.warmup_s, 3),
                                     "capture_s": round(self.capture_s, 3)}
        if self.compiler is not None:
            detail.update(trace_s=self.compiler.trace_s, inductor_s=self.compiler.inductor_s,
                          inductor_cache_hits=self.compiler.inductor_hits,
                          inductor_cache_misses=self.compiler.inductor_misses,
                          autograd_cache_hits=self.compiler.autograd_hits,
                          autograd_cache_misses=self.compiler.autograd_misses)
        return detail

    def describe(self) -> str:
        per_bucket = ", ".join(f"{b.shape}: warm-up {b.warmup_s:.1f} s"
                               + (f" + capture {b.capture_s:.1f} s" if b.capture_s else "")
                               + (f" ({b.graphs_compiled} graph(s) compiled)" if b.graphs_compiled else "")
                               for b in self.buckets)
        checked = f"; {self.checked} other shape(s) of the data run them" if self.checked else ""
        loaded = f"{self.graphs_loaded} graph(s) loaded precompiled, " if self.graphs_loaded else ""
        compiler = f"; {self.compiler.describe()}" if self.compiler is not None else ""
        return (f"train step built ({self.mode}, {self.shapes} shapes) in {self.seconds:.1f} s, {loaded}"
                f"{self.graphs_compiled} graph(s) compiled for {len(self.buckets)} shape(s): {per_bucket}{checked}"
                f"{compiler}")


class StrayCompile(RuntimeError):
    """A drafter's step would have compiled after the drafter said ready (Dynamo refused it:
    policy.forbid_compiles): a shape its build did not cover."""


_GUARDS = "triggered by the following guard failure(s):"  # in Dynamo's RecompileError, before the guards


def is_compile_refusal(exc: BaseException) -> bool:
    """Dynamo refused to compile again (error_on_recompile, policy.forbid_compiles)."""
    from torch._dynamo.exc import RecompileError

    return isinstance(exc, RecompileError)


def stray_compile(exc: BaseException, inputs: DrafterInputs) -> StrayCompile:
    """StrayCompile naming the thread, the micro-batch's shape and the failed guards."""
    text = str(exc)
    guards = text.split(_GUARDS, 1)[1] if _GUARDS in text else text
    guard = "; ".join(line.strip().removeprefix("- ") for line in guards.strip(" .\n").splitlines() if line.strip())
    return stray_shape(inputs, guard)


def stray_shape(inputs: DrafterInputs, guard: str) -> StrayCompile:
    """StrayCompile naming the thread, the micro-batch's shape and the guard that refused it."""
    rows, length = inputs.input_ids.shape
    return StrayCompile(f"{threading.current_thread().name}: torch.compile would compile again after ready, for a "
                        f"micro-batch of {rows} x {length} tokens with {inputs.anchors.shape[1]} blocks (guard: "
                        f"{guard}); every shape the data makes must be compiled at start-up")


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A train step and the report of its build; called like the step itself."""

    step: TrainStep
    report: BuildReport

    def __call__(self, inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats:
        try:
            return self.step(inputs, first, last)
        except RuntimeError as exc:
            if is_compile_refusal(exc):
                raise stray_compile(exc, inputs) from exc
            raise


def graphs_compiled() -> int:
    """Graphs Dynamo has traced in this process so far, first compiles and recompiles of
    every frame alike. Dynamo traces each time even when Inductor's caches then hit, so
    this is also what a warm start still pays for."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def random_inputs(rows: int, length: int, blocks: int, *, block_size: int, vocab: int, num_features: int,
                  features_dtype: torch.dtype, device: str | torch.device, seed: int) -> DrafterInputs:
    """A valid micro-batch of random tokens and features: input_ids (rows, length), blocks
    anchors a row, of which the first min(blocks, length - 2) are real (an anchor needs a
    token before and after it) and the rest invalid padding. The features, by far the
    largest (2 x 3072 x 20480 at the Qwen3-8B drafter shape), are drawn where they are
    used, in their own dtype: a CPU draw from one generator is serial, seconds at that size."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    real = min(blocks, length - 2)
    anchors = torch.zeros((rows, blocks), dtype=torch.long)
    anchors[:, :real] = torch.stack([torch.sort(torch.randperm(length - 2, generator=generator)[:real]).values
                                     for _ in range(rows)]) + 1
    anchor_valid = torch.arange(blocks).expand(rows, -1) < real
    labels, weights = block_labels(input_ids, torch.zeros_like(input_ids), anchors, anchor_valid,  # one turn
                                   position_weights(block_size, 7.0))
    features = torch.randn(rows, length, num_features, dtype=features_dtype, device=device,  # (rows, length, F)
                           generator=torch.Generator(device).manual_seed(seed))
    input_ids, anchors, anchor_valid, labels, weights = (t.to(device) for t in (input_ids, anchors, anchor_valid,
                                                                               labels, weights))
    return DrafterInputs(input_ids, features, anchors, anchor_valid, labels, weights)


def inputs_of_shape(objective: DraftObjective, shape: BatchShape, like: DrafterInputs, seed: int) -> DrafterInputs:
    """Valid random inputs of `shape`, with `like`'s feature width, dtypes and device."""
    return random_inputs(shape.rows, shape.length, shape.blocks, block_size=objective.drafter.block_size,
                         vocab=objective.embed_weight.shape[0], num_features=like.features.shape[-1],
                         features_dtype=like.features.dtype, device=like.input_ids.device, seed=seed)


def compile_for_shapes(objective: DraftObjective, bucket_inputs: Sequence[DrafterInputs],
                       shapes: CompileShapes, **options) -> Callable[[DrafterInputs], tuple]:
    """The objective under Inductor (`options` as torch.compile's), built to serve every one
    of `bucket_inputs`' shapes.

    static: every shape is compiled on its own (`dynamic=False`): Inductor's kernels know
    every size, at one Dynamo trace and one Inductor compile per shape. dynamic: the
    dimensions that differ between the buckets (rows, length, blocks) are marked dynamic
    on every bucket's tensors, so the first bucket's compile serves the others. Dynamo
    still specializes a dimension of size 1, and Inductor may guard on a size where its
    code generation picks by size (the CPU backend does on reduction sizes): such a bucket
    gets a graph of its own, which `graphs_compiled` shows. The marks set no min/max: with
    bounds, such a guard is an error (ConstraintViolationError) that would fail the run
    instead of costing one more compile.
    """
    if shapes == "static":
        return torch.compile(objective, dynamic=False, **options)
    varying = varying_dims([shape_of(inputs) for inputs in bucket_inputs])
    for inputs in bucket_inputs:
        mark_dynamic(inputs, varying)
    return torch.compile(objective, dynamic=None, **options)


def varying_dims(shapes: Sequence[BatchShape]) -> frozenset[str]:
    """The dimensions (rows, length, blocks) that differ between `shapes`: those a compile
    serving all of them marks dynamic."""
    return frozenset(name for name in ("rows", "length", "blocks") if len({getattr(s, name) for s in shapes}) > 1)


def mark_dynamic(inputs: DrafterInputs, varying: frozenset[str]) -> None:
    """Mark the `varying` dimensions of every tensor of `inputs` dynamic for Dynamo."""
    import torch._dynamo

    for field, dims in _SHAPED_DIMS.items():
        for index, name in enumerate(dims):
            if name in varying:
                torch._dynamo.maybe_mark_dynamic(getattr(inputs, field), index)


def warm_up(run: Callable[[DrafterInputs], object], bucket_inputs: Sequence[DrafterInputs], steps: int,
            synchronize: Callable[[], None] = lambda: None) -> list[tuple[float, int]]:
    """Run `steps` steps on every bucket's inputs in turn; (seconds, graphs compiled) per bucket."""
    timings = []
    for inputs in bucket_inputs:
        graphs, started = graphs_compiled(), time.perf_counter()
        for _ in range(steps):
            run(inputs)
        synchronize()
        timings.append((time.perf_counter() - started, graphs_compiled() - graphs))
    return timings
