"""The evaluator's decode speed at the Qwen3-8B shapes: a verify step, the target alone, the speed-up.

    PYTHONPATH=remote python3 bench/eval_speed.py [--max-new-tokens 128] [--prompts 2] [--prompt-tokens 512]
    PYTHONPATH=remote python3 bench/eval_speed.py --cpu-check
    PYTHONPATH=remote python3 bench/eval_speed.py --modes compiled --inductor landed,tuned,autotune --profile

The evaluator's fast decode (dflash_train.model.fast_decode.FastDecoder: static KV cache,
drafter cache, CUDA graphs) on a target with the Qwen3-8B architecture and random bf16
weights, made in memory as bench/gpu_trainer.py makes it (no download, nothing saved),
and a random bf16 drafter at the 8B drafter shape (5 layers, block 16, 5 target feature
layers), on cuda:0. Each prompt is random words of --prompt-tokens tokens; no end token
stops it, so every prompt decodes exactly --max-new-tokens tokens, speculatively and by
the target alone, in each of --modes: compiled (`compile_steps`: the steps through
torch.compile, then graphed), graphs (CUDA graphs of the eager steps), eager (neither),
after a capture and a warm-up of each (build_s: the decoder's build and capture, the
compile included).

Printed per mode: ms per verify step (wall, host included) and its split, draft and
verify (device time between CUDA events around each step) and host (the rest: what the
GPU waits for between steps; the decode launches a step before reading the last, so the
host's read and loop mostly hide behind it); the target alone's ms per token; the
speed-up as the evaluate job reports it (tokens/s over the target alone's tokens/s); and
the distance from the weight-bandwidth limit: a verify step reads the target's weights,
the drafter's and the head once (--bandwidth-tbs, the H200's 4.8 TB/s by default), the
target alone its own weights a token. A random drafter's drafts are almost never
accepted, so a step gains about one token and the measured speed-up is about
(target ms per token) / (verify step ms); a drafter accepting tau tokens a step would
show about tau times that: printed for --tau (the reference DFlash drafters reach about 6).

`--inductor` compiles the steps once per named set of Inductor options (INDUCTOR_SETS;
`landed` is what the job compiles); `--profile` then records one replay of each graphed
step (draft, verify, target alone) under torch.profiler and prints its kernels by kind
(bench/decode_profile.py's table); `--split-k` builds once per fast_layers.SPLIT_K table
(which products of the 16-position steps split their K, into how many parts), and
`--triton` once per fast_layers.TRITON_PRODUCTS table (which of them run through
model/skinny_products.py's kernel, with which tiles: bench/skinny_products.py's
--table-out).

Both modes and the target alone must decode the same tokens: with random bf16 weights
the logits are nearly flat, so a different kernel order can flip a near-tie (a
difference there is rounding, not a bug); graphs and eager run the same kernels, so they
must agree exactly (compiled kernels round otherwise, and are not compared with them). `--cpu-check` runs the same on a micro target on the CPU in fp32 and
fails unless the fast decode, the target alone, the reference path
(speculative_decode, full re-run) and `generate` all decode the same tokens.
$OUT/eval_speed.json holds everything.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_threads import QWEN3_8B, write_report  # noqa: E402
from gpu_trainer import MICRO_TARGET, QWEN3_8B_TARGET, VOCAB_WORDS, make_target  # noqa: E402
from skinny_products import parse_tiles, tile_label  # noqa: E402


class StepClock:
    """A probe for FastDecoder.decode: CUDA events around each step (device time), and the
    wall time from one draft's start to the next."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: list[tuple[str, object, object]] = []
        self.starts: list[float] = []

    def __call__(self, name: str, step) -> None:
        import torch
        if name == "draft":
            self.starts.append(time.perf_counter())
        if not self.cuda:
            started = time.perf_counter()
            step()
            self.events.append((name, started, time.perf_counter()))
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        self.events.append((name, begin, end))

    def split_ms(self, finished: float, steps: int) -> dict:
        """Per verify step of the decode's `steps`: draft, verify (device ms, over the steps
        launched: one more where the decode launched one past its end), host (the rest of
        the wall ms)."""
        import torch
        if self.cuda:
            torch.cuda.synchronize()
        times = {"draft": 0.0, "verify": 0.0}
        for name, begin, end in self.events:
            times[name] += begin.elapsed_time(end) if self.cuda else 1000 * (end - begin)
        launched = len(self.starts)
        wall = 1000 * (finished - self.starts[0]) if launched else 0.0
        draft, verify = times["draft"] / max(launched, 1), times["verify"] / max(launched, 1)
        step = wall / max(steps, 1)
        return {"verify_steps": steps, "ms_per_verify_step": round(step, 3), "draft_ms": round(draft, 3),
                "verify_ms": round(verify, 3), "host_ms": round(step - draft - verify, 3)}


