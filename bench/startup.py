"""Launch -> first step of the trainer, cold and warm compile cache, 1/2/4 drafter threads,
and a second "host" (another workspace on this machine) seeded with the first one's
compile cache folder; and the train step's build alone at the Qwen3-8B drafter shape.

    PYTHONPATH=remote python3 bench/startup.py --work /tmp/startup [--threads 1,2,4] [--compile cudagraphs]
        [--compile-shapes dynamic,static] [--steps 3] [--host2 folder|artifacts]
    PYTHONPATH=remote python3 bench/startup.py --work /tmp/startup-8b --drafter-shape 8b \
        [--compile-shapes dynamic,static] [--pad-multiple 768] [--token-budget N --block-token-budget N]

Each run is the trainer itself (`python -m dflash_train`, as the agent starts it) on
configs/train/tiny-gpu.yaml with its drafters on cuda:0 (`--device cpu` with
`--compile default` checks the script on a CPU), `optim.max_steps` 3, no evaluation,
no checkpoint. "cold": a fresh workspace (its cache/compile/<key>/ empty); "warm": the
same workspace again; "host2": a fresh workspace whose cache/compile/ is a copy of the
first one's (--host2 folder: the whole key folder, Inductor's and Triton's caches; --host2
artifacts: only key.json and the portable artifacts, artifacts.bin + artifacts.json, what
`dflash cache copy` and a multi-host launch send, which the trainer loads into its cold
cache). Printed per run: seconds from the process start to the first step event,
the steady ms per step (median interval between step events after the first 10, with
--steps > 12), the compile-cache line and each drafter's `train step built` line (graphs
compiled, warm-up and capture seconds per bucket). `--compile-shapes` runs the whole set
once per setting of the config's `compile_shapes` (cudagraphs only).

`--drafter-shape 8b` measures the train step alone, without a target (random features,
as bench/gpu_threads.py's step benchmarks): a child process per run builds the Qwen3-8B
drafter (bench/gpu_threads.QWEN3_8B, flex attention) and its cudagraphs train step for
the buckets of `max_length = token_budget = 3072` padded to `--pad-multiple` (768: four
buckets, 4x768 ... 1x3072; `--token-budget 12288 --block-token-budget 16384` gives
qwen3-8b.yaml's layout instead, 2x768 ... 2x3072), then replays every bucket; printed:
process start -> step built, the build report, torch's own compile timers (`timers`:
seconds per timer name, nested, the largest 30) and the median ms of a replayed step per
bucket. "cold": a fresh TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR, "warm": the same again.
`--drafter-shape micro --device cpu` checks that path on a CPU (compile only: no graphs there). `--layer-region`
compiles the drafter's decoder layer as one nested compile region
(`torch.compiler.nested_compile_region`: traced and compiled once, stamped out for every
layer) instead of inlining the five, the experiment of bench/RESULTS-h200.md's
"The drafter's layer as one nested compile region". `--regional layers` compiles each
decoder layer on its own (`nn.Module.compile`; the layers share their code, so Dynamo's
cache serves all five with one graph) and the flex block mask's build, and runs the rest
of the step eager inside the captured graph; `--regional all` also compiles the drafter's
code before and after its layers: the experiment of "Regional compilation of the
drafter's step". The peak of allocated GPU memory is printed too (`peak_gib`).
$WORK/startup.json holds the numbers; each step child's stderr is kept in
$WORK/step-<shapes>-<cold|warm>.stderr (where TORCH_LOGS=recompiles writes).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def write_config(path: Path, drafters: int, device: str, compile_mode: str, compile_shapes: str,
                 steps: int) -> None:
    config = yaml.safe_load((REPO / "configs" / "train" / "tiny-gpu.yaml").read_text())
    config["devices"] = {"target": [device], "drafters": [device] * drafters}
    config["compile"] = compile_mode
    if compile_mode == "cudagraphs":
        config["compile_shapes"] = compile_shapes
    # 4 shape buckets of 32 over max_length 128: the layout start-up was first measured with
    # (cudagraphs captures at most 4)
    config["data"]["pad_multiple"] = 32
    config["optim"]["max_steps"] = steps
    config["eval"] = {"num_prompts": 0}
    config["checkpoint"] = {"every": 0}
    path.write_text(yaml.safe_dump(config))


def first_step_s(workspace: Path, run_dir: Path, config: Path, timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "remote"),
           "DFLASH_WORKSPACE": str(workspace)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the trainer's own per-key folder is what is measured
    run_dir.mkdir(parents=True)
    started = time.time()
    with open(run_dir / "train.log", "wb") as log:
        code = subprocess.run([sys.executable, "-m", "dflash_train", "--config", str(config), "--run-dir",
                               str(run_dir)], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e["ts"] for e in events if e["type"] == "step"]
    log = [line.split("] ", 1)[-1] for line in (run_dir / "train.log").read_text().splitlines()]
    cache_line = next((line for line in log if "compile cache:" in line), "")
    intervals = [b - a for a, b in zip(steps[10:], steps[11:])]
    return {"exit_code": code, "first_step_s": round(steps[0] - started, 1) if steps else None,
            "steady_ms": round(1000 * statistics.median(intervals), 2) if len(intervals) >= 2 else None,
            "cache": cache_line, "builds": [line for line in log if "train step built" in line],
            "phases": {e["label"]: e["duration_s"] for e in events if e["type"] == "startup" and e["state"] == "done"}}


def seed_host2(host1: Path, host2: Path, what: str) -> None:
    """What deploying the first host's compile cache to a second one gives it."""
    if what == "folder":
        shutil.copytree(host1 / "cache" / "compile", host2 / "cache" / "compile")
        return
    for key_folder in (host1 / "cache" / "compile").iterdir():
        into = host2 / "cache" / "compile" / key_folder.name
        into.mkdir(parents=True)
        for name in ("key.json", "artifacts.bin", "artifacts.json"):
            if (key_folder / name).exists():
                shutil.copy2(key_folder / name, into / name)


