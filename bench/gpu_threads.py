"""CUDA graphs in several drafter threads (issue 4): the failure, the fix, the speed.

    PYTHONPATH=remote python3 bench/gpu_threads.py [--parts naive,threads,tiny,8b] [--steps 500]

Parts (each prints a table; all numbers also go to $OUT/gpu_threads-<parts>.json when $OUT is set):
  naive    torch.compile(mode="reduce-overhead") in two drafter threads, in a child
           process: on torch <= 2.12 the second thread's TLS assertion is the expected
           result, reported as such.
  threads  the cudagraphs policy with 2 and 4 data-parallel drafter threads on one GPU,
           gradients averaged every step as the pipeline does, --steps steps: errors,
           and every thread's losses against eager (bf16 autocast both: stated
           tolerance, every step) and against the same graphs replayed in one thread.
  tiny, 8b drafter step time per compile mode at the tiny shape and the Qwen3-8B
           drafter shape, and the drafter MFU (FLOP count printed with it).

The drafter, objective and step are the trainer's own (dflash_train); only the data is
random. Needs CUDA, except `--device cpu`, which runs the eager and compile modes of a
micro shape and the threads part's training (eager, two threads against one) to check
this script itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
from transformers import Qwen3Config

from dflash_train.compiling import cudagraphs
from dflash_train.compiling.policy import build_train_step, configure_compiler
from dflash_train.compiling.step_build import torch_version
from dflash_train.config import DrafterConfig
from dflash_train.data.batches import BatchShape
from dflash_train.devices import CAPTURE_LOCK, Fence, canonical, is_cuda, thread_stream
from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
from dflash_train.model.objective import DraftObjective, DrafterInputs, block_labels, position_weights
from dflash_train.training.distributed import Layout
from dflash_train.faults import FaultInjector
from dflash_train.training.gradients import GradientExchange, Posted, step_facts
from dflash_train.runlog import ErrorLog, ThreadNames
from dflash_train.threads import Rendezvous, StopLatch
from dflash_train.training.step import at_rendezvous, training_step

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, datasheet (SXM); the MFU denominator
# bf16 autocast: Inductor's fused kernels round differently than eager's, and 500 steps
# of training carry the difference along.
LOSS_ATOL_VS_EAGER, LOSS_RTOL_VS_EAGER = 0.05, 0.05


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    block: int
    anchors: int
    seq_len: int
    feature_layers: int = 5

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layer(s), intermediate {self.intermediate}, heads "
                f"{self.heads}/{self.kv_heads}x{self.head_dim}, vocab {self.vocab}, block {self.block}, "
                f"{self.anchors} anchors, context {self.seq_len}, {self.feature_layers} target features")


# Qwen3-0.6B's widths with one layer: small enough to be launch-bound.
TINY = Shape("tiny", 1024, 1, 3072, 16, 8, 128, 151936, 16, 64, 1024)
# The drafter DFlash trains for Qwen3-8B.
QWEN3_8B = Shape("8b-drafter", 4096, 5, 12288, 32, 8, 128, 151936, 16, 512, 3072)
MICRO = Shape("micro", 64, 1, 128, 4, 2, 16, 512, 4, 8, 64, 2)  # --device cpu self-check


def step_flops(shape: Shape) -> dict[str, float]:
    """Model FLOPs of one training step (forward + backward) for one sequence.

    Matmuls count 2 FLOPs per multiply-add; backward is 2x forward for trainable weights
    (input and weight gradients), 1x for `fc` (its input, the target features, needs no
    gradient) and for the frozen LM head (input gradient only). Attention counts only
    visible (query, key) pairs -- its block's 16 keys plus the context before the anchor,
    anchors spread evenly, so on average half the context -- at 4*d per pair forward and
    2x that backward. Norms, RoPE, softmax and the loss are not counted.
    """
    q = shape.anchors * shape.block  # query (block) tokens
    kv = shape.seq_len + q
    width = shape.heads * shape.head_dim
    kv_width = shape.kv_heads * shape.head_dim
    per_layer = 2 * (q * shape.hidden * width * 2  # q_proj, o_proj
                     + kv * shape.hidden * kv_width * 2  # k_proj, v_proj over context + block
                     + q * shape.hidden * shape.intermediate * 3)  # gate, up, down
    visible_pairs = q * (shape.seq_len / 2 + shape.block)
    attention = 4 * shape.heads * shape.head_dim * visible_pairs
    fc = 2 * shape.seq_len * shape.feature_layers * shape.hidden * shape.hidden
    lm_head = 2 * shape.anchors * (shape.block - 1) * shape.hidden * shape.vocab
    parts = {"layers": 3 * shape.layers * per_layer, "attention": 3 * shape.layers * attention,
             "fc": 2 * fc, "lm_head": 2 * lm_head}
    parts["total"] = sum(parts.values())
    return parts


class Frozen:
    """The target's embedding and LM head (random bf16), shared by every replica of a shape."""

    def __init__(self, shape: Shape, device: str):
        generator = torch.Generator(device).manual_seed(1234)
        self.embed = torch.randn(shape.vocab, shape.hidden, generator=generator, device=device).to(torch.bfloat16)
        self.head = (torch.randn(shape.vocab, shape.hidden, generator=generator, device=device) * 0.02).to(
            torch.bfloat16)


