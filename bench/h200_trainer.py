"""The whole trainer on one H200: threaded against sequential pipeline (issue 4, part 3).

    PYTHONPATH=remote python3 bench/h200_trainer.py --work /tmp/h200 [--steps 30] [--warmup 5]

A target with the Qwen3-8B architecture and random bf16 weights is made on the GPU with
transformers (no download), saved with save_pretrained and loaded back by the trainer
with from_pretrained; its tokenizer is the tiny path's word-level one (sizes of the
tokenizer do not matter here, the target's 151936-row embedding and LM head do). The
data are random word sequences longer than the 3072-token context. Two drafter threads
share the GPU with the target, `compile: cudagraphs`, flex attention; each pipeline
mode runs the trainer (`python -m dflash_train`, which captures the config's shape
buckets itself) once in a child process and is read back from events.jsonl.

Prints tokens/s, samples/s, drafter MFU (FLOPs from bench/gpu_threads.step_flops at the
8B-drafter shape, per sample) and the seconds each thread waited, over the steps after
--warmup; $OUT/h200_trainer.json holds the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_threads import H200_BF16_DENSE_PEAK, QWEN3_8B, step_flops  # noqa: E402

VOCAB_WORDS = 30000


def build_target(folder: Path) -> None:
    """Qwen3-8B's architecture, random weights made on the GPU in bf16, saved locally."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.config import TinyTargetSpec
    from dflash_train.tiny import _build_tokenizer

    tokenizer = _build_tokenizer(TinyTargetSpec(vocab_words=VOCAB_WORDS))
    config = Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(staging), max_shard_size="4GB")
    tokenizer.save_pretrained(str(staging))
    os.replace(staging, folder)
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, built and saved "
          f"in {time.perf_counter() - started:.0f}s to {folder}", flush=True)


def write_data(path: Path, samples: int, words: int) -> None:
    generator = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(samples):
            text = " ".join(f"w{generator.randrange(VOCAB_WORDS)}" for _ in range(words))
            f.write(json.dumps({"text": text}) + "\n")


def write_config(path: Path, target: Path, data: Path, mode: str, steps: int) -> None:
    path.write_text(f"""\
seed: 0
target: {{path: {target}, dtype: bfloat16}}
data: {{train: {data}, max_length: {QWEN3_8B.seq_len}, token_budget: {QWEN3_8B.seq_len}, \
pad_multiple: {QWEN3_8B.seq_len}}}
drafter: {{num_layers: {QWEN3_8B.layers}, block_size: {QWEN3_8B.block}, num_anchors: {QWEN3_8B.anchors}, \
attention: flex}}
optim: {{epochs: 1, max_steps: {steps}}}
devices: {{target: [cuda:0], drafters: [cuda:0, cuda:0]}}
pipeline: {{mode: {mode}}}
compile: cudagraphs
eval: {{num_prompts: 0}}
checkpoint: {{every: 0, on_stop: false}}
log_every: 5
""")


def summarize(run_dir: Path, warmup: int) -> dict:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    steps = [e for e in events if e["type"] == "step"]
    done = next((e for e in events if e["type"] == "done"), None)
    ready = [e for e in events if e["type"] == "ready"]
    measured = steps[warmup:]
    if len(measured) < 2:
        return {"exit_code": done and done["exit_code"], "steps": len(steps), "error": "too few steps"}
    seconds = measured[-1]["ts"] - steps[warmup - 1]["ts"] if warmup else measured[-1]["ts"] - measured[0]["ts"]
    counted = measured if warmup else measured[1:]
    samples = 2 * len(counted)  # one 3072-token sample per drafter per step (token_budget = max_length)
    waits: dict[str, float] = {}
    for event in counted:
        for thread, value in event["wait_s"].items():
            waits[thread] = waits.get(thread, 0.0) + value
    flops = step_flops(QWEN3_8B)["total"]
    return {
        "exit_code": done and done["exit_code"], "steps": len(steps), "measured_steps": len(counted),
        "seconds": round(seconds, 2),
        "samples_per_s": samples / seconds,
        "tokens_per_s": QWEN3_8B.seq_len * samples / seconds,
        "median_step_tokens_per_s": statistics.median(e["tokens_per_s"] for e in counted),
        "drafter_mfu": samples * flops / seconds / H200_BF16_DENSE_PEAK,
        "wait_s_per_step": {k: round(v / len(counted), 4) for k, v in sorted(waits.items())},
        "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
        "startup_s": round(ready[-1]["ts"] - events[0]["ts"], 1) if ready else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/h200"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the averages")
    parser.add_argument("--modes", default="threaded,sequential")
    parser.add_argument("--timeout-s", type=float, default=300, help="per trainer run")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target = work / "qwen3-8b-random"
    if not target.exists():
        build_target(target)
    data = work / "train.jsonl"
    write_data(data, samples=2 * args.steps, words=QWEN3_8B.seq_len + 64)
    report: dict = {"steps": args.steps, "warmup": args.warmup, "flops_per_sample": step_flops(QWEN3_8B),
                    "runs": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "remote")}
    for mode in args.modes.split(","):
        config, run_dir = work / f"{mode}.yaml", work / f"run-{mode}"
        write_config(config, target, data, mode, args.steps)
        started = time.perf_counter()
        try:
            trainer = [sys.executable, "-m", "dflash_train", "--config", str(config), "--run-dir", str(run_dir)]
            subprocess.run(trainer, env=env, timeout=args.timeout_s, check=False)
            result = summarize(run_dir, args.warmup)
        except subprocess.TimeoutExpired:
            result = {"error": f"timed out after {args.timeout_s}s", **summarize(run_dir, args.warmup)}
        result["wall_s"] = round(time.perf_counter() - started, 1)
        errors = run_dir / "errors.jsonl"
        if errors.exists() and errors.read_text().strip():
            first = json.loads(errors.read_text().splitlines()[0])
            result["first_error"] = f"{first['thread']}: {first['exc_type']}: {first['message'][:400]}"
        report["runs"][mode] = result
        print(f"[{mode}] {json.dumps(result)}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "h200_trainer.json").write_text(json.dumps(report, indent=1))
    runs = report["runs"]
    print(f"\n## full trainer, one H200: Qwen3-8B-architecture target (random bf16), 2 drafter threads, "
          f"compile: cudagraphs, flex attention, context {QWEN3_8B.seq_len}, {QWEN3_8B.anchors} anchors; "
          f"steps {args.warmup + 1}..{args.steps}")
    print(f"drafter MFU: {step_flops(QWEN3_8B)['total'] / 1e12:.1f} TFLOP per sample (bench/gpu_threads.py "
          f"step_flops) x samples/s / {H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s")
    print("| pipeline | exit | tokens/s | samples/s | drafter MFU | wait s per step (per thread) | loss first -> last |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in runs.items():
        if "samples_per_s" not in r:
            print(f"| {mode} | {r.get('exit_code')} | - | - | - | {r.get('first_error') or r.get('error')} | - |")
            continue
        print(f"| {mode} | {r['exit_code']} | {r['tokens_per_s']:.0f} | {r['samples_per_s']:.3f} "
              f"| {100 * r['drafter_mfu']:.1f}% | {r['wait_s_per_step']} | {r['first_loss']:.3f} -> "
              f"{r['last_loss']:.3f} |")
    if all("samples_per_s" in runs.get(m, {}) for m in ("threaded", "sequential")):
        print(f"threaded / sequential samples/s: {runs['threaded']['samples_per_s'] / runs['sequential']['samples_per_s']:.3f}")


if __name__ == "__main__":
    main()
