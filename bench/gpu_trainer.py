"""The whole trainer on one or several GPUs: pipelines and device layouts compared.

    PYTHONPATH=remote python3 bench/gpu_trainer.py --work /tmp/gpu RUN [RUN ...]

RUN is MODE/TARGET_GPUS/DRAFTER_GPUS/STEPS, GPUs as indices joined by '+':
  threaded/0/0+0/40     target and two drafter threads sharing GPU 0 (issue 4)
  threaded/0/1+2+3/500  target on GPU 0 feeding one drafter thread on each of GPUs 1-3 (issue 5)
  sequential/0/1/60     the same work, one part after another in one thread

A target with the Qwen3-8B architecture and random bf16 weights is made with
transformers (no download), saved with save_pretrained and loaded back by the trainer
with from_pretrained; the tokenizer is the tiny path's word-level one (only the target's
151936-row embedding and LM head matter for speed). The data are random word sequences
longer than the 3072-token context, one sequence per micro-batch. Every run is the
trainer itself (`python -m dflash_train`, `compile: cudagraphs`, flex attention, which
captures the config's shape buckets at start-up) in a child process, read back from its
events.jsonl, with nvidia-smi sampled every 200 ms alongside.

Per run: samples/s and tokens/s over the steps after --warmup; drafter MFU (drafter
FLOPs from bench/gpu_threads.step_flops, per sample, over 989 TFLOP/s times the GPUs that
hold drafters); target MFU (forward FLOPs of the layers the feature tap runs); each
GPU's utilisation; each thread's wait per step; which side bounds the run; and the
replicas' weight checksums, which the trainer itself checks to be identical.
$OUT/gpu_trainer.json holds everything. `--cpu-check` runs the same script on a micro
target on the CPU (compile off), to check the script without a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_threads import H200_BF16_DENSE_PEAK, QWEN3_8B, Shape, step_flops, write_report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB_WORDS = 30000
QWEN3_8B_TARGET = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128)
# --cpu-check: a target small enough for a laptop, drafter and data to match.
MICRO_TARGET = dict(vocab_size=VOCAB_WORDS + 16, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MICRO_DRAFTER = Shape("micro", 64, 1, 128, 4, 2, 16, VOCAB_WORDS + 16, 4, 16, 128, feature_layers=5)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    mode: str
    targets: tuple[int, ...]
    drafters: tuple[int, ...]
    steps: int

    @classmethod
    def parse(cls, text: str) -> "RunSpec":
        try:
            mode, targets, drafters, steps = text.split("/")
            spec = cls(mode, tuple(map(int, targets.split("+"))), tuple(map(int, drafters.split("+"))), int(steps))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected MODE/TARGET_GPUS/DRAFTER_GPUS/STEPS, "
                                             "e.g. threaded/0/1+2/500") from None
        if spec.mode not in ("threaded", "sequential"):
            raise argparse.ArgumentTypeError(f"{text!r}: mode must be threaded or sequential")
        return spec

    @property
    def name(self) -> str:
        join = lambda ids: "+".join(map(str, ids))  # noqa: E731
        return f"{self.mode}-t{join(self.targets)}-d{join(self.drafters)}"


def make_target(architecture: dict, device: str, dtype: str = "bfloat16"):
    """(model, tokenizer): random weights of `architecture` on `device`, in memory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.config import TinyTargetSpec
    from dflash_train.tiny import _build_tokenizer

    tokenizer = _build_tokenizer(TinyTargetSpec(vocab_words=VOCAB_WORDS))
    config = Qwen3Config(**architecture, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, initializer_range=0.02, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=getattr(torch, dtype))
    return model, tokenizer


def build_target(folder: Path, architecture: dict, device: str) -> None:
    """Random weights of `architecture`, bf16, saved with its tokenizer (atomically)."""
    started = time.perf_counter()
    model, tokenizer = make_target(architecture, device)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(str(staging), max_shard_size="4GB")
    tokenizer.save_pretrained(str(staging))
    os.replace(staging, folder)
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, built and saved "
          f"in {time.perf_counter() - started:.0f}s to {folder}", flush=True)


def target_forward_flops(architecture: dict, layers_run: int, seq_len: int) -> float:
    """Forward FLOPs of one sequence through the first `layers_run` layers (the feature
    tap stops after the last layer it needs): matmuls at 2 per multiply-add, causal
    attention at 4*d per visible (query, key) pair; no LM head."""
    hidden, inter = architecture["hidden_size"], architecture["intermediate_size"]
    width = architecture["num_attention_heads"] * architecture["head_dim"]
    kv_width = architecture["num_key_value_heads"] * architecture["head_dim"]
    per_token = 2 * (2 * hidden * width + 2 * hidden * kv_width + 3 * hidden * inter)
    attention = 4 * width * seq_len * (seq_len + 1) / 2
    return layers_run * (seq_len * per_token + attention)


