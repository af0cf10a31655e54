"""The GPU memory estimate (dflash_train.memory.plan): parameter counts against what
transformers and the trainer build, the micro-batch shapes against the CUDA-graph
buckets, and where each term lands for the shipped configs. The end to end fit check
through the CLI is in test_fit_check.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

import dflash_schema
from dflash_train.compiling import cudagraphs
from dflash_train.data import tiny
from dflash_train.memory import plan as memory_plan
from dflash_train.config import DataConfig, DrafterConfig, SyntheticDataSpec, TinyTargetSpec, load_job_config
from dflash_train.memory.plan import (BF16, FP32, GIB, MemoryPlan, Shape, TargetShape, drafter_parameters, estimate,
                                      micro_batch_shapes, usable_bytes)
from dflash_train.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_hf_config

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs" / "train"
# Qwen/Qwen3-8B's config.json, the fields the plan reads and a few it does not.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000}
H200_MIB = 143771
# The one-GPU recipe as configs/train/qwen3-8b.yaml first had it: the target and two
# drafters on cuda:0, up to 4 sequences of 3072 tokens a micro-batch, padded to 64. Its
# short rows make micro-batches of many rows, each with up to 512 blocks: far too much.
ONE_GPU = """
target: {path: Qwen/Qwen3-8B, dtype: bfloat16}
data: {train: /workspace/data/train.jsonl, eval: /workspace/data/eval.jsonl, max_length: 3072, token_budget: 12288,
       pad_multiple: 64}