# Inductor options for every compiled step of the decode, by name, over what the job
# compiles (`landed`: fast_layers.compile_step, the one-token steps tuned): `combo` lets
# Inductor launch independent kernels of a graph as one (a step's q, k and v, say).
INDUCTOR_SETS = {"landed": None, "tuned": {"coordinate_descent_tuning": True},
                 "autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
                 "combo": {"combo_kernels": True}}


def compile_step_for(name: str | None, landed):
    """What stands for fast_layers.compile_step under the set `name` (`landed`: the job's own)."""
    import torch

    from dflash_train.model.fast_layers import TOKEN_STEP_OPTIONS

    options = INDUCTOR_SETS[name] if name else None
    if options is None:
        return landed
    return lambda function, one_token=False: torch.compile(
        function, dynamic=False, options={**(TOKEN_STEP_OPTIONS if one_token else {}), **options})


def role_table(text: str, parse, option: str, form: str, parser) -> dict:
    """'role=value,...' -> {role: parse(value)} (parse raises ValueError on a bad value);
    'none' -> {}. `form` is the value's shape, for --`option`'s error."""
    if text == "none":
        return {}
    try:
        return {role: parse(value) for role, value in (item.split("=") for item in text.split(","))}
    except ValueError:
        parser.error(f"--{option}: {text!r} is not 'role={form},...' or 'none'")


def table_label(table: dict, label=str) -> str:
    return ",".join(f"{role}={label(value)}" for role, value in table.items()) or "none"


def profile_steps(decoder, label: str, position: int) -> None:
    """One replay of each graphed step under torch.profiler, from `position` (the state reset
    there, so the replays stay inside the cache)."""
    import torch
    from decode_profile import profile

    for name in ("draft", "verify", "alone"):
        with torch.inference_mode():
            decoder.start.fill_(position)
            decoder.verified_start.fill_(position)
            decoder.position.fill_(position)
            profile(decoder._steps[name], f"{label}: {name}")