def write_data(path: Path, samples: int, words: int) -> None:
    generator = random.Random(0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(samples):
            f.write(json.dumps({"text": " ".join(f"w{generator.randrange(VOCAB_WORDS)}" for _ in range(words))}) + "\n")


def write_config(path: Path, target: Path, data: Path, spec: RunSpec, shape: Shape, cpu: bool) -> None:
    device = (lambda i: "cpu") if cpu else (lambda i: f"cuda:{i}")  # noqa: E731
    path.write_text(f"""\
seed: 0
target: {{path: {target}, dtype: bfloat16}}
data: {{train: {data}, max_length: {shape.seq_len}, token_budget: {shape.seq_len}, pad_multiple: {shape.seq_len}}}
drafter: {{num_layers: {shape.layers}, block_size: {shape.block}, num_anchors: {shape.anchors}, \
attention: {'sdpa' if cpu else 'flex'}}}
optim: {{epochs: 1, max_steps: {spec.steps}}}
devices: {{target: [{', '.join(device(i) for i in spec.targets)}], drafters: [{', '.join(device(i) for i in spec.drafters)}]}}
pipeline: {{mode: {spec.mode}}}
compile: {'off' if cpu else 'cudagraphs'}
eval: {{num_prompts: 0}}
checkpoint: {{every: 0, on_stop: false}}
log_every: 25
""")


class GpuSampler:
    """nvidia-smi's utilisation and memory of every GPU, every 200 ms, stamped with time.time()."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, float, float]] = []  # (ts, gpu, util %, MiB used)
        self._proc = None
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                index, util, memory = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), int(index), util, memory))

    def between(self, start: float, end: float) -> dict[int, dict[str, float]]:
        per_gpu: dict[int, list[tuple[float, float]]] = {}
        for ts, gpu, util, memory in list(self.samples):
            if start <= ts <= end:
                per_gpu.setdefault(gpu, []).append((util, memory))
        return {gpu: {"util_pct": round(statistics.mean(u for u, _ in rows), 1),
                      "peak_mib": max(m for _, m in rows), "samples": len(rows)}
                for gpu, rows in sorted(per_gpu.items())}

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()


def summarize(run_dir: Path, spec: RunSpec, warmup: int, drafter_flops: float, target_flops: float,
              seq_len: int, sampler: GpuSampler) -> dict:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    steps = [e for e in events if e["type"] == "step"]
    done = next((e for e in events if e["type"] == "done"), None)
    replicas = next((e for e in events if e["type"] == "replicas"), None)
    training = next((e for e in events if e["type"] == "phase" and e["phase"] == "train"), None)
    base = {"exit_code": done and done["exit_code"], "steps": len(steps),
            "startup_s": round(training["ts"] - events[0]["ts"], 1) if training else None,
            "replica_sha256": replicas and replicas["sha256"]}
    if len(steps) < warmup + 2:
        return {**base, "error": "too few steps"}
    counted = steps[warmup:]
    start = steps[warmup - 1]["ts"] if warmup else None
    if start is None:  # with no warm-up, the first step's own duration is unknown: drop it
        start, counted = counted[0]["ts"], counted[1:]
    seconds = counted[-1]["ts"] - start
    samples = len(spec.drafters) * len(counted)  # token_budget = max_length: one sequence per micro-batch
    waits: dict[str, float] = {}
    for event in counted:
        for thread, value in event["wait_s"].items():
            waits[thread] = waits.get(thread, 0.0) + value
    wait_share = {k: v / seconds for k, v in sorted(waits.items())}
    drafter_share = statistics.mean(wait_share.get(f"drafter-{r}", 0.0) for r in range(len(spec.drafters)))
    target_share = statistics.mean(wait_share.get(f"target-{t}", 0.0) for t in range(len(spec.targets)))
    if spec.mode == "sequential":
        bound = "one part at a time"
    else:  # the side that waits least is the one the other waits for
        bound = "target" if drafter_share > target_share else "drafters"
    gpus = sampler.between(start, counted[-1]["ts"])
    return {
        **base, "measured_steps": len(counted), "seconds": round(seconds, 2),
        "samples_per_s": samples / seconds, "tokens_per_s": seq_len * samples / seconds,
        "step_ms": 1000 * seconds / len(counted),
        "drafter_mfu": samples * drafter_flops / seconds / (H200_BF16_DENSE_PEAK * len(set(spec.drafters))),
        "target_mfu": samples * target_flops / seconds / (H200_BF16_DENSE_PEAK * len(set(spec.targets))),
        "wait_share": {k: round(v, 3) for k, v in wait_share.items()},
        "bound_by": bound, "gpus": gpus,
        "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
    }


def run_trainer(spec: RunSpec, work: Path, target: Path, data: Path, shape: Shape, cpu: bool, warmup: int,
                flops: tuple[float, float], sampler: GpuSampler, timeout_s: float) -> dict:
    config, run_dir = work / f"{spec.name}.yaml", work / f"run-{spec.name}"
    write_config(config, target, data, spec, shape, cpu)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "remote")}
    trainer = [sys.executable, "-m", "dflash_train", "--config", str(config), "--run-dir", str(run_dir)]
    started = time.perf_counter()
    try:
        subprocess.run(trainer, env=env, timeout=timeout_s, check=False)
        timed_out = None
    except subprocess.TimeoutExpired:
        timed_out = f"timed out after {timeout_s:.0f}s"
    result = summarize(run_dir, spec, warmup, *flops, shape.seq_len, sampler)
    if timed_out:
        result["error"] = timed_out
    result["wall_s"] = round(time.perf_counter() - started, 1)
    errors = run_dir / "errors.jsonl"
    if errors.exists() and errors.read_text().strip():
        first = json.loads(errors.read_text().splitlines()[0])
        result["first_error"] = f"{first['thread']}: {first['exc_type']}: {first['message'][:400]}"
    return result


def print_tables(report: dict, shape: Shape) -> None:
    flops = report["flops_per_sample"]
    print(f"\n## the trainer: {report['target']} target (random bf16 weights), drafter {shape.describe()}; "
          f"compile: {report['compile']}; steps after the first {report['warmup']} measured")
    print(f"drafter FLOPs {flops['drafter'] / 1e12:.2f} TFLOP/sample (gpu_threads.step_flops), target forward "
          f"{flops['target'] / 1e12:.2f} TFLOP/sample ({flops['target_layers_run']} layers); MFU over "
          f"{H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s per GPU holding that part")
    print("| run | exit | steps | step ms | samples/s | tokens/s | drafter MFU | target MFU | GPU util % "
          "| wait share per thread | bound by | replicas sha256 | loss first -> last |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in report["runs"].items():
        checksums = r.get("replica_sha256")
        replicas = "-" if not checksums else (
            f"{len(checksums)}x {checksums[0][:12]}" if len(set(checksums)) == 1 else "DIFFER " + " ".join(
                c[:8] for c in checksums))
        if "samples_per_s" not in r:
            print(f"| {name} | {r.get('exit_code')} | {r.get('steps')} | - | - | - | - | - | - | "
                  f"{r.get('first_error') or r.get('error')} | - | {replicas} | - |")
            continue
        util = " ".join(f"{g}:{v['util_pct']:.0f}" for g, v in r["gpus"].items()) or "-"
        print(f"| {name} | {r['exit_code']} | {r['steps']} | {r['step_ms']:.1f} | {r['samples_per_s']:.3f} "
              f"| {r['tokens_per_s']:.0f} | {100 * r['drafter_mfu']:.1f}% | {100 * r['target_mfu']:.1f}% | {util} "
              f"| {r['wait_share']} | {r['bound_by']} | {replicas} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    runs = report["runs"]
    for name, r in runs.items():
        twin = name.replace("threaded-", "sequential-", 1)
        if name.startswith("threaded-") and "samples_per_s" in r and "samples_per_s" in runs.get(twin, {}):
            print(f"{name} / {twin} samples/s: {r['samples_per_s'] / runs[twin]['samples_per_s']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=RunSpec.parse, metavar="RUN")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-trainer"))
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the averages")
    parser.add_argument("--timeout-s", type=float, default=420, help="per trainer run")
    parser.add_argument("--cpu-check", action="store_true", help="micro target on the CPU, compile off")
    args = parser.parse_args()
    cpu = args.cpu_check
    architecture, shape = (MICRO_TARGET, MICRO_DRAFTER) if cpu else (QWEN3_8B_TARGET, QWEN3_8B)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target = work / ("micro-random" if cpu else "qwen3-8b-random")
    if not target.exists():
        build_target(target, architecture, "cpu" if cpu else "cuda:0")
    data = work / "train.jsonl"
    write_data(data, samples=max(len(s.drafters) * s.steps for s in args.runs), words=shape.seq_len + 64)

    from dflash_train.model import default_target_layer_ids

    layers_run = max(default_target_layer_ids(architecture["num_hidden_layers"], shape.feature_layers)) + 1
    flops = (step_flops(shape)["total"], target_forward_flops(architecture, layers_run, shape.seq_len))
    report: dict = {"target": "micro" if cpu else "Qwen3-8B-architecture", "warmup": args.warmup, "compile": "off" if cpu else "cudagraphs",
                    "flops_per_sample": {"drafter": flops[0], "drafter_parts": step_flops(shape),
                                         "target": flops[1], "target_layers_run": layers_run}, "runs": {}}
    sampler = GpuSampler()
    try:
        for spec in args.runs:
            result = run_trainer(spec, work, target, data, shape, cpu, args.warmup, flops, sampler, args.timeout_s)
            report["runs"][spec.name] = result
            print(f"[{spec.name}] {json.dumps(result)}", flush=True)
    finally:
        sampler.stop()
    write_report(report, "gpu_trainer.json")
    print_tables(report, shape)


if __name__ == "__main__":
    main()
