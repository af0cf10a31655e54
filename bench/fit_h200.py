"""The shipped configs on the GPU they name: memory per drafter, and the configs run as shipped.

    PYTHONPATH=remote:bench python3 bench/fit_h200.py prepare [configs/train/qwen3-8b.yaml] --work /tmp/fit
        a random-weight target of the architecture of the config's target.path (gpu_trainer.TARGETS:
        Qwen3-8B, Llama-3.1-8B-Instruct, gpt-oss-20b, Qwen3-30B-A3B; bf16, saved with
        save_pretrained in WORK/targets/<target.path with / as -->, the tiny path's word-level
        tokenizer and ChatML template), and chat data: conversations of 500-3000 tokens, a user
        turn then the assistant's answer, and held-out prompts. On disk the target is 2 bytes a
        parameter: 16 GB for the 8B ones, 42 GB for gpt-oss-20b, 61 GB for Qwen3-30B-A3B.
    PYTHONPATH=remote:bench python3 bench/fit_h200.py step-memory [--shapes 1x3072,4x768,...]
        the drafter alone at the Qwen3-8B shape (5 layers, 512 anchors, block 16), eager
        (compile: off, sdpa): peak GiB of one forward+backward per micro-batch shape and its
        ms, with the loss as it was (every (B, N, 15, V) logit at once) and as it is (the
        frozen head's cross-entropy in chunks, model/head_loss.py). "OOM" where it did not fit.
    PYTHONPATH=remote:bench python3 bench/fit_h200.py train configs/train/qwen3-8b.yaml --work /tmp/fit \
            --steps 12 [--set KEY=VALUE ...]
        `python -m dflash_train` (what the agent runs) on the config as shipped, its paths
        pointed at the work folder (target.path at the prepared target of its architecture),
        optim.max_steps set, evaluations cut to 2 prompts of 32
        tokens (they measure acceptance, not what is trained): exit code, launch -> first
        step, samples/s and ms a step after the first 2 steps, the peak memory the step
        events report, the export, and the tail of train.log.
    PYTHONPATH=remote:bench python3 bench/fit_h200.py evaluate configs/train/evaluate-qwen3-8b.yaml \
            --work /tmp/fit --drafter RUN_DIR/export
        `job: evaluate` of that config on the work's target and prompts.

Everything printed is also written as JSON lines to $OUT/fit_h200.jsonl when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent


def report(record: dict) -> None:
    print(json.dumps(record), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "fit_h200.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def target_folder(work: Path, config_path: Path) -> tuple[Path, dict]:
    """Where prepare puts the random-weight stand-in for the config's target, and its architecture."""
    from gpu_trainer import TARGETS

    name = yaml.safe_load(config_path.read_text()).get("target", {}).get("path")
    if name not in TARGETS:
        raise SystemExit(f"{config_path}: target.path {name!r} has no architecture in gpu_trainer.TARGETS "
                         f"(known: {', '.join(TARGETS)})")
    return work / "targets" / name.replace("/", "--"), TARGETS[name]


def prepare(work: Path, config_path: Path, conversations: int, prompts: int) -> None:
    from gpu_trainer import build_target

    work.mkdir(parents=True, exist_ok=True)
    folder, architecture = target_folder(work, config_path)
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        build_target(folder, architecture, "cuda:0")
    write_chat_data(work, conversations, prompts)
    report({"part": "prepare", "work": str(work), "target": str(folder), "conversations": conversations,
            "prompts": prompts})


def write_chat_data(work: Path, conversations: int, prompts: int) -> None:
    """work/chat.jsonl and work/prompts.jsonl: chat rows of the target's word-level vocabulary."""
    from gpu_trainer import VOCAB_WORDS

    work.mkdir(parents=True, exist_ok=True)
    generator = random.Random(0)
    words = lambda n: " ".join(f"w{generator.randrange(VOCAB_WORDS)}" for _ in range(n))  # noqa: E731
    with open(work / "chat.jsonl", "w") as f:  # one word is one token; ChatML adds about 8
        for _ in range(conversations):
            total = generator.randrange(500, 3000)
            prompt = generator.randrange(50, min(600, total - 100))
            f.write(json.dumps({"messages": [{"role": "user", "content": words(prompt)},
                                             {"role": "assistant", "content": words(total - prompt - 8)}]}) + "\n")
    with open(work / "prompts.jsonl", "w") as f:
        for _ in range(prompts):
            f.write(json.dumps({"messages": [{"role": "user", "content": words(generator.randrange(50, 400))}]}) + "\n")


