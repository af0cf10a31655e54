"""The training data's start-up cost at scale: first start (tokenize into the cache), cached
start (open the store and plan the batches), peak memory; optionally the per-launch
in-memory tokenization the trainer did before the cache, for comparison.

    PYTHONPATH=remote python3 bench/data_cache.py --work /tmp/data-bench [--conversations 100000]
        [--workers N] [--legacy N]

Conversations are generated here: a user prompt of 200 random words and an assistant
answer of 1,500, in the tiny path's word-level tokenizer and chat template (about 1,700
tokens each, under the recipe's max_length of 3072). Every phase runs in a fresh process
(`--phase`), so its peak resident memory is its own; the tokenizing worker processes'
peak is the largest one's (RUSAGE_CHILDREN). Batches are planned with the qwen3-8b
config's token budget and epochs, as a launch does. Times exclude importing torch and
transformers (printed apart as the process's own start).

Measured on the 2-core development machine, shared with other jobs (load average ~10),
20,000 conversations (146 MiB; 100,000 did not fit the time there), 2 workers:
first start 347 s (tokenize + write the 163 MiB store; peak RSS 376 MiB, 333 before
loading, each worker 364); cached start 0.28 s (open 0.00 s, plan 6 epochs 0.28 s; peak
RSS 344 MiB). The old in-memory tokenization, on 5,000 of them: 73 s and +93 MiB
resident (19 KB per conversation), at every launch. The CPU was oversubscribed, so the
2 workers gained nothing over 1 there; on a host with free cores the first start divides
by the cores.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

MAX_LENGTH, TOKEN_BUDGET, PAD_MULTIPLE, EPOCHS = 3072, 12288, 64, 6  # configs/train/qwen3-8b.yaml
PROMPT_WORDS, ANSWER_WORDS, VOCAB_WORDS = 200, 1500, 200


def generate(path: Path, conversations: int) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(VOCAB_WORDS)]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(conversations):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=PROMPT_WORDS))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=ANSWER_WORDS))}]}) + "\n")


def vm_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def phase(name: str, data: Path, cache: Path, workers: int | None) -> dict:
    """One measured phase, in this process: build, cached or legacy."""
    started = time.perf_counter()
    from dflash_train.config import DataConfig, TinyTargetSpec
    from dflash_train.data.batches import BatchPlan, _read_jsonl, load_samples, tokenize_sample
    from dflash_train.data.tiny import _build_tokenizer

    tokenizer = _build_tokenizer(TinyTargetSpec(vocab_words=VOCAB_WORDS))
    imported, rss_before = time.perf_counter(), vm_rss_mib()
    if name == "legacy":  # what every launch did before the cache: all of it in Python objects
        samples = [s for s in (tokenize_sample(row, tokenizer, MAX_LENGTH, f"{data}:{number}")
                               for number, row in _read_jsonl(data)) if s is not None]
    else:
        samples = load_samples(data, tokenizer, MAX_LENGTH, cache, workers=workers)
    loaded = time.perf_counter()
    plan = BatchPlan(samples, DataConfig(train=str(data), max_length=MAX_LENGTH, token_budget=TOKEN_BUDGET,
                                         pad_multiple=PAD_MULTIPLE), replicas=2, epochs=EPOCHS, max_steps=None, seed=0)
    done = time.perf_counter()
    return {"phase": name, "samples": len(samples), "micro_batches": len(plan.entries),
            "import_s": round(imported - started, 2), "load_s": round(loaded - imported, 2),
            "plan_s": round(done - loaded, 2), "start_s": round(done - imported, 2),
            "rss_before_mib": round(rss_before, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "worker_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}


def run_phase(name: str, data: Path, cache: Path, workers: int | None) -> dict:
    argv = [sys.executable, __file__, "--phase", name, "--data", str(data), "--cache", str(cache)]
    if workers:
        argv += ["--workers", str(workers)]
    out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="a scratch folder (emptied)")
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--workers", type=int, help="tokenizing processes (default: one per core)")
    parser.add_argument("--legacy", type=int, default=0, metavar="N",
                        help="also time the old in-memory tokenization, on the first N conversations")
    parser.add_argument("--phase", choices=("build", "cached", "legacy"), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.data, args.cache, args.workers)))
        return
    if args.work is None:
        parser.error("--work is required")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    data, cache = args.work / "train.jsonl", args.work / "cache" / "tokenized"
    started = time.perf_counter()
    generate(data, args.conversations)
    print(f"{args.conversations} conversations of {PROMPT_WORDS}+{ANSWER_WORDS} words: "
          f"{data.stat().st_size / 2**20:.0f} MiB, generated in {time.perf_counter() - started:.0f}s; "
          f"{len(os.sched_getaffinity(0))} cores", flush=True)
    results = [run_phase("build", data, cache, args.workers), run_phase("cached", data, cache, args.workers)]
    if args.legacy:
        subset = args.work / "legacy.jsonl"
        with open(data, encoding="utf-8") as source, open(subset, "w", encoding="utf-8") as out:
            out.writelines(line for _, line in zip(range(args.legacy), source))
        results.append(run_phase("legacy", subset, cache, args.workers))
    store = sum(p.stat().st_size for p in cache.rglob("*.bin"))
    print(f"store: {store / 2**20:.0f} MiB on disk")
    print(f"{'phase':8} {'samples':>8} {'start s':>8} {'(load':>7} {'plan)':>6} {'RSS before':>11} "
          f"{'peak RSS':>9} {'worker peak':>12}  MiB")
    for r in results:
        print(f"{r['phase']:8} {r['samples']:8d} {r['start_s']:8.1f} {r['load_s']:7.1f} {r['plan_s']:6.1f} "
              f"{r['rss_before_mib']:11.0f} {r['peak_rss_mib']:9.0f} {r['worker_peak_rss_mib']:12.0f}")
    (args.work / "data_cache.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