def trainer_runs(args: argparse.Namespace) -> list[dict]:
    results = []
    for shapes in args.compile_shapes.split(","):
        for drafters in [int(n) for n in args.threads.split(",")]:
            name = f"d{drafters}-{shapes}"
            config = args.work / f"{name}.yaml"
            args.work.mkdir(parents=True, exist_ok=True)
            write_config(config, drafters, args.device, args.compile, shapes, args.steps)
            host1, host2 = args.work / f"workspace-{name}-host1", args.work / f"workspace-{name}-host2"
            for label, workspace in (("cold", host1), ("warm", host1), ("host2", host2)):
                if label == "host2":
                    seed_host2(host1, host2, args.host2)
                row = {"drafters": drafters, "compile_shapes": shapes, "cache": label,
                       **first_step_s(workspace, args.work / f"{name}-{label}", config, args.timeout_s)}
                results.append(row)
                print(f"drafters {drafters}  {shapes:7}  {label:5}  launch->first step {row['first_step_s']} s  "
                      f"steady {row['steady_ms']} ms/step  exit {row['exit_code']}  {row['cache']}", flush=True)
                for line in row["builds"]:
                    print(f"    {line}", flush=True)
                print("    phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in row["phases"].items()), flush=True)
    return results


def step_builds(args: argparse.Namespace) -> list[dict]:
    """The train step alone at a drafter shape, cold and warm, one child process each."""
    results = []
    for shapes in args.compile_shapes.split(","):
        cache = args.work / f"cache-{args.drafter_shape}-{shapes}"
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'remote'}{os.pathsep}{REPO / 'bench'}",
               "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
        if args.compile_threads:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
        for label in ("cold", "warm"):
            started = time.time()
            child = subprocess.run(
                [sys.executable, __file__, "--step-child", "--work", str(args.work), "--drafter-shape",
                 args.drafter_shape, "--device", args.device, "--compile-shapes", shapes, "--pad-multiple",
                 str(args.pad_multiple), *(["--token-budget", str(args.token_budget)] if args.token_budget else []),
                 *(["--block-token-budget", str(args.block_token_budget)] if args.block_token_budget else []),
                 *(["--layer-region"] if args.layer_region else []),
                 *(["--regional", args.regional] if args.regional else [])],
                env=env, capture_output=True, text=True, timeout=args.timeout_s)
            (args.work / f"step-{shapes}-{label}.stderr").write_text(child.stderr)  # TORCH_LOGS land here
            lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
            row = {"shape": args.drafter_shape, "compile_shapes": shapes, "layer_region": args.layer_region,
                   "regional": args.regional, "cache": label, "exit_code": child.returncode}
            if lines:
                report = json.loads(lines[-1])
                row.update(report, start_to_built_s=round(report.pop("built_at") - started, 1))
            else:
                row["error"] = child.stderr[-2000:]
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def torch_timers(top: int = 30) -> dict[str, float]:
    """torch's own compile timers (torch._dynamo.utils.compilation_time_metrics), seconds
    summed per name, the largest first. Timers nest (a compile's contains its Inductor's),
    so they do not add up."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: round(sum(times), 2) for name, times in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda item: -item[1])[:top])


def nest_decoder_layers() -> None:
    """Make every DFlashDecoderLayer call one nested compile region (--layer-region)."""
    import torch
    from dflash_train.model.modeling_dflash import DFlashDecoderLayer

    region = torch.compiler.nested_compile_region(DFlashDecoderLayer.forward)

    def forward(self, hidden, context, rope_q, rope_k, mask):
        # A region's inputs may not alias one another (Dynamo refuses it), and rope_q is a
        # slice of rope_k: the region gets a copy, (B, Q, d) twice, up to 32 MiB at 8B.
        return region(self, hidden, context, tuple(t.clone() for t in rope_q), rope_k, mask)

    DFlashDecoderLayer.forward = forward


def compile_regions(objective, bucket_inputs, shapes, *, glue: bool, **options):
    """--regional: in place of step_build.compile_for_shapes, each decoder layer and the
    flex block mask's build under torch.compile on their own (with `glue`, also the
    drafter's code before and after its layers), the rest of the step eager.
    dynamic=True for dynamic shapes: the regions' inputs are made inside the step, where
    no mark on the step's inputs reaches them."""
    import torch
    from dflash_train.model import objective as objective_module

    dynamic = shapes != "static"
    drafter = objective.drafter
    for layer in drafter.layers:
        layer.compile(dynamic=dynamic, **options)
    # Layer 0's input (the frozen embeddings) does not require grad, the others' do: a
    # graph each (Dynamo guards on requires_grad). Given one that does, layer 0 shares them.
    first = drafter.layers[0]
    compiled_call = first._compiled_call_impl

    def call_requiring_grad(hidden, *args, **kwargs):
        return compiled_call(hidden if hidden.requires_grad else hidden.detach().requires_grad_(), *args, **kwargs)

    first._compiled_call_impl = call_requiring_grad
    objective_module.flex_block_mask = torch.compile(objective_module.flex_block_mask, dynamic=dynamic, **options)
    if glue:
        @torch.compile(dynamic=dynamic, **options)
        def before_layers(block_embeds, features, context_positions, block_positions):
            context = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))  # (B, S, H)
            hidden = block_embeds.to(context.dtype)
            cos, sin = drafter.rotary_emb(hidden, torch.cat([context_positions, block_positions], dim=1))
            q_len = block_positions.shape[1]
            return context, hidden, (cos[:, -q_len:], sin[:, -q_len:]), (cos, sin)

        after_layers = torch.compile(drafter.norm, dynamic=dynamic, **options)

        def draft(block_embeds, features, context_positions, block_positions, mask):
            context, hidden, rope_q, rope_k = before_layers(block_embeds, features, context_positions,
                                                            block_positions)
            for layer in drafter.layers:
                hidden = layer(hidden, context, rope_q, rope_k, mask)
            return after_layers(hidden)

        drafter.draft = draft
    return objective


