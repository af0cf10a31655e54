"""Where an eager decode step's device time goes at the Qwen3-8B shape: kernels by name.

    PYTHONPATH=remote python3 bench/eval_step_profile.py

The models of bench/eval_speed.py (a random bf16 Qwen3-8B-architecture target, a random
5-layer drafter at the 8B drafter shape) on cuda:0, a 512-token prompt; after a short
decode, torch.profiler records one eager verify step, one target-alone step and one
draft step (the fast decode's `_verify`, `_alone`, `_draft`, neither graphed nor
compiled). Printed per step: the number of kernels, their summed device time, and the
14 kernel names that take the most of it (count, microseconds). $OUT/eval_step_profile.json
holds the same.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_threads import QWEN3_8B, write_report  # noqa: E402
from gpu_trainer import QWEN3_8B_TARGET, VOCAB_WORDS, make_target  # noqa: E402


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_hf_config
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.target import FeatureTap

    device = "cuda:0"
    target, tokenizer = make_target(QWEN3_8B_TARGET, device)
    target.requires_grad_(False).eval()
    spec = DrafterConfig(num_layers=QWEN3_8B.layers, block_size=QWEN3_8B.block,
                         num_target_features=QWEN3_8B.feature_layers)
    layer_ids = default_target_layer_ids(QWEN3_8B_TARGET["num_hidden_layers"], spec.num_target_features)
    drafter = DFlashDrafter(drafter_hf_config(target.config, spec, layer_ids, mask_token_id=tokenizer.pad_token_id))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    drafter = drafter.to(device=device, dtype=torch.bfloat16).eval()
    tap = FeatureTap(target, layer_ids)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    generator = random.Random(0)
    words = " ".join(f"w{generator.randrange(VOCAB_WORDS)}" for _ in range(600))
    prompt = tokenizer(words, add_special_tokens=False)["input_ids"][:512]
    decoder = FastDecoder(drafter, tap, embed, head, 512 + 128 + spec.block_size, cuda_graphs=False)
    decoder.decode(prompt, 32, set())  # the state of a decode in progress
    report = {}
    for name, step in (("verify", decoder._verify), ("alone", decoder._alone), ("draft", decoder._draft)):
        step = torch.inference_mode()(step)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as recorded:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in recorded.events() if e.device_type.name == "CUDA"]
        by_name: dict[str, list] = {}
        for kernel in kernels:
            entry = by_name.setdefault(kernel.name[:60], [0, 0.0])
            entry[0] += 1
            entry[1] += kernel.device_time_total
        total = sum(us for _, us in by_name.values())
        top = sorted(by_name.items(), key=lambda item: -item[1][1])[:14]
        report[name] = {"kernels": len(kernels), "kernel_us": round(total),
                        "top": [(kernel, count, round(us)) for kernel, (count, us) in top]}
        print(f"{name}: {len(kernels)} kernels, {total:.0f} us of kernel time", flush=True)
        for kernel, (count, us) in top:
            print(f"  {count:5d} {us:9.0f} us  {kernel}")
    write_report(report, "eval_step_profile.json")


if __name__ == "__main__":
    main()
