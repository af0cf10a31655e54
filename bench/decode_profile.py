"""Where a graphed decode step's device time goes, at the Qwen3-8B shape: kernels by kind.

    PYTHONPATH=remote:bench python3 bench/decode_profile.py [--slots 64,256] [--attention sdpa,flex,split]

A random-weight Qwen3-8B-architecture target in bf16 (bench/gpu_trainer.py), on cuda:0.
For each slot count and attention of job: regenerate's decoder (model/batched_decode.py),
every row live at a random position of 300-800 with random keys and values: the step's
CUDA graph replayed 20 times (median ms by CUDA events) and one replay under
torch.profiler, its kernels summed by kind (matrix products, attention, Inductor's fused
kernels, the rest) with the largest named. Then the same for the target alone's token of
the evaluator's decode (model/static_target.py: one row, one position).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_trainer import QWEN3_8B_TARGET, make_target  # noqa: E402


def kind(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas")):
        return "matrix products"
    if any(k in lowered for k in ("fmha", "flash", "attention", "flex", "efficient")):
        return "attention"
    if lowered.startswith("triton"):
        return "fused (Inductor)"
    return "other"


def profile(replay, label: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    times = []
    for _ in range(23):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kinds: dict[str, list[float]] = defaultdict(list)
    names: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            kinds[kind(event.name)].append(event.device_time)
            names[event.name].append(event.device_time)
    total = sum(sum(v) for v in kinds.values())
    print(f"\n[{label}] step {statistics.median(times[3:]):.3f} ms (median of 20 replays); kernels "
          f"{sum(len(v) for v in kinds.values())}, {total / 1000:.3f} ms of kernel time")
    for name, values in sorted(kinds.items(), key=lambda item: -sum(item[1])):
        print(f"  {name:18s} {sum(values) / 1000:7.3f} ms  {len(values):5d} kernels")
    for name, values in sorted(names.items(), key=lambda item: -sum(item[1]))[:14]:
        print(f"    {sum(values) / 1000:7.3f} ms {len(values):4d}x {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", default="64,256")
    parser.add_argument("--attention", default="sdpa,flex,split")
    parser.add_argument("--capacity", type=int, default=1088)
    args = parser.parse_args()
    import random

    import torch

    from dflash_train.model.batched_decode import BatchedDecoder, round_up
    from dflash_train.model.static_target import StaticTarget
    from dflash_train.model.target import FeatureTap
    from dflash_train.model.decode_graphs import graphed

    target, _ = make_target(QWEN3_8B_TARGET, "cuda:0", "bfloat16")
    target.requires_grad_(False).eval()
    generator = random.Random(0)
    for slots in (int(s) for s in args.slots.split(",")):
        for attention in args.attention.split(","):
            decoder = BatchedDecoder(target, slots, args.capacity, 512, set(), None, attention=attention)
            with torch.inference_mode():
                for tensor in decoder.keys + decoder.values:
                    tensor.normal_()
                positions = [generator.randrange(300, 800) for _ in range(slots)]
                rows = list(range(slots))
                decoder._set(rows, position=positions, live=[0] * slots, token=[17] * slots,
                             prompt_index=rows, count=[1] * slots)
                length = decoder.capacity if attention != "sdpa" else \
                    min(round_up(max(positions) + 1, decoder.length_step), decoder.capacity)
                step = decoder._step_for(length)
                profile(step, f"regenerate step, {slots} rows, {attention}, attention length {length}")
            del decoder
            torch.cuda.empty_cache()
    tap = FeatureTap(target, (1, 9, 17, 25, 33))
    static = StaticTarget(tap, 1024, compile_steps=True, fuse=True)
    token = torch.tensor([[17]], device="cuda:0")
    position = torch.tensor([600], device="cuda:0")

    def alone() -> None:
        static.forward(token, position, features=False, step=True)

    with torch.inference_mode():
        profile(graphed(alone, torch.device("cuda:0")), "evaluator: the target alone's token")


if __name__ == "__main__":
    main()
