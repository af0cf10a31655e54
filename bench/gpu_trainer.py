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

Two measurements of the drafter alone, at the Qwen3-8B drafter shape with random target
features (no target: bench/gpu_threads.py's objective and batches), in this process,
with the trainer's own train step (compile: cudagraphs, whole_step, flex) and
optimizer step (dflash_train.training.optimizer_step), one sequence of 3072 tokens a micro-batch:

    PYTHONPATH=remote python3 bench/gpu_trainer.py --step-parts [--iters 8]
        ms a step split into forward+backward (every micro-batch) and the optimizer (the
        norm, the step's one host read, clip + AdamW + schedule), ms a sample and drafter
        MFU, for optim.accumulate 1 and 4 x the optimizer's forms: eager (compile: off's),
        device (fused capturable AdamW, not captured), graph (the same, captured). The
        split runs synchronize between the parts; "step ms" is timed without that sync.
    PYTHONPATH=remote python3 bench/gpu_trainer.py --checkpoint-held --work DIR
        the training time a checkpoint holds (copy off the GPU of the weights and the
        graphed AdamW's state, 12.6 GB) the first time (pinned buffers made) and the next
        (reused), the background write's seconds, and the step time while it writes
        (an eager train step here: no compile, so the command's minutes go to the writes).

With --cpu-check both run at gpu_threads.MICRO on the CPU (forms eager and device).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
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
# The other shipped configs' targets (configs/train/), each as its config.json has them:
# layers, widths, heads, experts and RoPE, so a random-weight stand-in is that model's
# shape (bench/fit_h200.py). An architecture without model_type is a Qwen3 (make_target).
LLAMA31_8B_TARGET = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
GPT_OSS_20B_TARGET = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True,
    swiglu_limit=7.0, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096, "truncate": False})
QWEN3_30B_A3B_TARGET = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0)
# A config's target.path -> the architecture its random-weight stand-in has.
TARGETS = {"Qwen/Qwen3-8B": QWEN3_8B_TARGET, "meta-llama/Llama-3.1-8B-Instruct": LLAMA31_8B_TARGET,
           "openai/gpt-oss-20b": GPT_OSS_20B_TARGET, "Qwen/Qwen3-30B-A3B": QWEN3_30B_A3B_TARGET}
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


# Qwen3-8B's config.json values the Qwen3 architectures above leave out.
QWEN3_DEFAULTS = dict(model_type="qwen3", max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)


def make_target(architecture: dict, device: str, dtype: str = "bfloat16"):
    """(model, tokenizer): random weights of `architecture` on `device`, in memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_train.config import TinyTargetSpec
    from dflash_train.data.tiny import _build_tokenizer

    tokenizer = _build_tokenizer(TinyTargetSpec(vocab_words=VOCAB_WORDS))
    fields = dict(architecture) if "model_type" in architecture else {**QWEN3_DEFAULTS, **architecture}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, tie_word_embeddings=False,
                                  initializer_range=0.02, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
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


# ------------------------------------------------------------- the drafter alone

@dataclasses.dataclass
class DrafterAlone:
    """One drafter at a shape, its trainer-built train step, random batches."""

    shape: Shape
    device: str
    objective: object
    train_step: object
    batches: list
    build_s: float

    @classmethod
    def make(cls, cpu: bool, graphs: bool = True) -> "DrafterAlone":
        """`graphs`: the train step of compile: cudagraphs (on the GPU), else compile: off's."""
        from gpu_threads import MICRO, Frozen, make_batches, make_objective

        from dflash_train.compiling import cudagraphs
        from dflash_train.compiling.policy import build_train_step, configure_compiler

        shape, device = (MICRO, "cpu") if cpu else (QWEN3_8B, "cuda")
        objective = make_objective(shape, Frozen(shape, device), device, use_flex=not cpu)
        batches = make_batches(shape, 4, 7, device)
        graphs = graphs and not cpu
        configure_compiler("cudagraphs" if graphs else "off", 1, 1)
        started = time.perf_counter()
        if not graphs:
            train_step = build_train_step("off", objective, batches[0])
        else:
            train_step = cudagraphs.build_cudagraph_train_step(objective, batches[0], strategy="whole_step")
        return cls(shape, device, objective, train_step, batches, time.perf_counter() - started)

    @property
    def params(self) -> list:
        return list(self.objective.drafter.parameters())

    def optimizer(self, form: str):
        from dflash_train.config import OptimConfig
        from dflash_train.training.optimizer_step import OptimizerStep

        optimizer = OptimizerStep(self.params, OptimConfig(lr=6e-4, betas=(0.9, 0.95), grad_clip=1.0),
                                  total_steps=10_000, form=form)
        optimizer.prepare()
        return optimizer

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self, optimizer, index: int, accumulate: int, split: bool) -> tuple[float, float]:
        """One optimizer step as replica.Replica runs it with one replica (the exchange
        hands its own gradients back): (ms of the micro-batches, ms of the optimizer part),
        the parts synchronized apart when `split`, else all in the first."""
        import torch

        self.sync()
        began = time.perf_counter()
        summed = None
        for micro in range(accumulate):
            batch = self.batches[(index * accumulate + micro) % len(self.batches)]
            stats = self.train_step(batch, first=micro == 0, last=micro == accumulate - 1)
            summed = stats if summed is None else summed.plus(stats)
        grads = [p.grad for p in self.params]
        if accumulate > 1:
            torch._foreach_div_(grads, accumulate)
        if split:
            self.sync()
        middle = time.perf_counter()
        norm = torch.nn.utils.get_total_norm(grads)
        grad_norm, loss = torch.stack([norm, summed.loss.float()]).tolist()  # the step's one host read
        assert math.isfinite(grad_norm) and math.isfinite(loss), (grad_norm, loss)
        optimizer.apply(grads, norm)
        self.sync()
        ended = time.perf_counter()
        return (middle - began) * 1e3, (ended - middle) * 1e3