def make_objective(shape: Shape, frozen: Frozen, device: str, use_flex: bool = False) -> DraftObjective:
    """The trainer's drafter + objective at `shape`, fp32 master weights, same init per call."""
    target = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=36, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=40960)
    spec = DrafterConfig(num_layers=shape.layers, block_size=shape.block, num_anchors=shape.anchors)
    config = drafter_hf_config(target, spec, tuple(range(1, 1 + 8 * shape.feature_layers, 8)),
                               mask_token_id=shape.vocab - 1)
    with torch.device(device):
        drafter = DFlashDrafter(config)
    drafter.reset_parameters(torch.Generator(device).manual_seed(0))
    return DraftObjective(drafter.train(), frozen.embed, frozen.head, use_flex)


def make_batches(shape: Shape, count: int, seed: int, device: str) -> list[DrafterInputs]:
    """Learnable random sequences: the first 4096 ids in one fixed random cyclic order,
    entered at a random point; `shape.anchors` anchors spread over the context. A drafter
    can learn the order from the anchor token alone, so the loss falls steadily without
    memorising batches (every step gets fresh ones)."""
    words = min(4096, shape.vocab - 1)
    order = torch.randperm(words, generator=torch.Generator().manual_seed(99))
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        start = int(torch.randint(0, words, (1,), generator=generator))
        ids = order[(start + torch.arange(shape.seq_len)) % words][None]  # (1, S)
        anchors = torch.sort(torch.randperm(shape.seq_len - 2, generator=generator)[:shape.anchors] + 1).values[None]
        valid = torch.ones_like(anchors, dtype=torch.bool)
        labels, weights = block_labels(ids, torch.zeros_like(ids), anchors, valid,  # one turn throughout
                                       position_weights(shape.block, 7.0))
        feature_gen = torch.Generator(device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        features = torch.randn(1, shape.seq_len, shape.feature_layers * shape.hidden, generator=feature_gen,
                               device=device).to(torch.bfloat16)
        batches.append(DrafterInputs(ids.to(device), features, anchors.to(device), valid.to(device),
                                     labels.to(device), weights.to(device)))
    return batches


def build_step(mode: str, objective: DraftObjective, example: DrafterInputs):
    """The train step (forward+backward) a drafter thread would build for `mode`."""
    if mode in ("off", "default"):
        return build_train_step(mode, objective, example)
    if mode == "cudagraphs":
        return cudagraphs.build_cudagraph_train_step(objective, example, strategy="whole_step")
    if mode == "trees-1-thread":
        # What the upstream strategy runs (reduce-overhead, fullgraph, static shapes), timed
        # in one thread: the one setting torch 2.11 can run it in. Chooses between the two.
        shape = BatchShape(example.input_ids.shape[0], example.input_ids.shape[1], example.anchors.shape[1])
        bucket = cudagraphs._Bucket(shape, example)
        with CAPTURE_LOCK:
            replay, _ = cudagraphs._warm_up_upstream(objective, [bucket])

        def step(inputs: DrafterInputs):
            bucket.load(inputs)
            return replay(bucket, True, True)  # one micro-batch a step

        return step
    raise ValueError(mode)


class Updater:
    """replica.Replica.apply for one replica: clip, AdamW, LR schedule, zero_grad."""

    def __init__(self, objective: DraftObjective):
        self.params = list(objective.drafter.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / 20))

    def apply(self, mean_grads: list[torch.Tensor]) -> float:
        for param, grad in zip(self.params, mean_grads):
            param.grad = grad
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