def parameter_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def measure(decoder, prompts: list[list[int]], max_new_tokens: int, cuda: bool) -> dict:
    """Speculative and target-alone decodes of every prompt, timed per step."""
    decoder.decode(prompts[0], min(max_new_tokens, 2 * decoder.block_size), set())  # warm-up: graphs captured
    decoder.decode_alone(prompts[0], min(max_new_tokens, 8), set())
    splits, spec_s, spec_tokens, alone_s, alone_tokens, outputs = [], 0.0, 0, 0.0, 0, {"spec": [], "alone": []}
    for prompt in prompts:
        clock = StepClock(cuda)
        decoded = decoder.decode(prompt, max_new_tokens, set(), probe=clock)
        splits.append(clock.split_ms(time.perf_counter(), len(decoded.accepted)))
        spec_s += decoded.seconds
        spec_tokens += len(decoded.tokens) - 1
        alone = decoder.decode_alone(prompt, max_new_tokens, set())
        alone_s += alone.seconds
        alone_tokens += len(alone.tokens) - 1
        outputs["spec"].append(decoded.tokens)
        outputs["alone"].append(alone.tokens)
    steps = sum(s["verify_steps"] for s in splits)
    split = {key: round(sum(s[key] * s["verify_steps"] for s in splits) / max(steps, 1), 3)
             for key in ("ms_per_verify_step", "draft_ms", "verify_ms", "host_ms")}
    spec_tps, alone_tps = spec_tokens / spec_s, alone_tokens / alone_s
    return {"verify_steps": steps, **split, "tokens_per_s": round(spec_tps, 2),
            "accepted_per_step": round(spec_tokens / max(steps, 1), 4),
            "target_ms_per_token": round(1000 / alone_tps, 3), "target_tokens_per_s": round(alone_tps, 2),
            "speedup": round(spec_tps / alone_tps, 3), "tokens": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--modes", default="compiled,graphs,eager",
                        help="compiled (compile_steps and CUDA graphs), graphs (CUDA graphs on), eager (off)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="the GPU's memory bandwidth, TB/s")
    parser.add_argument("--tau", type=float, default=6.0, help="an acceptance length to project the speed-up to")
    parser.add_argument("--inductor", default="landed",
                        help="compiled mode: Inductor option sets to compile the steps with, comma-separated: "
                             + ", ".join(INDUCTOR_SETS))
    parser.add_argument("--attention", default=None,
                        help="compiled mode: the steps' attention, comma-separated: split, flex (fast_layers."
                             "STEP_ATTENTIONS; default: STEP_ATTENTION, the landed one)")
    parser.add_argument("--split-k", default=None,
                        help="compiled mode: fast_layers.SPLIT_K tables to build with, separated by '/', each "
                             "'role=parts,...' or 'none' (cuBLAS's own products; default: the landed table)")
    parser.add_argument("--triton", default=None,
                        help="compiled mode: fast_layers.TRITON_PRODUCTS tables to build with, separated by '/', "
                             "each 'role=parts:block_n:block_k[:stages[:warps[:swap]]],...' or 'none' (default: the "
                             "landed table)")
    parser.add_argument("--profile", action="store_true", help="profile one replay of each graphed step")
    parser.add_argument("--cpu-check", action="store_true", help="micro target on the CPU, fp32")
    parser.add_argument("--drafter-dtype", default=None,
                        help="the drafter's dtype (default: the target's); float32 is what an export loaded as "
                             "stored in fp32 runs in")
    args = parser.parse_args()
    if unknown := set(args.inductor.split(",")) - set(INDUCTOR_SETS):
        parser.error(f"--inductor: no set {', '.join(sorted(unknown))}")
    import torch

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_hf_config
    from dflash_train.model import fast_layers
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.speculative import speculative_decode
    from dflash_train.model.target import FeatureTap

    if args.attention and (unknown := set(args.attention.split(",")) - set(fast_layers.STEP_ATTENTIONS)):
        parser.error(f"--attention: no attention {', '.join(sorted(unknown))}")
    cpu = args.cpu_check
    if cpu:
        torch.set_num_threads(1)  # a micro model: more threads only wait on each other
    device, dtype = ("cpu", "float32") if cpu else ("cuda:0", "bfloat16")
    architecture = MICRO_TARGET if cpu else QWEN3_8B_TARGET
    spec = DrafterConfig(num_layers=1, block_size=4) if cpu else DrafterConfig(
        num_layers=QWEN3_8B.layers, block_size=QWEN3_8B.block, num_target_features=QWEN3_8B.feature_layers)
    max_new_tokens, prompt_tokens = (24, 16) if cpu else (args.max_new_tokens, args.prompt_tokens)
    started = time.perf_counter()
    target, tokenizer = make_target(architecture, device, dtype)
    target.requires_grad_(False)
    target.eval()
    layer_ids = default_target_layer_ids(architecture["num_hidden_layers"], spec.num_target_features or spec.num_layers)
    drafter = DFlashDrafter(drafter_hf_config(target.config, spec, layer_ids, mask_token_id=tokenizer.pad_token_id))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    drafter = drafter.to(device=device, dtype=getattr(torch, args.drafter_dtype or dtype)).eval()
    tap = FeatureTap(target, layer_ids)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    print(f"target ({'micro' if cpu else 'Qwen3-8B architecture'}, {dtype}) and drafter ({spec.num_layers} layers, "
          f"block {spec.block_size}, target layers {list(layer_ids)}) on {device} in "
          f"{time.perf_counter() - started:.0f}s", flush=True)

    generator = random.Random(0)
    words = [f"w{generator.randrange(VOCAB_WORDS)}" for _ in range(prompt_tokens * args.prompts)]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    prompts = [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(args.prompts)]
    capacity = prompt_tokens + max_new_tokens + spec.block_size
    target_bytes, drafter_bytes = parameter_bytes(target), parameter_bytes(drafter)
    bandwidth = args.bandwidth_tbs * 1e12
    limits = {"verify_step_ms": round(1000 * (target_bytes + drafter_bytes + head.numel() * head.element_size())
                                      / bandwidth, 3),
              "target_ms_per_token": round(1000 * target_bytes / bandwidth, 3)}
    report: dict = {"target": "micro" if cpu else "Qwen3-8B-architecture", "device": device, "dtype": dtype,
                    "max_new_tokens": max_new_tokens, "prompts": args.prompts, "prompt_tokens": prompt_tokens,
                    "block_size": spec.block_size, "target_bytes": target_bytes, "drafter_bytes": drafter_bytes,
                    "bandwidth_tbs": args.bandwidth_tbs, "limits": limits, "modes": {}}
    if not cpu:
        report["gpu"] = torch.cuda.get_device_name(0)
    landed_attention = fast_layers.STEP_ATTENTION
    attentions = args.attention.split(",") if args.attention else [landed_attention]
    runs = [(mode if name in (None, "landed") else f"compiled/{name}", mode, name, attention)
            for mode in args.modes.split(",") for name in (args.inductor.split(",") if mode == "compiled" else [None])
            for attention in (attentions if mode == "compiled" else [landed_attention])]
    if len(attentions) > 1:
        runs = [(f"{mode}/{attention}" if kind == "compiled" else mode, kind, name, attention)
                for mode, kind, name, attention in runs]
    landed_split = fast_layers.SPLIT_K
    splits = ([role_table(text, int, "split-k", "parts", parser) for text in args.split_k.split("/")]
              if args.split_k else [landed_split])
    runs = [(f"{mode}/split {table_label(split)}" if kind == "compiled" and len(splits) > 1 else mode, kind, name,
             attention, split)
            for mode, kind, name, attention in runs for split in (splits if kind == "compiled" else [landed_split])]
    landed_triton = fast_layers.TRITON_PRODUCTS
    tritons = ([role_table(text, parse_tiles, "triton", "parts:block_n:block_k[:stages[:warps[:swap]]]", parser)
                for text in args.triton.split("/")] if args.triton else [landed_triton])
    runs = [(f"{mode}/triton {table_label(table, tile_label)}" if kind == "compiled" and len(tritons) > 1 else mode, kind, name,
             attention, split, table)
            for mode, kind, name, attention, split in runs
            for table in (tritons if kind == "compiled" else [landed_triton])]
    landed_compile = fast_layers.compile_step
    for mode, kind, inductor, attention, split, triton in runs:
        torch._dynamo.reset()
        fast_layers.compile_step = compile_step_for(inductor, landed_compile)
        fast_layers.STEP_ATTENTION = attention
        fast_layers.SPLIT_K = split
        fast_layers.TRITON_PRODUCTS = triton
        started = time.perf_counter()
        decoder = FastDecoder(drafter, tap, embed, head, capacity, cuda_graphs=kind != "eager",
                              compile_steps=kind == "compiled", fuse=True)
        decoder.capture()
        captured = time.perf_counter() - started
        result = measure(decoder, prompts, max_new_tokens, cuda=not cpu)
        result["build_s"] = round(captured, 1)
        result["verify_step_vs_limit"] = round(result["ms_per_verify_step"] / limits["verify_step_ms"], 2)
        result["target_vs_limit"] = round(result["target_ms_per_token"] / limits["target_ms_per_token"], 2)
        result["projected_speedup_at_tau"] = round(args.tau * result["target_ms_per_token"]
                                                   / result["ms_per_verify_step"], 2)
        while mode in report["modes"]:  # a variant named twice: both kept
            mode += " (again)"
        report["modes"][mode] = result
        print(f"[{mode}] {json.dumps({k: v for k, v in result.items() if k != 'tokens'})}", flush=True)
        if args.profile and decoder.cuda_graphs:
            profile_steps(decoder, mode, prompt_tokens)
        del decoder
        if not cpu:
            torch.cuda.empty_cache()

    outputs = {mode: result.pop("tokens") for mode, result in report["modes"].items()}
    first = next(iter(outputs.values()))
    uncompiled = {json.dumps(o["spec"]) for m, o in outputs.items() if not m.startswith("compiled")}
    # graphs and eager are compared only when both ran
    report["graphs_same_as_eager"] = len(uncompiled) == 1 if {"graphs", "eager"} <= set(outputs) else None
    report["speculative_same_as_target_alone"] = all(o["spec"] == o["alone"] for o in outputs.values())
    if cpu:
        reference = [speculative_decode(drafter, tap, embed, head, p, max_new_tokens, set(), kv_cache=False).tokens
                     for p in prompts]
        with torch.no_grad():
            greedy = [target.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        report["same_as_reference_and_generate"] = first["spec"] == reference == greedy
    write_report(report, "eval_speed.json")
    print(f"\nweight-bandwidth limits at {args.bandwidth_tbs} TB/s: verify step {limits['verify_step_ms']} ms "
          f"(target {target_bytes / 1e9:.1f} GB + drafter {drafter_bytes / 1e9:.2f} GB + head), target alone "
          f"{limits['target_ms_per_token']} ms/token")
    print("\n| mode | ms / verify step | draft ms | verify ms | host ms | x limit | target ms / token | x limit "
          f"| speed-up (accepted {next(iter(report['modes'].values()))['accepted_per_step']}/step) "
          f"| at tau {args.tau} |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in report["modes"].items():
        print(f"| {mode} | {r['ms_per_verify_step']} | {r['draft_ms']} | {r['verify_ms']} | {r['host_ms']} | "
              f"{r['verify_step_vs_limit']} | {r['target_ms_per_token']} | {r['target_vs_limit']} | {r['speedup']} | "
              f"{r['projected_speedup_at_tau']} |")
    same = report["graphs_same_as_eager"]
    print(f"\ngraphs decode the eager tokens: {'not compared' if same is None else same}; speculative = target alone: "
          f"{report['speculative_same_as_target_alone']}")
    if cpu:
        print(f"fast decode = reference path = generate: {report['same_as_reference_and_generate']}")
        if not (report["same_as_reference_and_generate"] and report["speculative_same_as_target_alone"]
                and same is not False):
            raise SystemExit("--cpu-check: the decodes differ in fp32")


if __name__ == "__main__":
    main()