def step_memory(shapes: list[tuple[int, int]], iters: int) -> None:
    import torch
    import torch.nn.functional as F

    from dflash_train.model.objective import DraftObjective
    from gpu_threads import QWEN3_8B, Frozen, make_batches, make_objective

    class MaterializedLoss(DraftObjective):
        """The loss as it was before model/head_loss.py: every logit of the micro-batch at once."""

        def forward(self, inputs):
            hidden = self.block_hidden(inputs)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)
            logits = logits.float()
            token_loss = F.cross_entropy(logits.flatten(0, 2), inputs.labels.flatten(), reduction="none")
            weights = inputs.weights.flatten()
            loss = (token_loss * weights).sum() / weights.sum().clamp_min(1e-6)
            counted = inputs.weights > 0
            correct = ((logits.argmax(-1) == inputs.labels) & counted).sum(dim=(0, 1))
            return loss, correct, counted.sum(dim=(0, 1))

    device = "cuda:0"
    frozen = Frozen(QWEN3_8B, device)
    for rows, length in shapes:
        shape = QWEN3_8B.__class__(**{**QWEN3_8B.__dict__, "seq_len": length})
        rows_batches = make_batches(shape, rows, seed=rows, device=device)
        inputs = type(rows_batches[0])(*(torch.cat([getattr(b, f) for b in rows_batches])
                                         for f in ("input_ids", "features", "anchors", "anchor_valid", "labels",
                                                   "weights")))
        for name in ("materialized", "chunked"):
            objective = make_objective(shape, frozen, device)
            if name == "materialized":
                objective.__class__ = MaterializedLoss
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
            record = {"part": "step-memory", "loss": name, "rows": rows, "length": length,
                      "block_tokens": rows * shape.anchors * shape.block}
            try:
                times = []
                for _ in range(iters):
                    objective.drafter.zero_grad(set_to_none=True)
                    start = time.perf_counter()
                    loss, _, _ = objective(inputs)
                    loss.backward()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                record.update(peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                              above_weights_gib=round((torch.cuda.max_memory_allocated(device) - resident) / 2**30, 2),
                              ms=round(1000 * statistics.median(times[1:] or times), 1), loss_value=round(loss.item(), 4))
            except torch.OutOfMemoryError as exc:
                record.update(result="OOM", error=str(exc).split(". ")[0:2])
            report(record)
            # The last loss's graph holds the drafter's parameters: let both go, so the next
            # measurement starts from its own weights alone.
            loss = None
            del objective
            torch.cuda.empty_cache()


def _set(config: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for part in path:
        config = config.setdefault(part, {})
    config[last] = value


def run_job(config_path: Path, work: Path, overrides: dict, name: str, timeout_s: float) -> Path:
    """The trainer on the config with `overrides`, in work/runs/NAME; returns the run dir."""
    config = yaml.safe_load(config_path.read_text())
    for key, value in overrides.items():
        _set(config, key, value)
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO / "remote"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "DFLASH_WORKSPACE": str(work / "workspace"), "DFLASH_RUN_ID": name, "DFLASH_RELEASE_DIR": str(REPO)}
    from gpu_trainer import GpuSampler

    sampler = GpuSampler()  # nvidia-smi's memory.used: what the process holds, pools and cache included
    started = time.time()
    with open(run_dir / "train.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_train", "--config", str(run_dir / "config.yaml"),
                                 "--run-dir", str(run_dir)], cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    ended = time.time()
    sampler.stop()
    (run_dir / "result.json").write_text(json.dumps({"exit_code": code, "started": started, "ended": ended,
                                                     "nvidia_smi": sampler.between(started, ended)}))
    return run_dir