def step_parts(cpu: bool, iters: int) -> dict:
    drafter = DrafterAlone.make(cpu)
    flops = step_flops(drafter.shape)["total"]  # a micro-batch of one sequence
    forms = ["eager", "device"] + ([] if cpu else ["graph"])
    optimizers = {form: drafter.optimizer(form) for form in forms}  # all on the same weights
    rows = []
    for accumulate in (1, 4):
        for form in forms:
            for index in range(3):  # warm: allocator, cuBLAS, the fused kernels
                drafter.step(optimizers[form], index, accumulate, split=True)
            split = [drafter.step(optimizers[form], i, accumulate, split=True) for i in range(iters)]
            whole = [sum(drafter.step(optimizers[form], i, accumulate, split=False)) for i in range(iters)]
            step_ms = statistics.median(whole)
            rows.append({"accumulate": accumulate, "optimizer": form,
                         "fwd_bwd_ms": statistics.median(a for a, _ in split),
                         "optimizer_ms": statistics.median(b for _, b in split), "step_ms": step_ms,
                         "ms_per_sample": step_ms / accumulate,
                         "drafter_mfu": accumulate * flops / (step_ms / 1e3) / H200_BF16_DENSE_PEAK})
            print(f"[step-parts] {json.dumps(rows[-1])}", flush=True)
    print(f"\n## one drafter step at {drafter.shape.name} ({drafter.shape.describe()}), random target features, "
          f"compile {'off' if cpu else 'cudagraphs (flex)'}, built in {drafter.build_s:.0f}s; median of {iters} steps; "
          f"{flops / 1e12:.2f} TFLOP a sample, MFU over {H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s")
    print("| accumulate | optimizer | fwd+bwd ms | optimizer ms | step ms | ms/sample | drafter MFU |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['accumulate']} | {r['optimizer']} | {r['fwd_bwd_ms']:.1f} | {r['optimizer_ms']:.2f} "
              f"| {r['step_ms']:.1f} | {r['ms_per_sample']:.1f} | {100 * r['drafter_mfu']:.1f}% |")
    return {"shape": drafter.shape.describe(), "build_s": drafter.build_s, "rows": rows}