def step_child(args: argparse.Namespace) -> None:
    """Build the train step at `--drafter-shape`; print one JSON line (see step_builds)."""
    import torch
    from gpu_threads import MICRO, QWEN3_8B, Frozen, make_objective

    from dflash_train.compiling.policy import configure_compiler, example_inputs
    from dflash_train.config import DataConfig, DrafterConfig
    from dflash_train.compiling.cudagraphs import bucket_shapes, build_cudagraph_train_step
    from dflash_train.compiling.step_build import compile_for_shapes, inputs_of_shape, warm_up

    if args.layer_region:
        nest_decoder_layers()
    compile_step = functools.partial(compile_regions, glue=args.regional == "all") if args.regional \
        else compile_for_shapes
    if args.regional:
        import dflash_train.compiling.cudagraphs as cudagraphs_module

        cudagraphs_module.compile_for_shapes = compile_step
    shape = {"8b": QWEN3_8B, "micro": MICRO}[args.drafter_shape]
    data = DataConfig(synthetic=None, train="unused.jsonl", max_length=shape.seq_len,
                      token_budget=args.token_budget or shape.seq_len,
                      block_token_budget=args.block_token_budget, pad_multiple=args.pad_multiple)
    buckets = bucket_shapes(data, DrafterConfig(block_size=shape.block, num_anchors=shape.anchors))
    configure_compiler("cudagraphs", 1, max(2, len(buckets)), dynamic_shapes=args.compile_shapes == "dynamic")
    cuda = args.device.startswith("cuda")
    objective = make_objective(shape, Frozen(shape, args.device), args.device, use_flex=cuda)
    like = example_inputs(objective, 16, objective.drafter.fc.in_features, args.device)
    batches = [inputs_of_shape(objective, bucket, like, seed=i) for i, bucket in enumerate(buckets)]
    if cuda:
        step = build_cudagraph_train_step(objective, like, buckets, shapes=args.compile_shapes)
        report = step.report
        built = {"report": report.describe(), "graphs_compiled": report.graphs_compiled,
                 "build_s": round(report.seconds, 1)}
    else:  # no CUDA graphs on a CPU: the compile and warm-up alone
        compiled = compile_step(objective, batches, args.compile_shapes, fullgraph=True)
        def step(batch):
            compiled(batch)[0].backward()

        timings = warm_up(step, batches, steps=1)
        built = {"graphs_compiled": sum(g for _, g in timings), "build_s": round(sum(s for s, _ in timings), 1)}
    built["built_at"] = time.time()
    built["timers"] = torch_timers()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step_ms = {}
    for bucket, batch in zip(buckets, batches):
        times = []
        for _ in range(args.replays + 2):
            sync()
            began = time.perf_counter()
            step(batch)
            sync()
            times.append(1000 * (time.perf_counter() - began))
        step_ms[str(bucket)] = round(statistics.median(times[2:]), 2)
    peak = {"peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)} if cuda else {}
    print(json.dumps({**built, "step_ms": step_ms, **peak}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--compile", default="cudagraphs", choices=["default", "cudagraphs"])
    parser.add_argument("--compile-shapes", default="dynamic", help="dynamic, static or both (comma-separated)")
    parser.add_argument("--steps", type=int, default=3, help="optim.max_steps of each trainer run")
    parser.add_argument("--drafter-shape", choices=["8b", "micro"], help="the train step alone at this shape")
    parser.add_argument("--pad-multiple", type=int, default=768, help="--drafter-shape: bucket lengths")
    parser.add_argument("--token-budget", type=int, help="--drafter-shape: data.token_budget (default: the "
                        "shape's context, one sequence of it a micro-batch)")
    parser.add_argument("--block-token-budget", type=int, help="--drafter-shape: data.block_token_budget "
                        "(qwen3-8b.yaml's layout: --token-budget 12288 --block-token-budget 16384)")
    parser.add_argument("--replays", type=int, default=10, help="--drafter-shape: timed steps per bucket")
    parser.add_argument("--compile-threads", type=int, help="--drafter-shape: TORCHINDUCTOR_COMPILE_THREADS "
                        "(default: torch's, one per core up to 32)")
    parser.add_argument("--layer-region", action="store_true",
                        help="--drafter-shape: the decoder layer as one nested compile region")
    parser.add_argument("--regional", choices=["layers", "all"],
                        help="--drafter-shape: each decoder layer compiled on its own and the rest eager "
                        "(layers), or also the drafter's code before and after the layers (all)")
    parser.add_argument("--step-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=400)
    parser.add_argument("--host2", default="folder", choices=["folder", "artifacts"],
                        help="what the second host gets of the first one's compile cache")
    args = parser.parse_args()
    if args.step_child:
        step_child(args)
        return
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    results = step_builds(args) if args.drafter_shape else trainer_runs(args)
    (args.work / "startup.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
