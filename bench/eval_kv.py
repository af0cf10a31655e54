"""Evaluation speed with and without the target's KV cache, at the Qwen3-8B shapes.

    PYTHONPATH=remote python3 bench/eval_kv.py [--max-new-tokens 512] [--prompts 2]

The evaluator's own decoding (dflash_train.model.speculative.speculative_decode) on a target
with the Qwen3-8B architecture and random bf16 weights, made in memory as
bench/gpu_trainer.py makes it (no download, nothing saved), and a random drafter at the
8B drafter shape (5 layers, block 16, 5 target feature layers), on cuda:0. Each prompt
is random words of --prompt-tokens tokens; no end token stops it, so every prompt
decodes exactly --max-new-tokens tokens, first with the KV cache (verify forwards of
one block), then without (every verify forward re-runs the whole sequence), after a
short warm-up of each.

Printed per mode: verify steps, ms per verify step, new tokens per second (prefill
included), and the speed-up; whether both modes decoded the same tokens (with random
bf16 weights the logits are nearly flat, so a different kernel order can flip a near-tie:
a difference there is rounding, not a bug; the CPU check asserts equality in fp32). A
random drafter's drafts are almost never accepted, so a verify step gains about one
token: the figures are the cost of a verify step, the quantity the cache changes.
$OUT/eval_kv.json holds everything. `--cpu-check` runs the same on a micro target on the
CPU in fp32, and fails unless both modes decode the same tokens.
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


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def decode_all(drafter, tap, embed, head, prompts: list[list[int]], max_new_tokens: int, kv_cache: bool,
               device: str) -> dict:
    from dflash_train.model.speculative import speculative_decode

    _sync(device)
    started = time.perf_counter()
    outputs = [speculative_decode(drafter, tap, embed, head, prompt, max_new_tokens, set(), kv_cache=kv_cache)
               for prompt in prompts]
    _sync(device)
    seconds = time.perf_counter() - started
    steps = sum(len(o.accepted) for o in outputs)
    tokens = sum(len(o.tokens) for o in outputs)
    return {"seconds": round(seconds, 3), "verify_steps": steps, "new_tokens": tokens,
            "ms_per_verify_step": round(1000 * seconds / max(steps, 1), 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "accepted_per_step": round(sum(sum(o.accepted) for o in outputs) / max(steps, 1), 4),
            "tokens": [o.tokens for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--cpu-check", action="store_true", help="micro target on the CPU, fp32")
    args = parser.parse_args()
    import torch

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_hf_config
    from dflash_train.model.target import FeatureTap

    cpu = args.cpu_check
    device, dtype = ("cpu", "float32") if cpu else ("cuda:0", "bfloat16")
    architecture = MICRO_TARGET if cpu else QWEN3_8B_TARGET
    spec = DrafterConfig(num_layers=1, block_size=4) if cpu else DrafterConfig(
        num_layers=QWEN3_8B.layers, block_size=QWEN3_8B.block, num_target_features=QWEN3_8B.feature_layers)
    started = time.perf_counter()
    target, tokenizer = make_target(architecture, device, dtype)
    target.requires_grad_(False)
    target.eval()
    layer_ids = default_target_layer_ids(architecture["num_hidden_layers"], spec.num_target_features or spec.num_layers)
    hf_config = drafter_hf_config(target.config, spec, layer_ids, mask_token_id=tokenizer.pad_token_id)
    drafter = DFlashDrafter(hf_config)
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    drafter = drafter.to(device=device, dtype=getattr(torch, dtype)).eval()
    tap = FeatureTap(target, layer_ids)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    print(f"target ({'micro' if cpu else 'Qwen3-8B architecture'}, {dtype}) and drafter ({spec.num_layers} layers, "
          f"block {spec.block_size}, target layers {list(layer_ids)}) on {device} in "
          f"{time.perf_counter() - started:.0f}s", flush=True)

    generator = random.Random(0)
    words = [f"w{generator.randrange(VOCAB_WORDS)}" for _ in range(args.prompt_tokens * args.prompts)]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    prompts = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    report: dict = {"target": "micro" if cpu else "Qwen3-8B-architecture", "device": device, "dtype": dtype,
                    "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
                    "prompt_tokens": args.prompt_tokens, "block_size": spec.block_size, "modes": {}}
    if not cpu:
        report["gpu"] = torch.cuda.get_device_name(0)
    for mode, kv_cache in (("cached", True), ("uncached", False)):
        decode_all(drafter, tap, embed, head, prompts[:1], 8, kv_cache, device)  # warm-up
        result = decode_all(drafter, tap, embed, head, prompts, args.max_new_tokens, kv_cache, device)
        report["modes"][mode] = result
        print(f"[{mode}] {json.dumps({k: v for k, v in result.items() if k != 'tokens'})}", flush=True)
    cached, uncached = report["modes"]["cached"], report["modes"]["uncached"]
    report["same_tokens"] = cached["tokens"] == uncached["tokens"]
    report["speedup_tokens_per_s"] = round(cached["tokens_per_s"] / uncached["tokens_per_s"], 2)
    for result in report["modes"].values():
        del result["tokens"]
    write_report(report, "eval_kv.json")
    print("\n| mode | verify steps | ms / verify step | tokens/s |\n| --- | --- | --- | --- |")
    for mode, result in report["modes"].items():
        print(f"| {mode} | {result['verify_steps']} | {result['ms_per_verify_step']} | {result['tokens_per_s']} |")
    print(f"\nKV cache speed-up: {report['speedup_tokens_per_s']}x tokens/s; same tokens in both modes: "
          f"{report['same_tokens']}")
    if cpu and not report["same_tokens"]:
        raise SystemExit("--cpu-check: the cached and uncached decodes differ in fp32")


if __name__ == "__main__":
    main()