def checkpoint_held(cpu: bool, work: Path, checkpoints: int = 2) -> dict:
    """The trainer's CheckpointWriter with take_snapshot, as schedule.OutputSchedule calls
    them: the buffers made in the background after the first step (reserve), then saves."""
    from dflash_train.checkpoint.folders import snapshot_layout, take_snapshot
    from dflash_train.checkpoint.state import TrainingState
    from dflash_train.checkpoint.writer import CheckpointWriter
    from dflash_train.runlog import ErrorLog, EventLog, ThreadNames
    from dflash_train.threads import StopLatch

    drafter = DrafterAlone.make(cpu, graphs=False)  # no compile: the minutes go to the writes
    optimizer = drafter.optimizer("device" if cpu else "graph")
    folder = work / "checkpoint-held"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    events = EventLog(folder / "events.jsonl")
    writer = CheckpointWriter(folder / "checkpoints", 1, "", events,
                              StopLatch(ErrorLog(folder / "errors.jsonl"), ThreadNames(folder / "threads.json")))
    index = 0

    def train(count: int) -> list[float]:
        nonlocal index
        index += count
        return [sum(drafter.step(optimizer, index + i, 1, split=False)) for i in range(count)]

    before = statistics.median(train(8))
    started = time.perf_counter()
    writer.reserve(snapshot_layout(drafter.objective.drafter, optimizer.optimizer, optimizer.scheduler))
    reserving = []
    while writer.writing:
        reserving += train(1)  # training goes on while the buffers are made
    writer.wait()
    reserve = {"reserve_s": time.perf_counter() - started, "steps_during_reserve": len(reserving),
               "step_ms_during_reserve": statistics.median(reserving) if reserving else None}
    print(f"[checkpoint-held] {json.dumps(reserve)}", flush=True)
    rows = []
    for _ in range(checkpoints):
        state = TrainingState(step=index, epoch=0, batch_index=index, replicas=1, losses=[])
        started = time.perf_counter()
        writer.save(lambda buffers: take_snapshot(state, drafter.objective.drafter, optimizer.optimizer,
                                                  optimizer.scheduler, buffers))
        lost = time.perf_counter() - started
        during = []
        while writer.writing:
            during += train(1)  # training goes on while it is written
        writer.wait()
        event = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()][-1]
        rows.append({"training_lost_s": lost, "held_s": event["held_s"], "write_s": event["write_s"],
                     "steps_during_write": len(during),
                     "step_ms_during_write": statistics.median(during) if during else None})
        print(f"[checkpoint-held] {json.dumps(rows[-1])}", flush=True)
    size = sum(p.stat().st_size for p in (folder / "checkpoints").rglob("*") if p.is_file())
    print(f"\n## a checkpoint at {drafter.shape.name}: {size / 1e9:.2f} GB on disk; step {before:.1f} ms without one")
    print(f"buffers made in the background after the first step: {reserve['reserve_s']:.2f} s, "
          f"{reserve['steps_during_reserve']} steps meanwhile at {reserve['step_ms_during_reserve']} ms (median)")
    print("| checkpoint | training lost s | held s (copy off the device) | write s (background) "
          "| steps during the write | step ms during the write |")
    print("| --- | --- | --- | --- | --- | --- |")
    for number, r in enumerate(rows, 1):
        during = "-" if r["step_ms_during_write"] is None else f"{r['step_ms_during_write']:.1f}"
        print(f"| {number} | {r['training_lost_s']:.3f} "
              f"| {r['held_s']:.3f} | {r['write_s']:.1f} | {r['steps_during_write']} | {during} |")
    shutil.rmtree(folder, ignore_errors=True)
    return {"bytes": size, "step_ms": before, **reserve, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=RunSpec.parse, metavar="RUN")
    parser.add_argument("--step-parts", action="store_true", help="the drafter alone: fwd+bwd vs optimizer (above)")
    parser.add_argument("--checkpoint-held", action="store_true", help="the drafter alone: a checkpoint's held time")
    parser.add_argument("--iters", type=int, default=8, help="--step-parts: timed steps per row")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-trainer"))
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the averages")
    parser.add_argument("--timeout-s", type=float, default=420, help="per trainer run")
    parser.add_argument("--cpu-check", action="store_true", help="micro target on the CPU, compile off")
    args = parser.parse_args()
    cpu = args.cpu_check
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.step_parts or args.checkpoint_held:
        alone = {}
        if args.step_parts:
            alone["step_parts"] = step_parts(cpu, args.iters)
        if args.checkpoint_held:
            alone["checkpoint_held"] = checkpoint_held(cpu, work)
        write_report(alone, "gpu_trainer-drafter-alone.json")
        return
    if not args.runs:
        parser.error("give RUNs, --step-parts or --checkpoint-held")
    architecture, shape = (MICRO_TARGET, MICRO_DRAFTER) if cpu else (QWEN3_8B_TARGET, QWEN3_8B)
    target = work / ("micro-random" if cpu else "qwen3-8b-random")
    if not target.exists():
        build_target(target, architecture, "cpu" if cpu else "cuda:0")
    data = work / "train.jsonl"
    write_data(data, samples=max(len(s.drafters) * s.steps for s in args.runs), words=shape.seq_len + 64)

    from dflash_train.model.drafter import default_target_layer_ids

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