def summarize(run_dir: Path, config_path: Path) -> dict:
    result = json.loads((run_dir / "result.json").read_text())
    events = []
    if (run_dir / "events.jsonl").exists():
        for line in (run_dir / "events.jsonl").read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    steps = [e for e in events if e.get("type") == "step"]
    record = {"part": "train" if steps else "job", "config": str(config_path),
              "run": run_dir.name, "exit_code": result["exit_code"], "wall_s": round(result["ended"] - result["started"], 1),
              "steps": len(steps), "nvidia_smi": result["nvidia_smi"]}
    if steps:
        record["launch_to_first_step_s"] = round(steps[0]["ts"] - result["started"], 1) if "ts" in steps[0] else None
        later = steps[2:] or steps
        record["samples_per_s"] = round(statistics.median(e["samples_per_s"] for e in later), 3)
        record["tokens_per_s"] = round(statistics.median(e["tokens_per_s"] for e in later))
        peaks = [p for e in steps for p in (e.get("peak_memory_bytes") or []) if p]
        record["peak_memory_gib"] = round(max(peaks) / 2**30, 2) if peaks else None
        record["loss_first_last"] = [steps[0]["loss"], steps[-1]["loss"]]
    for kind in ("eval", "export", "ready"):
        found = [e for e in events if e.get("type") == kind]
        if found:
            record[kind] = found if kind == "ready" else found[-1]
    errors = run_dir / "errors.jsonl"
    if errors.exists() and errors.read_text().strip():
        record["error"] = json.loads(errors.read_text().splitlines()[0]).get("message", "")[:2000]
    record["export_files"] = sorted(p.name for p in (run_dir / "export").iterdir()) if (run_dir / "export").exists() else []
    log = (run_dir / "train.log").read_text(errors="replace").splitlines()
    record["log_tail"] = log[-25:]
    record["built"] = [line.split("] ", 1)[-1][:400] for line in log if "train step built" in line or "shape(s)" in line]
    return record


def prepared(work: Path, config_path: Path) -> Path:
    folder, _ = target_folder(work, config_path)
    if not (folder / "config.json").exists():
        raise SystemExit(f"{folder}: no target prepared for {config_path}: run `fit_h200.py prepare {config_path} "
                         f"--work {work}` first")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["prepare", "step-memory", "train", "evaluate"])
    parser.add_argument("config", nargs="?", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fit"))
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--shapes", default="1x3072,2x3072,4x3072,4x768,16x768")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--drafter", type=Path)
    parser.add_argument("--name")
    parser.add_argument("--timeout-s", type=float, default=420)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--keep-paths", action="store_true", help="leave the config's paths (a tiny config, to check this script)")
    args = parser.parse_args()
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.part == "prepare":
        prepare(args.work, args.config or REPO / "configs" / "train" / "qwen3-8b.yaml", args.conversations, args.prompts)
    elif args.part == "step-memory":
        step_memory([tuple(map(int, s.split("x"))) for s in args.shapes.split(",")], args.iters)
    elif args.part == "train":
        paths = {} if args.keep_paths else {"target.path": str(prepared(args.work, args.config)),
                                            "data.train": str(args.work / "chat.jsonl"),
                                            "data.eval": str(args.work / "prompts.jsonl")}
        overrides = {**paths, "optim.max_steps": args.steps, "eval.num_prompts": 2, "eval.max_new_tokens": 32, **extra}
        run_dir = run_job(args.config, args.work, overrides, args.name or args.config.stem, args.timeout_s)
        report(summarize(run_dir, args.config))
    else:
        overrides = {"target.path": str(prepared(args.work, args.config)), "evaluate.drafter": str(args.drafter),
                     "evaluate.prompts": str(args.work / "prompts.jsonl"), "evaluate.num_prompts": 4,
                     "evaluate.max_new_tokens": 64, **extra}
        run_dir = run_job(args.config, args.work, overrides, args.name or args.config.stem, args.timeout_s)
        record = summarize(run_dir, args.config)
        if (run_dir / "eval.json").exists():
            record["eval_json"] = json.loads((run_dir / "eval.json").read_text())
        report(record)


if __name__ == "__main__":
    main()
