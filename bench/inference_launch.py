"""The recipe's two inference jobs at the Qwen3-8B shape, launched as a user launches them.

    PYTHONPATH=remote:bench python3 bench/inference_launch.py --work /tmp/inf [--batch-sizes 64,256]

On a CUDA host with no network: fit_h200.py's random-weight Qwen3-8B-architecture target
(bf16, saved with its word-level tokenizer and ChatML template) and 256 chat prompts of
50-400 words, and a random drafter at the 8B drafter shape exported in bf16 (the export
format). Then, each as `dflash launch local --config C --follow` with --set for the paths
(bench/cli_startup.py's launch):

* configs/train/regen-qwen3-8b.yaml on one GPU, max_new_tokens 512 (a random target never
  ends early), per --batch-sizes: generated tokens/s as the job reports it (its last
  progress event), and the whole job's wall time;
* configs/train/evaluate-qwen3-8b.yaml: 4 prompts x 256 new tokens; eval.json's figures, and
  ms per verify step (a random drafter's drafts are rejected, so a step gains one token:
  1000 / tokens_per_s) and the target alone's ms per token.

Every row is printed as JSON and appended to $OUT/inference_launch.jsonl when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_startup import launch  # noqa: E402
from fit_h200 import prepare, target_folder  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REGEN = REPO / "configs" / "train" / "regen-qwen3-8b.yaml"
EVALUATE = REPO / "configs" / "train" / "evaluate-qwen3-8b.yaml"


def report(record: dict) -> None:
    print(json.dumps(record), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "inference_launch.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def random_drafter(folder: Path, target: Path) -> None:
    """A random drafter at the 8B drafter shape for `target`, exported in bf16."""
    import torch
    from transformers import AutoConfig

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_hf_config, export_drafter

    config = AutoConfig.from_pretrained(str(target))
    spec = DrafterConfig(num_layers=5, block_size=16, num_target_features=5)
    layers = default_target_layer_ids(config.num_hidden_layers, 5)
    drafter = DFlashDrafter(drafter_hf_config(config, spec, layers, mask_token_id=config.pad_token_id or 0))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    export_drafter(drafter, folder, dtype=torch.bfloat16)


def events(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/inf"))
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--skip", default="", help="regenerate and/or evaluate, comma-separated")
    parser.add_argument("--timeout-s", type=float, default=400)
    args = parser.parse_args()
    work, workspace = args.work, args.work / "workspace"
    prepare(work, REGEN, conversations=4, prompts=256)
    target, _ = target_folder(work, REGEN)
    drafter = work / "drafter"
    if not (drafter / "model.safetensors").exists():
        random_drafter(drafter, target)
    if "regenerate" not in args.skip:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            output = work / f"answers-{batch}.jsonl"
            output.unlink(missing_ok=True)
            sets = [f"target.path={target}", f"regenerate.prompts={work / 'prompts.jsonl'}",
                    f"regenerate.output={output}", f"regenerate.batch_size={batch}",
                    f"regenerate.max_new_tokens={args.max_new_tokens}", "devices.target=[cuda:0]"]
            row = launch(work, workspace, REGEN, sets, args.timeout_s, None)
            run_dir = workspace / "runs" / str(row.get("run_id"))
            progress = [e for e in events(run_dir) if e.get("type") == "progress"] if run_dir.exists() else []
            row = {"job": "regenerate", "batch_size": batch, "exit_code": row["exit_code"], "wall_s": row["wall_s"],
                   **({k: progress[-1][k] for k in ("answered", "total", "new_tokens", "tokens_per_s")} if progress else
                      {"stderr_tail": row.get("stderr_tail")})}
            report(row)
    if "evaluate" not in args.skip:
        row = launch(work, workspace, EVALUATE, [f"target.path={target}", f"evaluate.drafter={drafter}",
                                                 f"evaluate.prompts={work / 'prompts.jsonl'}", "evaluate.num_prompts=4",
                                                 "evaluate.max_new_tokens=256"], args.timeout_s, None)
        eval_json = workspace / "runs" / str(row.get("run_id")) / "eval.json"
        if eval_json.exists():
            result = json.loads(eval_json.read_text())
            report({"job": "evaluate", "exit_code": row["exit_code"], "wall_s": row["wall_s"],
                    "ms_per_verify_step": round(1000 / result["tokens_per_s"], 3),
                    "target_ms_per_token": round(1000 / result["target_tokens_per_s"], 3),
                    **{k: result[k] for k in ("acceptance_length", "tokens_per_s", "target_tokens_per_s", "speedup",
                                              "verify_steps", "compiled", "cuda_graphs")}})
        else:
            report({"job": "evaluate", **row})


if __name__ == "__main__":
    main()
