"""`compile: cudagraphs`: the drafter's train step under CUDA graphs, in every drafter thread.

Several drafter threads of one architecture share a process (often one GPU) and must
all run their forward+backward from CUDA graphs, on torch 2.11 through 2.14. The
obvious route, `torch.compile(mode="reduce-overhead")`, crashes in every thread but the
first on torch <= 2.12; docs/cuda-graphs-in-threads.md says why (the CUDA-graph-tree
registry lives in the TLS of the thread that imported it first, warm-up and capture are
not serialized, and one graphed callable is shared by all threads that reach the same
compiled artifact) and lists the rules this module follows.

Two strategies, one contract (`build_cudagraph_train_step`, the seam policy.py
calls for `compile: cudagraphs`):

* ``whole_step`` (every torch version; the choice for <= 2.12, by measurement, see
  bench/RESULTS-h200.md): Inductor compiles the objective once for every shape bucket
  (default mode: fused kernels, no CUDA-graph trees, `fullgraph=True`; the dimensions
  that differ between buckets dynamic, or with `compile_shapes: static` one compile per
  bucket), then the whole forward+backward -- gradient accumulation included, the
  zeroing left outside for optim.accumulate -- is captured with `torch.cuda.graph` once
  per shape bucket, in the drafter's own thread, under a process-wide lock, into a
  memory pool private to that drafter. A graph holds the sizes it was captured with, so one dynamic compile still
  gives one graph per bucket. None of the tree machinery runs, so none of its
  thread-safety holes apply.
* ``upstream`` (torch >= 2.13, which has pytorch PR #184357, thread-aware trees):
  `torch.compile(mode="reduce-overhead", fullgraph=True)`, warmed up and recorded under
  the lock. Chosen automatically only when every drafter has a GPU of its own: all
  backwards on one GPU run on one autograd device thread, and upstream keys the graphed
  backward by executing thread, so same-GPU drafters would share it. It compiles with
  static shapes whatever `compile_shapes` says: the trees record a graph per shape
  anyway, and dynamic shapes under trees are not measured.

Rules both follow: compiler config is set before drafter threads start
(policy.configure_compiler); compile, warm-up and capture happen in the
drafter's start-up, before its ready signal, one drafter at a time (`CAPTURE_LOCK`);
`cudagraph_mark_step_begin` is never called; every batch is padded up to one of a few
bucket shapes, all captured at start-up, so no capture ever overlaps another thread's
training. Padding is loss-neutral: padded rows and blocks are invalid anchors with zero
loss weight, and padded context lies after every real anchor.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from ..config import DataConfig, DrafterConfig, blocks_per_row, rows_per_micro_batch
from ..data.batches import BatchShape
from ..devices import CAPTURE_LOCK
from ..model.objective import DraftObjective, DrafterInputs
from . import precompiled as precompiled_step
from .precompiled import step_key
from .step_build import (BucketTiming, BuildReport, BuiltStep, CompileShapes, StepStats, compile_for_shapes,
                         inputs_of_shape, mark_dynamic, shape_of, torch_version, varying_dims, warm_up)

Strategy = Literal["auto", "whole_step", "upstream"]

UPSTREAM_THREAD_SAFE_TORCH = (2, 13)  # first release with pytorch PR #184357
# Eager steps per bucket before its capture. whole_step: one does everything a first call
# does lazily (the compile or the loading of its kernels, their autotuning, AOTAutograd's
# backward, this thread's cuBLAS handle and workspace), and a capture repeats the same
# calls; each more is another step of the bucket's head loss, paid at every start.
# upstream: CUDA-graph trees warm a function up on its first call and record on the
# second; the third replays what was recorded.
WHOLE_STEP_WARMUP_STEPS = 1
UPSTREAM_WARMUP_STEPS = 3


class CudaGraphsUnavailable(RuntimeError):
    """`compile: cudagraphs` was asked for where it cannot work (no CUDA, old torch)."""


class UncapturedShape(RuntimeError):
    """A batch arrived that fits no bucket captured at start-up."""


def resolve_strategy(requested: Strategy, *, drafters_share_a_device: bool,
                     version: tuple[int, int] | None = None) -> Literal["whole_step", "upstream"]:
    """The strategy for this torch and this placement of drafters."""
    version = version or torch_version()
    upstream_ok = version >= UPSTREAM_THREAD_SAFE_TORCH
    if requested == "upstream":
        if not upstream_ok:
            raise CudaGraphsUnavailable(
                f"cudagraphs strategy 'upstream' needs torch >= 2.13 (thread-aware CUDA-graph "
                f"trees); this is torch {version[0]}.{version[1]}: use 'whole_step' or 'auto'")
        return "upstream"
    if requested == "whole_step":
        return "whole_step"
    return "upstream" if upstream_ok and not drafters_share_a_device else "whole_step"


def bucket_shapes(data: DataConfig, drafter: DrafterConfig) -> tuple[BatchShape, ...]:
    """The buckets that hold every micro-batch data/batches.py can make from this config.

    The packer pads lengths to multiples of `pad_multiple` (up to `max_length`) and puts
    at most `rows_per_micro_batch` rows of that length in a micro-batch, with at most
    `num_anchors` blocks a row: one bucket per possible length covers all of them exactly.
    """
    problem = data.too_many_cudagraph_buckets()
    if problem:  # a loaded JobConfig never gets here; a DataConfig built in code may
        raise CudaGraphsUnavailable(problem)
    lengths = data.padded_lengths()
    # A row of n tokens has at most n - 2 anchors (a token before and after each).
    return tuple(BatchShape(rows_per_micro_batch(data, drafter, n), n, blocks_per_row(n - 2, drafter.num_anchors))
                 for n in lengths)


class _Bucket:
    """Static input tensors of one bucket; a batch is copied in, padded loss-neutrally."""

    def __init__(self, shape: BatchShape, static: DrafterInputs):
        self.shape = shape
        self.static = static

    @torch.no_grad()
    def load(self, inputs: DrafterInputs) -> None:
        rows, length = inputs.input_ids.shape
        blocks = inputs.anchors.shape[1]
        exact = (rows, length, blocks) == (self.shape.rows, self.shape.length, self.shape.blocks)
        for name in ("input_ids", "features", "anchors", "anchor_valid", "labels", "weights"):
            source, target = getattr(inputs, name), getattr(self.static, name)
            if not exact:
                # Zero: token 0, zero features, anchor 0 marked invalid, label 0 of weight 0.
                target.zero_()
            if name in ("input_ids", "features"):
                target[:rows, :length].copy_(source, non_blocking=True)
            else:
                target[:rows, :blocks].copy_(source, non_blocking=True)


def build_cudagraph_train_step(objective: DraftObjective, example: DrafterInputs,
                               buckets: Sequence[BatchShape] | None = None, *, shapes: CompileShapes = "static",
                               drafters_share_a_device: bool = True, strategy: Strategy = "auto",
                               precompiled: Path | None = None) -> BuiltStep:
    """Compile and capture one replica's forward+backward; call in its thread before ready.

    `example` gives dtypes, feature width and device; `buckets` the shapes to capture
    (default: the example's own); `shapes` whether one compile serves every bucket
    (dynamic) or each is compiled on its own (static; see step_build.compile_for_shapes);
    `precompiled` the compile cache's key folder whose saved graphs whole_step loads
    instead of tracing (precompiled.py; None: traced).
    The returned step pads each batch to the smallest bucket that holds it, replays, and
    leaves the gradients in every parameter's `.grad` (the same tensors every step), like
    the eager step does; its report has each bucket's warm-up and capture time.
    """
    device = next(objective.drafter.parameters()).device
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CudaGraphsUnavailable(f"compile: cudagraphs needs a CUDA device; the drafter is on {device}")
    chosen = resolve_strategy(strategy, drafters_share_a_device=drafters_share_a_device)
    if buckets is None:
        buckets = [shape_of(example)]
    # Largest first: smaller buckets' captures then fit in memory the largest freed.
    ordered = sorted(set(buckets), key=lambda s: (s.tokens, s), reverse=True)
    statics = [_Bucket(shape, inputs_of_shape(objective, shape, example, seed=i)) for i, shape in enumerate(ordered)]
    loaded = 0
    with CAPTURE_LOCK, torch.cuda.device(device):
        if chosen == "upstream":
            replay, timings = _warm_up_upstream(objective, statics)
        else:
            replay, timings, loaded = _capture_whole_step(objective, statics, shapes, precompiled)

    def train_step(inputs: DrafterInputs, first: bool = True, last: bool = True) -> StepStats:
        # Smallest padded size that holds the batch (statics is sorted largest first).
        bucket = next((b for b in reversed(statics) if b.shape.holds(inputs)), None)
        if bucket is None:
            rows, length = inputs.input_ids.shape
            raise UncapturedShape(
                f"a micro-batch of {rows} x {length} tokens with {inputs.anchors.shape[1]} blocks fits no "
                f"captured bucket ({', '.join(map(str, ordered))}); capturing during training would race "
                "with the other drafters, so the buckets must cover the data (see bucket_shapes)")
        bucket.load(inputs)
        return replay(bucket, first, last)

    compiled_shapes = "static" if chosen == "upstream" else shapes
    return BuiltStep(train_step, BuildReport(chosen, compiled_shapes, tuple(timings), graphs_loaded=loaded))


def _trainable(objective: DraftObjective) -> list[torch.nn.Parameter]:
    return [p for p in objective.drafter.parameters() if p.requires_grad]


def _hand_out_gradients(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """Give every parameter a fresh copy of its gradient, as an eager backward would.

    Other replicas read these gradients to average them after the rendezvous, possibly
    while this replica already runs its next step; the graph overwrites its own
    gradient tensors in place, so they must never be the ones handed out.
    """
    for param, fresh in zip(params, torch._foreach_mul(grads, 1.0)):  # all copies in one launch
        param.grad = fresh


def _precompiled_objective(objective: DraftObjective, statics: list[_Bucket], shapes: CompileShapes, folder: Path):
    """The objective from the saved graphs of the key folder (precompiled.py), by the rules
    of compile_for_shapes: each bucket runs the first graph whose guards pass it, and a
    bucket none passes gets a graph compiled now; new graphs are saved for the next run.
    -> (what the step calls, {bucket shape: (seconds, graphs compiled) of getting its
    graph}, graphs loaded)."""
    varying = varying_dims([bucket.shape for bucket in statics]) if shapes == "dynamic" else frozenset()
    key = step_key(objective, statics[0].static, f"cudagraphs whole_step {shapes}")
    step = precompiled_step.shared_step(folder, key)
    had = len(step.functions)
    functions, made = {}, {}
    for bucket in statics:
        started = time.perf_counter()
        function = step.find(objective, bucket.static)
        compiles = function is None
        if compiles:
            # The marks go on a copy: the guards of a saved graph refuse a tensor marked dynamic.
            example = DrafterInputs(*(getattr(bucket.static, field.name).clone()
                                      for field in dataclasses.fields(DrafterInputs)))
            mark_dynamic(example, varying)
            function = step.compile(objective, example, dynamic=False if shapes == "static" else None)
        functions[bucket.shape] = function
        made[bucket.shape] = (time.perf_counter() - started, int(compiles))
    precompiled_step.save_new(step, had)

    def call(inputs: DrafterInputs) -> tuple:
        # Only the buckets' own tensors reach here (warm-up and capture): their graph is known.
        return functions[shape_of(inputs)](objective, inputs)

    return call, made, had


def _capture_whole_step(objective: DraftObjective, statics: list[_Bucket], shapes: CompileShapes,
                        precompiled: Path | None):
    params = _trainable(objective)
    # Gradients live outside any graph pool, allocated once: backward accumulates into
    # them in place, so every bucket's graph writes the same tensors and the code after
    # the step (averaging, clipping, AdamW) can read them. They are zeroed outside the
    # graph, before a step's first micro-batch: the micro-batches of optim.accumulate
    # replay the same graphs and add up.
    grads = [torch.zeros_like(p) for p in params]

    def body_of(compiled: Callable[[DrafterInputs], tuple]):
        def body(inputs: DrafterInputs):
            for param, grad in zip(params, grads):
                param.grad = grad  # Python only; what the graph records is the in-place add
            loss, correct, counted = compiled(inputs)
            loss.backward()
            return loss.detach(), correct, counted
        return body

    def warm_up_on_side_stream(body) -> list[tuple[float, int]]:
        # Warm up on a side stream (the allocator and autograd must see a non-default
        # stream before capture): compiles (once, or per bucket with static shapes),
        # autotunes, creates cuBLAS handles.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warmed = warm_up(body, [bucket.static for bucket in statics], WHOLE_STEP_WARMUP_STEPS, side.synchronize)
        torch.cuda.current_stream().wait_stream(side)
        return warmed

    body, loaded = None, 0
    if precompiled is not None:  # policy passes none once this process gave precompiled graphs up
        try:
            compiled, made, loaded = _precompiled_objective(objective, statics, shapes, precompiled)
            body = body_of(compiled)
            # The graphs were made before the warm-up, not by it.
            warmed = [(seconds + made[bucket.shape][0], made[bucket.shape][1])
                      for bucket, (seconds, _) in zip(statics, warm_up_on_side_stream(body))]
        except Exception as exc:  # noqa: BLE001 - torch's AOT path failed: trace, as without it
            precompiled_step.give_up(exc)
            body, loaded = None, 0
    if body is None:
        body = body_of(compile_for_shapes(objective, [bucket.static for bucket in statics], shapes, fullgraph=True))
        warmed = warm_up_on_side_stream(body)

    pool = torch.cuda.graph_pool_handle()  # this drafter's own; its buckets take turns in it
    # A capture stream on this drafter's device. torch.cuda.graph's default one is made
    # once per process, on the device of the first capture: a drafter on another GPU
    # would capture on it and fail at its first allocation (seen on 2 H200s).
    capture_stream = torch.cuda.Stream()
    graphs = {}
    timings = []
    for bucket, (warmup_s, compiled_graphs) in zip(statics, warmed):
        started = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        # "thread_local": another thread's harmless CUDA call (pinning host memory) must
        # not void this capture; captures themselves are serialized by CAPTURE_LOCK.
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream, capture_error_mode="thread_local"):
            outputs = body(bucket.static)
        graphs[bucket.shape] = (graph, outputs)
        timings.append(BucketTiming(bucket.shape, warmup_s, time.perf_counter() - started, compiled_graphs))
    torch.cuda.current_stream().synchronize()

    def replay(bucket: _Bucket, first: bool, last: bool) -> StepStats:
        graph, (loss, correct, counted) = graphs[bucket.shape]
        if first:
            torch._foreach_zero_(grads)
        graph.replay()
        if last:  # earlier micro-batches' sums stay in the graph's own gradients
            _hand_out_gradients(params, grads)
        # The next replay (any bucket: they share the pool) overwrites the outputs; copy now.
        return StepStats(loss.clone(), correct.clone(), counted.clone())

    return replay, timings, loaded


def _warm_up_upstream(objective: DraftObjective, statics: list[_Bucket]):
    compiled = compile_for_shapes(objective, [bucket.static for bucket in statics], "static",
                                  mode="reduce-overhead", fullgraph=True)

    params = _trainable(objective)

    def step(inputs: DrafterInputs, first: bool = True) -> StepStats:
        if first:
            objective.drafter.zero_grad(set_to_none=True)
        loss, correct, counted = compiled(inputs)
        loss.backward()
        # Tree outputs (the gradients backward stole among them) are overwritten by the
        # next replay: copy before handing out (a later micro-batch's backward then adds
        # its gradients to these copies).
        _hand_out_gradients(params, [p.grad for p in params])
        return StepStats(loss.detach().clone(), correct.clone(), counted.clone())

    # CUDA-graph trees warm up on a function's first call and record on the next: all of
    # it here, under the capture lock, for every bucket (the recording is in the warm-up
    # time; there is no capture step of its own).
    warmed = warm_up(step, [bucket.static for bucket in statics], UPSTREAM_WARMUP_STEPS, torch.cuda.synchronize)
    objective.drafter.zero_grad(set_to_none=True)
    torch.cuda.current_stream().synchronize()
    timings = [BucketTiming(bucket.shape, seconds, 0.0, graphs) for bucket, (seconds, graphs) in zip(statics, warmed)]
    return (lambda bucket, first, last: step(bucket.static, first)), timings
