"""The evaluator's fixed-shape decode steps as CUDA graphs (`eval.cuda_graphs`).

A step of the fast decode (model/speculative.py) is a function of static tensors only: it
reads its inputs from buffers allocated once and writes its results into others, at one
shape for every step. `graphed(step, device)` records it once and returns a function
that replays it: the step's hundreds of kernel launches become one, which is what a
launch-bound decode at batch 1 needs.

Captured as the train step is in compiling/cudagraphs.py (docs/cuda-graphs-in-threads.md):
warm-up on a side stream first (cuBLAS handles, the allocator's first blocks), then
`torch.cuda.graph` on a capture stream of the step's own device, in "thread_local"
error mode (the evaluator is a thread of a training run: another thread's harmless CUDA
call must not void this capture), under the process-wide CAPTURE_LOCK (one capture at a
time), into the graph's own memory pool. No torch.compile, so none of the CUDA-graph
tree machinery runs. The warm-up and capture run the step three times: a step's state
buffers hold nothing a decode needs until its prefill sets them.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..devices import CAPTURE_LOCK

DECODE_WARMUP_STEPS = 2


def graphed(step: Callable[[], None], device: torch.device, pool=None) -> Callable[[], None]:
    """`step` replayed from a CUDA graph on `device`; on any other device, `step` itself.
    `pool`: a graph memory pool shared with other graphs never replayed at once (default:
    the graph's own)."""
    if device.type != "cuda":
        return step
    with CAPTURE_LOCK, torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(DECODE_WARMUP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
            step()
        torch.cuda.current_stream().synchronize()
    return graph.replay
