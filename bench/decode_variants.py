"""Variants of the decode's pieces at the Qwen3-8B shape, timed side by side on cuda:0.

    PYTHONPATH=remote:bench python3 bench/decode_variants.py [--parts flex,split,products,alone,prefill]
        [--flex-shapes 64x1,256x1,1x1,1x16]

flex: FlexAttention over per-row caches (fast_layers.PositionMask's mask) at the regenerate
and evaluator shapes, per kernel option set, ms per layer (a CUDA graph of a step's 36
layers' attention: timed one call at a time, the host's launch would be what is measured).
split: the same cases through model/decode_attention.SplitAttention (keys cut into chunks,
one program per row, KV head and chunk) per chunk length, its chunks merged by a second
kernel or folded (merged by their last program), against FlexAttention, each output's
error against an fp32 SDPA reference; and where the time of each at 1x16 and 1x1 goes
by kernel (torch.profiler over one graph replay). products: each product of the 16- and
64-position steps as cuBLAS's F.linear and as fast_layers.split_linear's parts. alone:
the evaluator's target-alone token (model/static_target.py, compiled and graphed) with
and without fast_layers.TOKEN_STEP_OPTIONS. prefill: one prefill chunk of job:
regenerate, its layer functions eager and compiled.
Each part prints its own table; a part that fails prints its error and the next runs.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_trainer import QWEN3_8B_TARGET, make_target  # noqa: E402


def timed(function, repeats: int = 30) -> float:
    """Median ms of `function` by CUDA events, after three warm-up calls."""
    import torch

    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        function()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


FLEX_SHAPES = {"64x1": (64, 1, 300, 1300), "256x1": (256, 1, 300, 1300),  # regenerate's decode step
               "1x1": (1, 1, 600, 601), "1x16": (1, 16, 600, 601)}  # the evaluator's target alone and verify


def flex_part(shapes: list[str]) -> None:
    import random

    import torch

    from dflash_train.model import fast_layers
    from dflash_train.model.decode_graphs import graphed

    torch._dynamo.config.recompile_limit = 64
    generator = random.Random(0)
    options = [None, {"num_stages": 2}, {"SPLIT_KV": 2}, {"num_warps": 4, "num_stages": 3},
               {"BLOCK_N": 128, "num_warps": 8}]
    few = {1: [None, {"num_stages": 2}, {"SPLIT_KV": 16}],
           16: [None, {"BLOCK_N": 128}, {"num_warps": 4}, {"num_stages": 2}]}
    capacity = 1408
    print("\n## flex: ms per layer's attention (a CUDA graph of 36 layers' attention, median of 30 replays, over 4 "
          "caches in turn), keys up to each row's own position")
    for shape in shapes:
        keys, values, positions, kv_bytes = _attention_case(shape, capacity, generator)
        rows, queries = positions.shape
        q = torch.randn(rows, 32, queries, 128, device="cuda", dtype=torch.bfloat16)
        print(f"\n{rows} rows x {queries} queries, {kv_bytes / 1e6:.0f} MB of live keys and values a layer")
        print("| kernel options | ms | GB/s | rel. diff from default |")
        reference = None
        for option in options if rows > 1 else few[queries]:
            try:
                mask = fast_layers.PositionMask(rows, queries, capacity, torch.device("cuda"))
                from torch.nn.attention.flex_attention import flex_attention

                attend = torch.compile(flex_attention, dynamic=False)
                mask.set(positions)
                kwargs = {} if option is None else {"kernel_options": dict(option)}

                def run(i):
                    return attend(q, keys[i % 4], values[i % 4], block_mask=mask.mask, scale=0.088,
                                  enable_gqa=True, **kwargs)

                def layers():  # a step's 36 layers, as the decode's CUDA graph replays them
                    for i in range(36):
                        run(i)

                with torch.inference_mode():
                    out = run(0).float()
                    if reference is None:
                        reference = out
                    error = ((out - reference).norm() / reference.norm()).item()
                    ms = timed(graphed(layers, torch.device("cuda"))) / 36
                print(f"| {option or 'default'} | {ms:.4f} | {kv_bytes / ms / 1e6:.0f} | {error:.1e} |", flush=True)
            except Exception as error:  # noqa: BLE001 - a variant that cannot build is a row, not the end
                print(f"| {option} | failed: {type(error).__name__}: {str(error)[:160]} |", flush=True)
            torch._dynamo.reset()
        keys.clear(), values.clear()  # the caches freed before the next case
        torch.cuda.empty_cache()


def _attention_case(shape: str, capacity: int, generator):
    """A flex case's caches (4 in turn, as a step's layers read different ones), positions
    (rows, queries) and live bytes a layer."""
    import torch

    rows, queries, low, high = FLEX_SHAPES[shape]
    keys = [torch.randn(rows, 8, capacity, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    values = [torch.randn_like(k) for k in keys]
    start = torch.tensor([generator.randrange(low, high) for _ in range(rows)], device="cuda")
    positions = start.unsqueeze(1) + torch.arange(queries, device="cuda")
    live = sum(int(p) + queries for p in start.tolist())
    return keys, values, positions, live * 8 * 128 * 2 * 2


def split_part(shapes: list[str]) -> None:
    import random

    import torch

    from decode_profile import profile

    from dflash_train.model import fast_layers
    from dflash_train.model.decode_attention import SplitAttention
    from dflash_train.model.decode_graphs import graphed

    torch._dynamo.config.recompile_limit = 64
    generator = random.Random(0)
    capacity = 1408
    print("\n## split: ms per layer's attention, SplitAttention per chunk length against FlexAttention (a CUDA "
          "graph of 36 layers, median of 30 replays); error: relative to an fp32 SDPA reference")
    for shape in shapes:
        keys, values, positions, kv_bytes = _attention_case(shape, capacity, generator)
        rows, queries = positions.shape
        q = torch.randn(rows, queries, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # as projected
        seen = torch.arange(capacity, device="cuda") <= positions.unsqueeze(-1)  # (B, Q, C)
        reference = fast_layers.attend(q.float(), keys[0].float(), values[0].float(), seen, 0.088)
        print(f"\n{shape}: {rows} rows x {queries} queries, {kv_bytes / 1e6:.0f} MB of live keys and values a layer")
        print("| attention | chunks | ms | GB/s | error |")
        variants = [("flex", None)] + [("split", split) for split in (None, 64, 128, 256, 512, capacity)] \
            + [("split folded", split) for split in (None, 128, 256)]
        for name, split in variants:
            try:
                if name == "flex":
                    attend = fast_layers.PositionMask(rows, queries, capacity, torch.device("cuda"))
                    chunks = "-"
                else:
                    attend = SplitAttention(rows, queries, capacity, torch.device("cuda"), 32, 8, 128, split,
                                            fold=name == "split folded")
                    chunks = f"{attend.chunks} of {attend.split}"
                attend.set(positions)

                def layers():
                    for i in range(36):
                        attend(q, keys[i % 4], values[i % 4], 0.088)

                with torch.inference_mode():
                    out = attend(q, keys[0], values[0], 0.088).float()
                    error = ((out - reference).norm() / reference.norm()).item()
                    ms = timed(graphed(layers, torch.device("cuda"))) / 36
                label = name if split is None else f"{name} {split}"
                print(f"| {label} | {chunks} | {ms:.4f} | {kv_bytes / ms / 1e6:.0f} | {error:.1e} |", flush=True)
                if split is None and shape in ("1x16", "1x1"):  # where each one's time goes, by kernel
                    profile(graphed(layers, torch.device("cuda")), f"{label} {shape}, 36 layers")
            except Exception as error:  # noqa: BLE001 - a variant that cannot build is a row, not the end
                print(f"| {name} {split} | failed: {type(error).__name__}: {str(error)[:300]} |", flush=True)
            torch._dynamo.reset()
        keys.clear(), values.clear()
        torch.cuda.empty_cache()


# fast_layers.SPLIT_K's roles at the 8B shapes: (K, N)
PRODUCT_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
                  "fc": (20480, 4096), "kv": (4096, 2048)}
PRODUCT_ROWS = (16, 64)  # the verify and draft steps; job: regenerate's at batch 64


def products_part() -> None:
    """Each product a step makes, with a residual add after it, as F.linear (cuBLAS, which
    splits K where it chooses) and as fast_layers.split_linear over 2, 4 and 8 parts: per
    role and row count, 36 distinct weights in one CUDA graph."""
    import torch
    import torch.nn.functional as F

    from dflash_train.model.decode_graphs import graphed
    from dflash_train.model.fast_layers import split_linear

    print("\n## products: us a product with the residual add after it (a CUDA graph of 36, distinct weights, "
          "median of 30 replays), TB/s of its weight, error against fp32")
    print("| role (K x N) | rows | F.linear | split 2 | split 4 | split 8 |\n| --- | --- | --- | --- | --- | --- |")
    for role, (width, outputs) in PRODUCT_SHAPES.items():
        weights = [torch.randn(outputs, width, device="cuda", dtype=torch.bfloat16) / width ** 0.5 for _ in range(36)]
        weight_bytes = 2 * width * outputs
        for rows in PRODUCT_ROWS:
            x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(rows, outputs, device="cuda", dtype=torch.bfloat16)
            reference = x.float() @ weights[0].float().T
            cells = []
            for splits in (0, 2, 4, 8):
                def step(x, w, residual, splits=splits):
                    return residual + (split_linear(x, w, None, splits) if splits else F.linear(x, w))

                compiled = torch.compile(step, dynamic=False)
                try:
                    with torch.inference_mode():
                        out = compiled(x, weights[0], torch.zeros_like(residual)).float()
                        error = ((out - reference).norm() / reference.norm()).item()

                        def layers():
                            for w in weights:
                                compiled(x, w, residual)

                        us = timed(graphed(layers, torch.device("cuda"))) / 36 * 1000
                    cells.append(f"{us:.1f} us, {weight_bytes / us / 1e6:.2f} TB/s, {error:.0e}")
                except Exception as failure:  # noqa: BLE001 - a variant that cannot build is a cell, not the end
                    cells.append(f"failed: {type(failure).__name__}: {str(failure)[:200]}")
                torch._dynamo.reset()
            print(f"| {role} ({width} x {outputs}) | {rows} | {' | '.join(cells)} |", flush=True)
        weights.clear()
        torch.cuda.empty_cache()


def alone_part(target) -> None:
    import torch

    from dflash_train.model import fast_layers
    from dflash_train.model.decode_graphs import graphed
    from dflash_train.model.static_target import StaticTarget
    from dflash_train.model.target import FeatureTap

    print("\n## alone: the evaluator's target-alone token, compiled and graphed (median of 30 replays)")
    print("| Inductor options of the one-token steps | ms | compile+capture s |")
    tuned = dict(fast_layers.TOKEN_STEP_OPTIONS)
    for options in ({}, tuned):
        torch._dynamo.reset()
        fast_layers.TOKEN_STEP_OPTIONS = options
        try:
            static = StaticTarget(FeatureTap(target, (1, 9, 17, 25, 33)), 1024, compile_steps=True, fuse=True)
            token = torch.tensor([[17]], device="cuda:0")
            position = torch.tensor([600], device="cuda:0")
            began = time.perf_counter()
            with torch.inference_mode():
                step = graphed(lambda: static.forward(token, position, features=False, step=True),
                               torch.device("cuda:0"))
                torch.cuda.synchronize()
                built = time.perf_counter() - began
                print(f"| {options or 'none'} | {timed(step):.3f} | {built:.0f} |", flush=True)
        finally:
            fast_layers.TOKEN_STEP_OPTIONS = tuned


def prefill_part(target) -> None:
    import torch

    from dflash_train.model.batched_decode import BatchedDecoder, Request
    from dflash_train.model.fast_layers import output_and_mlp, project_and_store

    print("\n## prefill: one chunk of rows of one width, its layer functions eager and compiled (median of 8)")
    print("| rows x width | eager ms | compiled ms | tokens/s eager | tokens/s compiled |")
    decoder = BatchedDecoder(target, 64, 1152, 512, set(), None)
    compiled = decoder._prefill_project, decoder._prefill_output
    for rows, width in ((16, 512), (8, 1024), (32, 256)):
        requests = [Request(i, tuple(range(100, 100 + width))) for i in range(rows)]
        times = []
        for functions in ((project_and_store, output_and_mlp), compiled):
            decoder._prefill_project, decoder._prefill_output = functions
            with torch.inference_mode():
                times.append(timed(functools.partial(decoder._prefill_rows, list(range(rows)), requests, width),
                                   repeats=8))
        print(f"| {rows} x {width} | {times[0]:.1f} | {times[1]:.1f} | {rows * width / times[0] * 1000:.0f} | "
              f"{rows * width / times[1] * 1000:.0f} |", flush=True)
    del decoder
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="flex,split,products,alone,prefill")
    parser.add_argument("--flex-shapes", default=",".join(FLEX_SHAPES),
                        help="rows x queries of the flex part's cases: " + ", ".join(FLEX_SHAPES))
    args = parser.parse_args()
    if unknown := set(args.flex_shapes.split(",")) - set(FLEX_SHAPES):
        parser.error(f"--flex-shapes: no case {', '.join(sorted(unknown))}")
    import torch

    parts = args.parts.split(",")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for name, run in (("flex", flex_part), ("split", split_part)):
        if name in parts:
            try:
                run(args.flex_shapes.split(","))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    if "products" in parts:
        try:
            products_part()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if {"alone", "prefill"} & set(parts):
        target, _ = make_target(QWEN3_8B_TARGET, "cuda:0", "bfloat16")
        target.requires_grad_(False).eval()
        for name, run in (("prefill", prefill_part), ("alone", alone_part)):
            if name in parts:
                try:
                    run(target)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()


if __name__ == "__main__":
    main()