# ----------------------------------------------------------------------------- naive


def naive_child(steps: int = 3) -> None:
    """Two drafter threads, one after the other, each with its own reduce-overhead
    compiled objective; prints one JSON line per thread.

    The second drafter's batches are half as long (another shape bucket). With the same
    shape it would hit the first thread's compiled artifact, whose graphed callable (and
    CUDA-graph tree) compile_fx caches in a closure: no tree lookup, so no assertion
    (seen on torch 2.11), and instead two threads sharing one tree. A new shape makes
    Inductor set up a tree for the second thread, which is where the TLS lookup fails."""
    shape = Shape("naive", 256, 1, 768, 4, 2, 64, 4096, 8, 16, 256, 2)
    frozen = Frozen(shape, "cuda")
    batches = [make_batches(dataclasses.replace(shape, seq_len=shape.seq_len // (1 + i)), 1, 0, "cuda")[0]
               for i in range(2)]
    configure_compiler("cudagraphs", 2)

    def drafter(index: int) -> None:
        result = {"thread": f"drafter-{index}"}
        try:
            objective = make_objective(shape, frozen, "cuda")
            # Everything else done right (fullgraph, static shapes): only the thread differs.
            compiled = torch.compile(objective, mode="reduce-overhead", fullgraph=True, dynamic=False)
            for _ in range(steps):
                objective.drafter.zero_grad(set_to_none=True)  # as an optimizer loop would
                loss, _, _ = compiled(batches[index])
                loss.backward()
            torch.cuda.synchronize()
            result.update(ok=True, loss=float(loss))
        except BaseException as exc:  # the point of this child: report what happened
            traceback.print_exc()
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            result.update(ok=False, exc_type=type(exc).__name__, message=str(exc).strip()[:300],
                          where=f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}",
                          code=(frame.line or "").strip())
        print("NAIVE " + json.dumps(result), flush=True)

    for index in range(2):
        thread = threading.Thread(target=drafter, args=(index,), name=f"drafter-{index}")
        thread.start()
        thread.join()


def part_naive(report: dict) -> None:
    started = time.perf_counter()
    child = subprocess.run([sys.executable, __file__, "--naive-child"], capture_output=True, text=True,
                           timeout=400, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = [json.loads(line[6:]) for line in child.stdout.splitlines() if line.startswith("NAIVE ")]
    expect_failure = torch_version() < cudagraphs.UPSTREAM_THREAD_SAFE_TORCH
    second = rows[1] if len(rows) > 1 else None
    if second is None:
        verdict = f"UNEXPECTED: the child exited {child.returncode} without a result for drafter-1"
    elif expect_failure:
        hit = (not second["ok"] and second["exc_type"] == "AssertionError" and "_is_key_in_tls" in
               second.get("code", "") + second.get("message", ""))
        verdict = ("failure reproduced as expected (TLS assertion in the second thread)" if hit
                   else "UNEXPECTED: torch <= 2.12 should fail here with the TLS assertion")
    else:
        verdict = ("no failure, as expected on torch >= 2.13" if second["ok"]
                   else "UNEXPECTED: failed on torch >= 2.13")
    report["naive"] = {"rows": rows, "verdict": verdict, "seconds": round(time.perf_counter() - started, 1),
                       "child_exit": child.returncode, "child_stderr_tail": child.stderr[-2000:]}
    print("\n## naive torch.compile(mode='reduce-overhead'), one drafter thread after another")
    print("| thread | result |\n| --- | --- |")
    for row in rows:
        text = (f"ok (loss {row['loss']:.4f})" if row["ok"] else
                f"{row['exc_type']}: {row['message'][:120]} at {row['where']}: `{row['code']}`")
        print(f"| {row['thread']} | {text} |")
    print(f"verdict: {verdict}")


# --------------------------------------------------------------------------- threads


class BenchReplica:
    """A drafter as training_step steps it: its train step, the Updater, and the losses it posted."""

    accumulate = 1

    def __init__(self, index: int, replicas: int, objective: DraftObjective, device: str):
        self.index = self.global_index = index
        self.layout = Layout(local_replicas=replicas)
        self.objective, self.device = objective, device
        self.updater = Updater(objective)
        self.train_step = None  # built in the thread that steps it
        self.losses: list[torch.Tensor] = []

    def run_step(self, inputs: DrafterInputs, poison: bool, summed):  # one micro-batch a step
        return self.train_step(inputs)

    def post(self, stats) -> Posted:
        grads = [p.grad for p in self.objective.drafter.parameters()]
        self.losses.append(stats.loss)
        return Posted(grads, step_facts(stats, grads[0].dtype), Fence(self.device), canonical(self.device))

    def apply(self, averaged, step: int) -> None:
        averaged.fence.wait(self.device, averaged.flat)  # the exchange's copies are done
        self.updater.apply(averaged.grads)


def train_replicas(shape: Shape, frozen: Frozen, replicas: int, steps: int, mode: str, threaded: bool,
                   device: str = "cuda:0") -> dict:
    """`replicas` data-parallel drafters on one device, stepped by the trainer's
    training_step (train step, the rendezvous of threads.Rendezvous, the lead's
    GradientExchange, clip, AdamW), fresh data every step."""
    drafters = [BenchReplica(r, replicas, make_objective(shape, frozen, device), device) for r in range(replicas)]
    data = [make_batches(shape, steps, 100 + r, device) for r in range(replicas)]
    exchange = GradientExchange(Layout(local_replicas=replicas), None)
    no_faults = FaultInjector(())
    errors: list[str] = []
    synchronize = torch.cuda.synchronize if is_cuda(device) else (lambda: None)

    started = time.perf_counter()
    if not threaded:
        for r in range(replicas):
            drafters[r].train_step = build_step(mode, drafters[r].objective, data[r][0])
        build_s = time.perf_counter() - started
        for step in range(steps):
            training_step(drafters, [[data[r][step]] for r in range(replicas)], exchange.average, no_faults,
                          step + 1, peers=None)
    else:
        ready = [threading.Event() for _ in range(replicas)]
        build_times = [0.0] * replicas
        folder = Path(tempfile.mkdtemp(prefix="gpu-threads-"))  # the stop latch's files
        latch = StopLatch(ErrorLog(folder / "errors.jsonl"), ThreadNames(folder / "threads.json"))
        rendezvous = Rendezvous(replicas, latch)

        def drafter(r: int) -> None:
            try:
                with thread_stream(device):  # each drafter on a stream of its own, as in the pipeline
                    began = time.perf_counter()
                    drafters[r].train_step = build_step(mode, drafters[r].objective, data[r][0])
                    build_times[r] = time.perf_counter() - began
                    ready[r].set()
                    for step in range(steps):
                        training_step([drafters[r]], [[data[r][step]]], at_rendezvous(rendezvous, r, exchange.average),
                                      no_faults, step + 1, peers=None)
                    if is_cuda(device):
                        torch.cuda.current_stream().synchronize()
            except BaseException:  # counted and shown in the table
                errors.append(f"drafter-{r}: {traceback.format_exc()}")
                ready[r].set()
                latch.request_stop(f"drafter-{r} failed")  # the others leave the rendezvous

        threads = [threading.Thread(target=drafter, args=(r,), name=f"drafter-{r}") for r in range(replicas)]
        for thread, is_ready in zip(threads, ready):  # the coordinator's ready barrier
            thread.start()
            is_ready.wait()
        for thread in threads:
            thread.join()
        shutil.rmtree(folder)
        build_s = sum(build_times)
    synchronize()
    return {"losses": [[float(x) for x in d.losses] for d in drafters], "errors": errors,
            "build_s": build_s, "total_s": time.perf_counter() - started}


def check_threads_on_cpu(report: dict) -> None:
    """The threads part's code, eager at the micro shape: two drafter threads must train
    as the same two drafters one after another do, to the bit."""
    frozen = Frozen(MICRO, "cpu")
    alone = train_replicas(MICRO, frozen, 2, 3, "off", threaded=False, device="cpu")
    threaded = train_replicas(MICRO, frozen, 2, 3, "off", threaded=True, device="cpu")
    passed = not threaded["errors"] and threaded["losses"] == alone["losses"]
    report["threads_cpu"] = {"pass": passed, "losses": threaded["losses"], "error_text": threaded["errors"][:2]}
    print(f"[threads] 2 drafter threads on the CPU train as one thread does: {passed}", flush=True)
    for text in threaded["errors"][:2]:
        print(text)


def _first_difference(a: list[list[float]], b: list[list[float]]) -> str:
    for r, (ra, rb) in enumerate(zip(a, b)):
        for step, (x, y) in enumerate(zip(ra, rb)):
            if x != y:
                return f"drafter-{r} step {step + 1}: {x!r} vs {y!r}"
    return "none"


def part_threads(report: dict, steps: int) -> None:
    # Deterministic kernels where torch has them (with CUBLAS_WORKSPACE_CONFIG set by the
    # caller), so "the same graphs replayed in one thread" is as close a reference as it
    # can be; cuDNN attention's backward stays non-deterministic.
    torch.use_deterministic_algorithms(True, warn_only=True)
    frozen = Frozen(TINY, "cuda")
    rows = []
    for replicas in (2, 4):
        eager = train_replicas(TINY, frozen, replicas, steps, "off", threaded=False)
        alone = train_replicas(TINY, frozen, replicas, steps, "cudagraphs", threaded=False)
        threaded = train_replicas(TINY, frozen, replicas, steps, "cudagraphs", threaded=True)
        done = [len(x) for x in threaded["losses"]]
        pairs = [(a, b) for ta, tb in zip(threaded["losses"], eager["losses"]) for a, b in zip(ta, tb)]
        within = [abs(a - b) <= LOSS_ATOL_VS_EAGER + LOSS_RTOL_VS_EAGER * abs(b) for a, b in pairs]
        row = {"threads": replicas, "steps": steps, "steps_done": done, "errors": len(threaded["errors"]),
               "bit_identical_to_one_thread": threaded["losses"] == alone["losses"],
               "first_difference_vs_one_thread": _first_difference(threaded["losses"], alone["losses"]),
               "max_abs_diff_vs_eager": max(abs(a - b) for a, b in pairs) if pairs else None,
               "max_rel_diff_vs_eager": max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None,
               "steps_within_tolerance": f"{sum(within)}/{len(within)}",
               "first_loss": threaded["losses"][0][0] if done[0] else None,
               "last_loss": threaded["losses"][0][-1] if done[0] else None,
               "eager_last_loss": eager["losses"][0][-1],
               "capture_s": round(threaded["build_s"], 1), "error_text": threaded["errors"][:2],
               "losses_every_50": {name: [row[::50] for row in run["losses"]]
                                   for name, run in (("eager", eager), ("one_thread", alone),
                                                     ("threaded", threaded))}}
        row["max_rel_diff_vs_one_thread"] = max((abs(a - b) / abs(b) for ta, tb in zip(threaded["losses"], alone["losses"])
                                                 for a, b in zip(ta, tb)), default=None)
        # Not bit identity: the graphs hold cuDNN's attention backward, which is
        # non-deterministic even under use_deterministic_algorithms (torch warns so).
        row["pass"] = row["errors"] == 0 and all(d == steps for d in done) and bool(within) and all(within)
        rows.append(row)
        print(f"[threads] {replicas} threads: errors {row['errors']}, pass {row['pass']}, "
              f"first difference vs one thread: {row['first_difference_vs_one_thread']}", flush=True)
        for text in threaded["errors"][:2]:
            print(text, flush=True)
    torch.use_deterministic_algorithms(False)
    report["threads"] = {"shape": TINY.describe(), "atol_vs_eager": LOSS_ATOL_VS_EAGER,
                         "rtol_vs_eager": LOSS_RTOL_VS_EAGER, "rows": rows}
    print(f"\n## cudagraphs policy, data-parallel drafter threads on one GPU ({TINY.name}: {TINY.describe()})")
    print(f"tolerance vs eager, every step: |loss - eager| <= {LOSS_ATOL_VS_EAGER} + {LOSS_RTOL_VS_EAGER} * eager")
    print("| threads | steps each | errors | bit-identical to the same graphs in one thread (max rel. diff) "
          "| steps within tolerance of eager | max abs / rel diff vs eager | loss first -> last (eager last) "
          "| capture s | pass |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        diff = (f"{r['max_abs_diff_vs_eager']:.3g} / {r['max_rel_diff_vs_eager']:.3g}"
                if r["max_abs_diff_vs_eager"] is not None else "-")
        losses = (f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} ({r['eager_last_loss']:.4f})"
                  if r["first_loss"] is not None else "-")
        print(f"| {r['threads']} | {min(r['steps_done'])} | {r['errors']} | {r['bit_identical_to_one_thread']} "
              f"({'-' if r['max_rel_diff_vs_one_thread'] is None else format(r['max_rel_diff_vs_one_thread'], '.2g')}) "
              f"| {r['steps_within_tolerance']} | {diff} | {losses} | {r['capture_s']} | {r['pass']} |")
        for text in r["error_text"]:
            print(text)


# ---------------------------------------------------------------------------- timing


def time_mode(shape: Shape, frozen: Frozen, mode: str, device: str, iters: int, use_flex: bool) -> dict:
    """Median ms of the forward+backward alone and of the whole drafter step (with the
    update the pipeline runs after it), each step synchronized as the trainer's is."""
    objective = make_objective(shape, frozen, device, use_flex)
    updater = Updater(objective)
    batches = make_batches(shape, 4, 7, device)
    started = time.perf_counter()
    step = build_step(mode, objective, batches[0])
    build_s = time.perf_counter() - started
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(run_update: bool) -> list[float]:
        times = []
        for i in range(iters + 3):
            sync()
            began = time.perf_counter()
            stats = step(batches[i % len(batches)])
            if run_update:
                updater.apply([p.grad for p in updater.params])
            else:
                objective.drafter.zero_grad(set_to_none=True)
            sync()
            times.append((time.perf_counter() - began) * 1e3)
            assert torch.isfinite(stats.loss), f"{mode}: loss {float(stats.loss)}"
        return times[3:]  # the first steps still allocate, autotune, warm caches

    forward_backward = timed(False)
    whole = timed(True)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    del step, objective, updater, batches
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"mode": mode, "flex": use_flex, "build_s": round(build_s, 1),
            "fwd_bwd_ms": statistics.median(forward_backward), "step_ms": statistics.median(whole),
            "step_ms_p10": sorted(whole)[len(whole) // 10], "step_ms_p90": sorted(whole)[(9 * len(whole)) // 10],
            "peak_gib": round(peak_gib, 1)}


def part_timing(report: dict, shape: Shape, device: str, iters: int, modes: list[tuple[str, bool]],
                deadline: float) -> None:
    frozen = Frozen(shape, device)
    flops = step_flops(shape)
    rows = []
    for mode, use_flex in modes:
        if time.monotonic() > deadline:
            rows.append({"mode": mode, "flex": use_flex, "error": "not run: out of time (--deadline-s)"})
            continue
        try:
            rows.append(time_mode(shape, frozen, mode, device, iters, use_flex))
        except Exception as exc:  # a mode that fails is a row of the table, not the end of the run
            rows.append({"mode": mode, "flex": use_flex, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                         "traceback": traceback.format_exc()[-3000:]})
        print(f"[{shape.name}] {rows[-1]}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    eager = next((r for r in rows if r["mode"] == "off" and "error" not in r), None)
    for row in rows:
        if "error" in row:
            continue
        row["tflops"] = flops["total"] / (row["step_ms"] / 1e3) / 1e12
        row["mfu"] = flops["total"] / (row["step_ms"] / 1e3) / H200_BF16_DENSE_PEAK
        row["mfu_fwd_bwd"] = (flops["total"] / (row["fwd_bwd_ms"] / 1e3)) / H200_BF16_DENSE_PEAK
        if eager:
            row["speedup_vs_eager"] = eager["step_ms"] / row["step_ms"]
            row["fwd_bwd_speedup_vs_eager"] = eager["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    report[f"timing_{shape.name}"] = {"shape": shape.describe(), "flops": flops, "iters": iters, "rows": rows}
    print(f"\n## drafter step time, {shape.name} ({shape.describe()}), one drafter, median of {iters}")
    print(f"FLOPs per step (model FLOPs, see step_flops): {flops['total'] / 1e12:.2f} TFLOP "
          f"(layers {flops['layers'] / 1e12:.2f}, attention {flops['attention'] / 1e12:.2f}, "
          f"fc {flops['fc'] / 1e12:.2f}, LM head {flops['lm_head'] / 1e12:.2f}); "
          f"MFU against {H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s dense bf16")
    print("| mode | attention | build s | fwd+bwd ms | step ms (p10-p90) | vs eager (step / fwd+bwd) | TFLOP/s | MFU "
          "| peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        attention = "flex" if r["flex"] else "sdpa"
        if "error" in r:
            print(f"| {r['mode']} | {attention} | - | - | {r['error']} | | | | |")
            continue
        speed = (f"{r['speedup_vs_eager']:.2f}x / {r['fwd_bwd_speedup_vs_eager']:.2f}x"
                 if "speedup_vs_eager" in r else "-")
        print(f"| {r['mode']} | {attention} | {r['build_s']} | {r['fwd_bwd_ms']:.2f} | {r['step_ms']:.2f} "
              f"({r['step_ms_p10']:.2f}-{r['step_ms_p90']:.2f}) | {speed} | {r['tflops']:.0f} "
              f"| {100 * r['mfu']:.1f}% | {r['peak_gib']} |")


def _modes(text: str) -> list[tuple[str, bool]]:
    """"off,cudagraphs:flex" -> [("off", False), ("cudagraphs", True)]."""
    return [(m.split(":")[0], m.endswith(":flex")) for m in text.split(",") if m]


def write_report(report: dict, name: str) -> None:
    out = os.environ.get("OUT")
    if out:
        tmp = Path(out) / f"{name}.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, Path(out) / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="naive,threads,tiny,8b")
    parser.add_argument("--steps", type=int, default=500, help="steps per thread in the threads part")
    parser.add_argument("--iters", type=int, default=60, help="timed steps per mode at tiny (8b: a sixth)")
    parser.add_argument("--tiny-modes", default="off,default,cudagraphs,trees-1-thread,cudagraphs:flex",
                        help="compiling.policy's off/default, our cudagraphs, CUDA-graph trees; ':flex' = flex attention")
    parser.add_argument("--8b-modes", dest="big_modes", default="off,cudagraphs:flex,cudagraphs,default:flex,default")
    parser.add_argument("--deadline-s", type=float, default=540, help="start nothing new after this many seconds")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--naive-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_child:
        naive_child()
        return
    deadline = time.monotonic() + args.deadline_s
    parts = args.parts.split(",")
    report: dict = {"torch": torch.__version__, "argv": sys.argv}
    # Every drafter object compiled in this process is a guard target of the same code.
    configure_compiler("cudagraphs", 16)
    if args.device == "cpu":
        check_threads_on_cpu(report)
        part_timing(report, MICRO, "cpu", 3, [(m, False) for m in ("off", "default")], deadline)
        return
    report["gpu"] = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {report['gpu']}, cudagraphs strategy for drafters sharing this GPU: "
          f"{cudagraphs.resolve_strategy('auto', drafters_share_a_device=True)}", flush=True)
    for part in parts:
        began = time.perf_counter()
        if time.monotonic() > deadline:
            print(f"[{part}] not run: out of time (--deadline-s {args.deadline_s})")
            continue
        if part == "naive":
            part_naive(report)
        elif part == "threads":
            part_threads(report, args.steps)
        elif part == "tiny":
            part_timing(report, TINY, "cuda", args.iters, _modes(args.tiny_modes), deadline)
        elif part == "8b":
            part_timing(report, QWEN3_8B, "cuda", max(4, args.iters // 6), _modes(args.big_modes), deadline)
        else:
            raise SystemExit(f"unknown part {part!r}")
        report.setdefault("part_seconds", {})[part] = round(time.perf_counter() - began, 1)
        write_report(report, f"gpu_threads-{'-'.join(parts)}.json")
        print(f"[{part}] done in {time.perf_counter() - began:.0f}s", flush=True)


if __name__ == "__main__":
    main()