optim: {accumulate: 4}
devices: {target: [cuda:0], drafters: [cuda:0, cuda:0]}
compile: default
eval: {every: 500, num_prompts: 16, max_new_tokens: 256}
"""


def write_model_folder(folder: Path, fields: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(fields, indent=2))
    return folder


def qwen3_8b(tmp_path: Path) -> TargetShape:
    folder = write_model_folder(tmp_path / "Qwen3-8B", QWEN3_8B)
    return TargetShape.from_config_json(json.loads((folder / "config.json").read_text()))


def one_gpu_config(folder: Path) -> Path:
    path = folder / "one-gpu.yaml"
    path.write_text(ONE_GPU)
    return path


def plan_of(config: str | Path, target: TargetShape, *overrides: str, **layout) -> MemoryPlan:
    """The plan of a shipped config (by name) or of the config file `config`."""
    path = CONFIGS / config if isinstance(config, str) else config
    return estimate(load_job_config(path, tuple(map(dflash_schema.parse_override, overrides))), target, **layout)


def term(plan: MemoryPlan, device: str, name: str):
    (found,) = [t for d in plan.devices if d.device == device for t in d.terms if t.name.startswith(name)]
    return found


def names(plan: MemoryPlan, device: str) -> list[str]:
    (found,) = [d for d in plan.devices if d.device == device]
    return [t.name for t in found.terms]


# --- parameters --------------------------------------------------------------------------

def test_qwen3_8b_counts_its_published_parameters(tmp_path):
    target = qwen3_8b(tmp_path)
    assert target.parameters() == 8_190_735_360  # Qwen3-8B: 8.2B, 6.95B of them in its layers
    # The recipe's drafter: 5 layers at the target's widths and fc from 5 feature layers;
    # its gradients are the 3.91 GiB bench/RESULTS-h200.md exchanges.
    assert drafter_parameters(target, DrafterConfig()) == 1_048_626_432


@pytest.mark.parametrize("config", [
    Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, head_dim=24, tie_word_embeddings=True, attention_bias=True),
    Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, tie_word_embeddings=False),
], ids=["qwen3", "qwen3-tied-biased", "qwen3-moe"])
def test_target_parameters_are_what_transformers_builds(tmp_path, config):
    config.save_pretrained(tmp_path)  # the config.json a model folder has
    fields = json.loads((tmp_path / "config.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert TargetShape.from_config_json(fields).parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", [
    DrafterConfig(num_layers=2),
    DrafterConfig(num_layers=1, num_target_features=3, intermediate_size=40),
    DrafterConfig(num_layers=3, target_layer_ids=(0, 2, 3, 4)),
])
def test_drafter_parameters_are_what_the_trainer_builds(spec):
    target = Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=8,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    layer_ids = spec.target_layer_ids or default_target_layer_ids(8, spec.num_target_features or spec.num_layers)
    drafter = DFlashDrafter(drafter_hf_config(target, spec, tuple(layer_ids), mask_token_id=5))
    shape = TargetShape.from_config_json(target.to_dict())
    assert drafter_parameters(shape, spec) == sum(p.numel() for p in drafter.parameters())


def test_the_tiny_target_is_the_one_tiny_builds():
    spec = TinyTargetSpec(vocab_words=50, hidden_size=32, intermediate_size=48, num_layers=3)
    tokenizer = tiny._build_tokenizer(spec)
    model = tiny._build_model(spec, len(tokenizer), tokenizer)
    shape = TargetShape.from_tiny(spec)
    assert shape.vocab_size == model.config.vocab_size
    assert shape.parameters() == sum(p.numel() for p in model.parameters())


# --- micro-batches -----------------------------------------------------------------------

@pytest.mark.parametrize("data, drafter", [
    (load_job_config(CONFIGS / "qwen3-8b-4gpu.yaml").data, DrafterConfig()),
    (DataConfig(train="t.jsonl", max_length=3072, token_budget=12288, pad_multiple=768), DrafterConfig()),
    (DataConfig(train="t.jsonl", max_length=3072, token_budget=12288, block_token_budget=16384, pad_multiple=768),
     DrafterConfig()),
    (DataConfig(synthetic=SyntheticDataSpec(), max_length=128, token_budget=1000, pad_multiple=40),
     DrafterConfig(num_anchors=32)),
], ids=["qwen3-8b-4gpu", "four-lengths", "block-token-budget", "tiny"])
def test_micro_batch_shapes_are_the_cudagraph_buckets(data, drafter):
    buckets = cudagraphs.bucket_shapes(data, drafter)
    assert micro_batch_shapes(data, drafter) == tuple(Shape(b.rows, b.length, b.blocks) for b in buckets)


def test_the_loss_chunk_is_the_trainers():
    from dflash_train.model import head_loss

    assert memory_plan.LOSS_CHUNK_BYTES == head_loss.LOSS_CHUNK_BYTES
    for vocab in (151936, 208, 32000):
        assert memory_plan.loss_chunk_rows(vocab) == head_loss.chunk_rows(vocab)


# --- the plan ----------------------------------------------------------------------------

def test_four_gpus_target_on_one_drafters_on_the_others(tmp_path):
    target = qwen3_8b(tmp_path)
    plan = plan_of("qwen3-8b-4gpu.yaml", target)
    params = drafter_parameters(target, DrafterConfig())
    assert [(d.device, d.roles) for d in plan.devices] == [
        ("cuda:0", ("target-0", "eval")), ("cuda:1", ("drafter-0",)), ("cuda:2", ("drafter-1",)),
        ("cuda:3", ("drafter-2",))]
    assert plan.worst == Shape(1, 3072, 512)  # pad_multiple 3072: the one bucket
    assert term(plan, "cuda:0", "target weights").bytes == 8_190_735_360 * BF16
    assert term(plan, "cuda:0", "evaluator drafter").bytes == params * FP32
    assert term(plan, "cuda:0", "evaluator LM head").bytes == 151936 * 4096 * FP32  # the bf16 head cast to fp32
    assert not [n for n in names(plan, "cuda:0") if n.startswith(("drafter", "gradients", "CUDA graph pool"))]
    for device in ("cuda:1", "cuda:2", "cuda:3"):
        assert term(plan, device, "drafter weights").bytes == params * FP32
        assert term(plan, device, "gradients").bytes == 2 * params * FP32  # cudagraphs: graph's + handed out
        assert term(plan, device, "optimizer's gradient copy").bytes == params * FP32
        assert term(plan, device, "AdamW moments").bytes == 2 * params * FP32
        assert term(plan, device, "gradient exchange").bytes == 2 * params * FP32  # 3 replicas
        assert term(plan, device, "target embedding + LM head copy").bytes == 2 * 151936 * 4096 * BF16
        assert term(plan, device, "CUDA graph pool, reserved: 1x3072 (512 blocks)").count == 1
    assert all(d.total <= usable_bytes(H200_MIB) for d in plan.devices)
    assert all(d.total == sum(t.bytes for t in d.terms + d.overhead) for d in plan.devices)


def test_one_gpu_sums_the_target_and_both_drafters_and_does_not_fit_an_h200(tmp_path):
    target = qwen3_8b(tmp_path)
    config = one_gpu_config(tmp_path)
    plan = plan_of(config, target)
    (device,) = plan.devices
    assert device.roles == ("target-0", "eval", "drafter-0", "drafter-1")
    assert term(plan, "cuda:0", "drafter weights").count == 2
    assert term(plan, "cuda:0", "gradients").bytes == 2 * drafter_parameters(target, DrafterConfig()) * FP32
    assert not [n for n in names(plan, "cuda:0") if n.startswith("target embedding")]  # the target's own tensors
    # pad_multiple 64 with token_budget 12288: its largest micro-batch is one of many rows.
    lengths = load_job_config(config).data.padded_lengths()
    assert plan.worst.length in lengths and plan.worst.rows == 12288 // plan.worst.length > 4
    assert device.largest(1)[0].name == f"activations: {plan.worst}"
    assert device.total > usable_bytes(H200_MIB)
    # The knobs the refusal names do change it.
    for knob in (["data.block_token_budget=16384"], ["data.token_budget=3072", "data.pad_multiple=3072"]):
        smaller = plan_of(config, target, *knob)
        assert smaller.worst.rows * smaller.worst.blocks <= 2 * 512 and smaller.devices[0].total < device.total / 2


def test_compile_off_keeps_no_gradient_copy_and_one_replica_exchanges_nothing(tmp_path):
    target = qwen3_8b(tmp_path)
    params = drafter_parameters(target, DrafterConfig())
    plan = plan_of("qwen3-8b-4gpu.yaml", target, "compile=off", "data.pad_multiple=64", "devices.drafters=[cuda:1]")
    assert term(plan, "cuda:1", "gradients").bytes == params * FP32
    assert not [n for n in names(plan, "cuda:1") if n.startswith(("optimizer's", "gradient exchange"))]
    assert term(plan, "cuda:1", "activations").name == f"activations: {plan.worst}"
    # The same drafter with a peer on another host exchanges its gradients again.
    two_hosts = plan_of("qwen3-8b-4gpu.yaml", target, "compile=off", "data.pad_multiple=64",
                        "devices.drafters=[cuda:1]", world_size=2, rank=1)
    assert term(two_hosts, "cuda:1", "gradient exchange").bytes == 2 * params * FP32
    assert [d.roles for d in two_hosts.devices] == [("target-0",), ("drafter-0",)]  # rank 1 does not evaluate


def test_no_evaluator_without_eval_prompts(tmp_path):
    target = qwen3_8b(tmp_path)
    for overrides in (["eval.num_prompts=0"], ["data.eval=null"]):
        plan = plan_of("qwen3-8b-4gpu.yaml", target, *overrides)
        assert plan.devices[0].roles == ("target-0",)
        assert not [n for n in names(plan, "cuda:0") if n.startswith("evaluator")]


def test_the_tiny_gpu_config_fits_an_h200_with_room_to_spare():
    config = load_job_config(CONFIGS / "tiny-gpu.yaml")
    (device,) = estimate(config, TargetShape.from_tiny(config.target.tiny)).devices
    assert device.roles == ("target-0", "eval", "drafter-0", "drafter-1")
    assert device.total < 2 * GIB  # the CUDA context is most of it


def test_cpu_only_configs_and_other_jobs_are_not_planned():
    config = load_job_config(CONFIGS / "tiny-cpu.yaml")
    with pytest.raises(ValueError, match="CPU only"):
        estimate(config, TargetShape.from_tiny(config.target.tiny))
    regenerate = load_job_config(CONFIGS / "regen-tiny-cpu.yaml")  # on the CPU
    with pytest.raises(ValueError, match="CPU only"):
        estimate(regenerate, TargetShape.from_tiny(regenerate.target.tiny))
    evaluate = load_job_config(CONFIGS / "evaluate-qwen3-8b.yaml")
    with pytest.raises(ValueError, match="job: evaluate: only training and regenerate runs are planned"):
        estimate(evaluate, TargetShape.from_tiny(regenerate.target.tiny))


def test_a_config_json_without_the_widths_is_named():
    with pytest.raises(ValueError, match="config.json has no hidden_size, num_hidden_layers"):
        TargetShape.from_config_json({"vocab_size": 10, "intermediate_size": 8, "num_attention_heads": 2})


def test_memory_plan_does_not_import_torch():
    code = ("import sys; sys.path.insert(0, 'remote'); import dflash_train.config as c, dflash_train.memory.plan as m; "
            "config = c.load_job_config('configs/train/tiny-gpu.yaml'); "
            "m.estimate(config, m.TargetShape.from_tiny(config.target.tiny)); "
            "print(sorted(n for n in ('torch', 'transformers') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
