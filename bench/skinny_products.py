"""The verify and draft steps' products, 16 rows by each layer's weights: cuBLAS, the landed split, Triton tiles.

    PYTHONPATH=remote:bench python3 bench/skinny_products.py [--roles qkv,o,gate_up,down] [--rows 16]
        [--bandwidth-tbs 3.35] [--table-out best.txt]

For each role of a Qwen3-8B layer (qkv 6144x4096, o 4096x4096, gate_up 24576x4096,
down 4096x12288, bf16 on cuda:0), x (rows, K) times the weight, timed three ways:
F.linear (cuBLAS), fast_layers.split_linear where fast_layers.SPLIT_K names the role (the
landed path), and model/skinny_products.py's kernel for every tile set of a sweep: first
each (parts, block_n, block_k, swap) at 3 stages and 4 warps, then the best few again over
stages and warps. A timing replays a CUDA graph that runs the product once on each of
enough copies of the weight to hold 1 GB (so none is read from L2, as in a step where
every layer's weight is another), and prints µs per product and the weight's GB/s against
--bandwidth-tbs. Every Triton result is checked against the fp32 product first (a tile
set whose parts sum to anything else fails the run).

--table-out writes the best tile set of each role that beat both cuBLAS and the landed
path, as bench/eval_speed.py's --triton takes it ('role=parts:block_n:block_k:stages:
warps:swap,...', or 'none'). $OUT/skinny_products.json holds every timing.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_threads import write_report  # noqa: E402
from gpu_trainer import QWEN3_8B_TARGET  # noqa: E402

COPIES_BYTES = 1e9  # weight copies per timing: more than any L2
REPLAYS = 20


def role_shapes(architecture: dict) -> dict[str, tuple[int, int]]:
    """role -> (outputs N, width K) of a layer of `architecture`."""
    hidden, inner = architecture["hidden_size"], architecture["intermediate_size"]
    heads, kv_heads, dim = (architecture["num_attention_heads"], architecture["num_key_value_heads"],
                            architecture["head_dim"])
    return {"qkv": ((heads + 2 * kv_heads) * dim, hidden), "o": (hidden, heads * dim),
            "gate_up": (2 * inner, hidden), "down": (hidden, inner)}


def time_us(product, weights: list) -> float:
    """µs per call of product(w), one call per weight copy, replayed from a CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:  # warm: compile and autotune outside the capture
            product(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            product(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (REPLAYS * len(weights))


def tile_label(t) -> str:
    """fast_layers.Tiles -> 'parts:block_n:block_k:stages:warps:swap' (parse_tiles' input)."""
    return f"{t.parts}:{t.block_n}:{t.block_k}:{t.stages}:{t.warps}:{int(t.swap)}"


def parse_tiles(text: str):
    """'parts:block_n:block_k[:stages[:warps[:swap]]]' -> fast_layers.Tiles; ValueError if not."""
    from dflash_train.model.fast_layers import Tiles

    numbers = [int(n) for n in text.split(":")]
    if not 3 <= len(numbers) <= 6:
        raise ValueError(f"{text!r} has {len(numbers)} numbers")
    return Tiles(*numbers[:5], *(bool(n) for n in numbers[5:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--roles", default="qkv,o,gate_up,down")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="the GPU's memory bandwidth, TB/s")
    parser.add_argument("--refine", type=int, default=4, help="tile sets tried again over stages and warps")
    parser.add_argument("--table-out", default=None, help="write the winning tiles here, as --triton takes them")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from triton.runtime.errors import OutOfResources

    from dflash_train.model import fast_layers
    from dflash_train.model.fast_layers import Tiles
    from dflash_train.model.skinny_products import fits, product_parts

    shapes = role_shapes(QWEN3_8B_TARGET)
    if unknown := set(args.roles.split(",")) - set(shapes):
        parser.error(f"--roles: no role {', '.join(sorted(unknown))}")
    device = torch.device("cuda:0")
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    generator = torch.Generator(device=device).manual_seed(0)
    report: dict = {"gpu": torch.cuda.get_device_name(0), "rows": args.rows, "bandwidth_tbs": args.bandwidth_tbs,
                    "roles": {}}
    best_tables = []
    for role in args.roles.split(","):
        outputs, width = shapes[role]
        weight_bytes = outputs * width * 2
        copies = max(2, math.ceil(COPIES_BYTES / weight_bytes))
        weights = [torch.randn(outputs, width, device=device, dtype=torch.bfloat16, generator=generator) * 0.02
                   for _ in range(copies)]
        x = torch.randn(args.rows, width, device=device, dtype=torch.bfloat16, generator=generator)
        exact = x.float() @ weights[0].float().T
        scale = exact.abs().max().item()

        def line(name: str, us: float) -> dict:
            rate = weight_bytes / us / 1e3  # GB/s
            print(f"  {name:<28} {us:8.2f} µs  {rate:7.0f} GB/s  {rate / (args.bandwidth_tbs * 1e3):5.1%} of bound",
                  flush=True)
            return {"us": round(us, 2), "gb_s": round(rate)}

        print(f"{role}: {args.rows} x {width} @ ({outputs} x {width})ᵀ, {weight_bytes / 1e6:.0f} MB, {copies} copies")
        timings = {"cublas": line("cuBLAS (F.linear)", time_us(lambda w: F.linear(x, w), weights))}
        splits = fast_layers.SPLIT_K.get(role)
        if splits and fast_layers.BMM_INTO_FP32:
            timings[f"split {splits}"] = line(f"landed split ({splits} parts)",
                                              time_us(lambda w: fast_layers.split_linear(x, w, None, splits), weights))
        landed = min(t["us"] for t in timings.values())

        def triton_us(t: Tiles) -> float | None:
            run = lambda w: product_parts(x, w, t.parts, t.block_n, t.block_k, t.stages, t.warps, t.swap)  # noqa: E731
            try:
                got = run(weights[0]).sum(0)
            except OutOfResources:
                return None
            error = (got - exact).abs().max().item() / scale
            if error > 1e-2:
                raise SystemExit(f"{role} {tile_label(t)}: the parts sum to the product with relative error "
                                 f"{error:.3g}")
            return time_us(run, weights)

        coarse = [Tiles(parts, block_n, block_k, 3, 4, swap)
                  for parts, block_n, block_k, swap in itertools.product((1, 2, 3, 4, 6), (32, 64, 128),
                                                                         (64, 128, 256), (False, True))
                  if fits(args.rows, outputs, width, parts, block_n, block_k)
                  and outputs // block_n * parts >= processors // 2]
        tried: dict[Tiles, float] = {}
        for tiles in coarse:
            if (us := triton_us(tiles)) is not None:
                tried[tiles] = us
        leaders = sorted(tried, key=tried.get)[:args.refine]
        for lead in leaders:
            for stages, warps in itertools.product((2, 3, 4, 5), (4, 8)):
                tiles = Tiles(lead.parts, lead.block_n, lead.block_k, stages, warps, lead.swap)
                if tiles not in tried and (us := triton_us(tiles)) is not None:
                    tried[tiles] = us
        ranked = sorted(tried, key=tried.get)
        for tiles in ranked[:5]:
            timings[f"triton {tile_label(tiles)}"] = line(f"triton {tile_label(tiles)}", tried[tiles])
        best = ranked[0] if ranked else None
        print(f"  {len(tried)} tile sets ran; best {tile_label(best) if best else '-'}: "
              f"{landed / tried[best] if best else 0:.3f}x the landed path", flush=True)
        report["roles"][role] = {"outputs": outputs, "width": width, "timings": timings,
                                 "tried": {tile_label(t): round(us, 2) for t, us in tried.items()}}
        if best and tried[best] < landed:
            best_tables.append(f"{role}={tile_label(best)}")
        weights.clear()
        torch.cuda.empty_cache()
        report["table"] = table = ",".join(best_tables) or "none"
        write_report(report, "skinny_products.json")  # after each role: a run cut short keeps what it measured
        if args.table_out:
            Path(args.table_out).write_text(table + "\n")
    print(f"\nthe tiles that beat the landed path: {report['table']}")


if __name__ == "__main__":
    main()
