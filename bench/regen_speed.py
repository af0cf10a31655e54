"""job: regenerate's batched decoder: generated tokens/s per batch size, against the bandwidth bound.

    PYTHONPATH=remote python3 bench/regen_speed.py [--batch-sizes 64,256] [--prompts 256] [--max-new-tokens 512]
    PYTHONPATH=remote python3 bench/regen_speed.py --cpu-check

The decoder of `job: regenerate` (dflash_train.model.batched_decode.BatchedDecoder: a KV
cache of batch-size rows, graphed compiled decode steps, rows refilled as answers end) on
a target with the Qwen3-8B architecture and random bf16 weights made in memory (as
bench/gpu_trainer.py makes it), on cuda:0. Prompts are random token ids of 70-550 tokens
(the length of chat prompts of 50-400 words with their template); a random target never
produces an end token, so every answer is --max-new-tokens long, greedy.

Printed per batch size: the warm-up (compile and capture), the whole answer time and its
prefill part, generated tokens/s over the whole (what the job reports), ms per decode step,
and the bound: a step reads the target's weights and every live row's keys and values
once, at --bandwidth-tbs (the H200's 4.8 TB/s); averaged over the steps of the run, that
gives the tokens/s no decoder of this batch size exceeds (prefill not counted).

`--cpu-check` runs a micro target on the CPU in fp32 with end tokens chosen so answers end
at varied lengths (rows refilled mid-flight), 3 rows for 17 prompts, and fails unless every
answer equals transformers' greedy `generate` of its prompt alone; sampled answers must be
the same with 3 and 5 rows. $OUT/regen_speed.json holds everything when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_trainer import MICRO_TARGET, QWEN3_8B_TARGET, make_target  # noqa: E402


def cpu_check() -> bool:
    import torch

    from dflash_train.config import SamplingConfig
    from dflash_train.model.batched_decode import BatchedDecoder, Request

    torch.set_num_threads(1)
    target, _ = make_target(dict(MICRO_TARGET, vocab_size=96), "cpu", "float32")
    target.eval()
    generator = random.Random(0)
    prompts = [[generator.randrange(1, 96) for _ in range(generator.randrange(3, 40))] for _ in range(17)]
    max_new = 24
    # the two tokens the target most often picks first end answers early, at varied lengths
    with torch.no_grad():
        firsts = [int(target(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    stop = set(sorted(set(firsts), key=firsts.count)[-2:])
    reference = {}
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                  eos_token_id=sorted(stop), pad_token_id=0)[0, len(prompt):].tolist()
        end = next((i for i, token in enumerate(out) if token in stop), None)
        reference[index] = out if end is None else out[:end]
    requests = [Request(i, tuple(p)) for i, p in enumerate(prompts)]

    def answers(rows: int, sampling=None) -> dict[int, list[int]]:
        decoder = BatchedDecoder(target, rows, max(map(len, prompts)) + max_new, max_new, stop, sampling,
                                 length_step=16)
        decoder.warm_up()
        got: dict[int, list[int]] = {}
        decoder.run(iter(requests), lambda done: got.update((g.index, g.tokens) for g in done))
        return got

    greedy = answers(3)
    lengths = sorted(len(tokens) for tokens in reference.values())
    equal = [i for i in reference if greedy.get(i) == reference[i]]
    sampling = SamplingConfig(temperature=1.3, top_p=0.9, top_k=20, seed=5)
    same_sampled = answers(3, sampling) == answers(5, sampling)
    print(f"cpu check: {len(equal)}/{len(prompts)} answers equal generate's (answer lengths {lengths}); "
          f"sampled answers the same with 3 and 5 rows: {same_sampled}", flush=True)
    return len(equal) == len(prompts) and len(set(lengths)) > 2 and same_sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8)
    parser.add_argument("--attention", default="auto",
                        help="the decoder's attention, comma-separated: auto, split, flex, sdpa")
    parser.add_argument("--cpu-check", action="store_true")
    args = parser.parse_args()
    if args.cpu_check:
        sys.exit(0 if cpu_check() else 1)
    import torch

    from dflash_train.model.batched_decode import BatchedDecoder, Request

    started = time.perf_counter()
    target, _ = make_target(QWEN3_8B_TARGET, "cuda:0", "bfloat16")
    target.requires_grad_(False)
    target.eval()
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    config = target.config
    kv_per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    print(f"target: Qwen3-8B architecture, bf16, {weights / 1e9:.1f} GB, built in {time.perf_counter() - started:.0f}s",
          flush=True)
    generator = random.Random(0)
    prompts = [tuple(generator.randrange(16, 30000) for _ in range(generator.randrange(70, 551)))
               for _ in range(args.prompts)]
    report = {"gpu": torch.cuda.get_device_name(0), "weights_bytes": weights, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "bandwidth_tbs": args.bandwidth_tbs, "runs": []}
    for batch, attention in ((int(b), a) for b in args.batch_sizes.split(",") for a in args.attention.split(",")):
        capacity = max(map(len, prompts)) + args.max_new_tokens
        built = time.perf_counter()
        decoder = BatchedDecoder(target, batch, capacity, args.max_new_tokens, set(), None, attention=attention)
        decoder.warm_up()
        torch.cuda.synchronize()
        warm = time.perf_counter() - built
        prefill_s, live_kv, counts = 0.0, [], []
        prefill = decoder._prefill

        def timed_prefill(*a):
            nonlocal prefill_s
            begin = time.perf_counter()
            out = prefill(*a)
            prefill_s += time.perf_counter() - begin
            return out

        decoder._prefill = timed_prefill
        live: dict[int, int] = {}  # prompt index -> the positions its row holds

        def feed():
            for index, prompt in enumerate(prompts):
                live[index] = len(prompt)
                yield Request(index, prompt)

        def deliver(ended):
            for generated in ended:
                counts.append(generated.count)
                live.pop(generated.index)

        def stepped():  # after a step: every live row holds one position more
            for index in live:
                live[index] += 1
            live_kv.append(sum(live.values()))

        begin = time.perf_counter()
        decoder.run(feed(), deliver, on_step=stepped)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        tokens, steps = sum(counts), len(live_kv)
        decode_s = seconds - prefill_s
        mean_kv = sum(live_kv) / max(len(live_kv), 1) * kv_per_position
        bound_step = (weights + mean_kv) / (args.bandwidth_tbs * 1e12)
        run = {"batch_size": batch, "attention": decoder.attention, "capacity": decoder.capacity,
               "warm_up_s": round(warm, 1), "seconds": round(seconds, 2), "prefill_s": round(prefill_s, 2),
               "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1), "decode_steps": steps,
               "ms_per_step": round(1000 * decode_s / max(steps, 1), 3),
               "bound_ms_per_step": round(1000 * bound_step, 3),
               "bound_tokens_per_s": round(batch / bound_step, 1),
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
        del decoder
        # its caches freed before the next decoder is built: its graphed steps' closures hold
        # it in a reference cycle, and Dynamo's caches its compiled steps
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "regen_speed.json").write_text(json.dumps(report, indent=1))
    print("\n| batch | attention | tokens/s | ms/step | bound ms/step | bound tokens/s | prefill s | warm-up s |")
    for run in report["runs"]:
        print(f"| {run['batch_size']} | {run['attention']} | {run['tokens_per_s']} | {run['ms_per_step']} | "
              f"{run['bound_ms_per_step']} | {run['bound_tokens_per_s']} | {run['prefill_s']} | {run['warm_up_s']} |")


if __name__ == "__main__":
    main()
