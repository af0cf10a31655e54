"""Unit tests of the trainer's parts, in process, on CPU with tiny random models."""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path

import pytest
import yaml

import torch
from dflash_schema import SchemaError

from dflash_train.checkpoint import folders as ckpt
from dflash_train.checkpoint.state import TrainingState
from dflash_train.config import DrafterConfig, SyntheticDataSpec, TinyTargetSpec, load_job_config, resolved_yaml
from dflash_train.data.chat import tokenize_chat
from dflash_train.model.drafter import (DFlashDrafter, default_target_layer_ids, drafter_hf_config, export_drafter,
                                        fresh_weights, load_drafter)
from dflash_train.model.modeling_dflash import dense_attention
from dflash_train.model.objective import (block_labels, dense_block_mask, flex_block_mask, position_weights,
                                          sample_anchors)
from dflash_train.runlog import LineWriter, error_record

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)
TINY_CONFIG = REPO / "configs" / "train" / "tiny-cpu.yaml"
TINY_RESOLVED = resolved_yaml(load_job_config(TINY_CONFIG))


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return path


BASE = """
target: {tiny: {}}
data: {synthetic: {}, max_length: 128, token_budget: 512}
devices: {target: [cpu], drafters: [cpu, cpu]}
"""


# --- config -------------------------------------------------------------------------

def test_tiny_config_loads_and_names_its_resources():
    config = load_job_config(TINY_CONFIG)
    assert config.resources() == ("cpu",)
    assert config.compile == "off"  # YAML reads a bare `off` as false
    assert len(config.devices.drafters) == 2
    assert config.stall_after == 300.0


@pytest.mark.parametrize("name, gpus", [("tiny-gpu.yaml", 1), ("qwen3-8b.yaml", 1), ("qwen3-8b-4gpu.yaml", 4)])
def test_shipped_gpu_configs_load(name, gpus):
    config = load_job_config(TINY_CONFIG.parent / name)
    assert config.resources() == tuple(f"gpu{i}" for i in range(gpus)) and config.stall_after == 300.0
    if config.compile == "cudagraphs":
        from dflash_train.compiling.policy import plan_compile

        plan = plan_compile(config)
        # one GPU: the drafters share it with the target; more: a GPU each
        assert len(plan.buckets) <= 4 and plan.drafters_share_a_device == (gpus == 1) and config.uses_flex


def test_config_module_does_not_import_torch():
    code = ("import sys; sys.path.insert(0, 'remote'); import dflash_train.config as c; "
            "c.load_job_config('configs/train/tiny-cpu.yaml'); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_trainer_imports_nothing_of_the_agent():
    # Helpers and file names both halves need are in dflash_files: the agent is not the trainer's library.
    trainer = REPO / "remote" / "dflash_train"
    imports = {(path.relative_to(trainer).as_posix(), alias.name if isinstance(node, ast.Import) else node.module)
               for path in sorted(trainer.rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
               for alias in node.names}
    assert {name for name, _ in imports} and [i for i in imports if i[1].split(".")[0] == "dflash_agent"] == []
    assert ("checkpoint/folders.py", "dflash_files.diskspace") in imports  # the scan sees absolute imports


def test_unknown_fault_thread_and_bad_keys_are_refused(tmp_path):
    with pytest.raises(SchemaError, match="unknown thread 'drafter-2'"):
        load_job_config(write_config(tmp_path, BASE + "faults: [{thread: drafter-2, at: startup, kind: raise}]\n"))
    with pytest.raises(SchemaError, match=r"optim\.lrr: unknown key"):
        load_job_config(write_config(tmp_path, BASE + "optim: {lrr: 1}\n"))
    with pytest.raises(SchemaError, match="step:N"):
        load_job_config(write_config(tmp_path, BASE + "faults: [{thread: prefetch, at: soon, kind: hang}]\n"))


@pytest.mark.parametrize("section, message", [
    ({"optim": {"lr": -1}}, "optim: lr and epochs must be positive"),
    ({"drafter": {"block_size": 1}}, "drafter: block_size must be at least 2"),
    ({"target": {"tiny": {"num_heads": 3}}}, "target.tiny: num_heads must be a multiple of num_kv_heads"),
    ({"faults": [{"thread": "prefetch", "at": "step:0", "kind": "hang"}]}, "faults[0]: at: steps count from 1"),
    ({"devices": {"target": ["cpu"], "drafters": ["gpu"]}}, "devices: drafters: 'gpu' is not 'cpu'"),
])
def test_a_section_problem_names_its_key_path_once(tmp_path, section, message):
    config = {**yaml.safe_load(BASE), **section}
    path = write_config(tmp_path, yaml.safe_dump(config))
    with pytest.raises(SchemaError) as info:
        load_job_config(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_a_tiny_target_may_train_on_a_data_file(tmp_path):
    """What job: regenerate wrote with the tiny target is a training file for it."""
    path = write_config(tmp_path, "target: {tiny: {}}\ndata: {train: chats.jsonl}\n")
    config = load_job_config(path)
    assert config.data.train == "chats.jsonl" and config.data.synthetic is None


def test_a_training_config_key_given_twice_is_refused(tmp_path):
    path = write_config(tmp_path, BASE + "optim:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 1.0e-2\n")
    with pytest.raises(SchemaError, match=r"line 8: key 'lr' given twice \(first at line 6\)"):
        load_job_config(path)


@pytest.mark.parametrize("thread, at", [("target-0", "step:2"), ("prefetch", "step:2"), ("drafter-1", "startup")])
def test_nonfinite_fault_is_only_for_a_drafter_step(tmp_path, thread, at):
    fault = f"faults: [{{thread: {thread}, at: '{at}', kind: nonfinite}}]\n"
    with pytest.raises(SchemaError, match=rf"faults\[0\]: nonfinite poisons a drafter's step: thread drafter-N and "
                                          rf"at step:N, got {thread} at {at}"):
        load_job_config(write_config(tmp_path, BASE + fault))
    fault = "faults: [{thread: drafter-1, at: 'step:2', kind: nonfinite}]\n"
    config = load_job_config(write_config(tmp_path, BASE + fault))
    assert config.faults[0].kind == "nonfinite" and config.faults[0].step == 2


@pytest.mark.parametrize("fault, message", [
    ("{thread: drafter-1, at: startup, kind: hang, exception: torch.OutOfMemoryError}",
     "exception and message are for kind raise, not hang"),
    ("{thread: drafter-1, at: startup, kind: raise, exception: OutOfMemoryError}",
     "exception must name a class as module.Name"),
    ("{thread: drafter-1, at: startup, kind: raise, message: out of memory}", "message is the message of `exception`"),
])
def test_a_fault_naming_an_exception_is_checked(tmp_path, fault, message):
    with pytest.raises(SchemaError, match=rf"faults\[0\]: {re.escape(message)}"):
        load_job_config(write_config(tmp_path, BASE + f"faults: [{fault}]\n"))


def test_a_fault_raises_the_exception_it_names_deep_and_an_unknown_one_fails_the_start():
    from dflash_train.config import FaultSpec
    from dflash_train.faults import FaultInjector

    spec = FaultSpec(thread="drafter-1", at="step:2", kind="raise", depth=5, exception="torch.OutOfMemoryError",
                     message="CUDA out of memory. Tried to allocate 2.00 GiB.")
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 2\.00 GiB\.$") as info:
        FaultInjector((spec,)).fire("drafter-1", 2)
    assert info.value.__cause__ is None  # raised as torch would, not wrapped
    assert [f.name for f in traceback.extract_tb(info.value.__traceback__)].count("_descend_even") == 3
    bare = FaultSpec(thread="drafter-1", at="startup", kind="raise", exception="torch.distributed.DistNetworkError")
    with pytest.raises(torch.distributed.DistNetworkError):
        FaultInjector((bare,)).fire("drafter-1")
    for name, why in [("torch.NoSuchError", "cannot be found (AttributeError"), ("no_such_module.Error", "cannot be "
                      "found (ModuleNotFoundError"), ("torch.Tensor", "is not an exception class")]:
        with pytest.raises(ValueError, match=re.escape(f"faults: exception {name!r} {why}")):
            FaultInjector((FaultSpec(thread="drafter-1", at="startup", kind="raise", exception=name),))


def test_gpu_resources(tmp_path):
    config = load_job_config(write_config(tmp_path, BASE.replace(
        "devices: {target: [cpu], drafters: [cpu, cpu]}", "devices: {target: [cuda:0], drafters: [cuda:1, cuda]}")
        + "compile: cudagraphs\n"))
    assert config.resources() == ("gpu0", "gpu1")


# --- model and objective -------------------------------------------------------------

def test_default_target_layer_ids_match_the_paper():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(6, 2) == (1, 3)


def test_position_weights_decay():
    weights = position_weights(block_size=16, gamma=7.0)
    assert weights.shape == (15,)
    assert weights[0] == 1.0 and math.isclose(float(weights[7]), math.exp(-7 / 7), rel_tol=1e-6)


def test_anchors_are_response_tokens_with_context_and_a_label():
    turns = torch.tensor([-1] * 5 + [0] * 20 + [-1] * 3 + [1] * 4)  # (32,)
    for seed in range(5):
        anchors = sample_anchors(turns, 8, torch.Generator().manual_seed(seed))
        assert anchors.numel() == 8 and torch.all(anchors[1:] > anchors[:-1])
        assert bool((turns[anchors] >= 0).all()) and int(anchors.min()) >= 1 and int(anchors.max()) <= 30
    same = [sample_anchors(turns, 8, torch.Generator().manual_seed(3)).tolist() for _ in range(2)]
    assert same[0] == same[1]
    # every token of a turn but its last: positions 5..23 and 28..30
    assert sample_anchors(turns, 100, torch.Generator()).tolist() == list(range(5, 24)) + [28, 29, 30]


def test_block_labels_and_weights():
    input_ids = torch.arange(100, 110).unsqueeze(0)  # (1, 10)
    turn_ids = torch.tensor([[-1, -1, 0, 0, 0, 0, 0, -1, 1, 1]])
    anchors = torch.tensor([[2, 8, 0]])
    valid = torch.tensor([[True, True, False]])
    weights_k = position_weights(4, 7.0)
    labels, weights = block_labels(input_ids, turn_ids, anchors, valid, weights_k)
    assert labels[0, 0].tolist() == [103, 104, 105]
    assert weights[0, 0].tolist() == pytest.approx(weights_k.tolist())
    # anchor 8: position 9 learnable, position 10 and 11 are past the end
    assert labels[0, 1, :1].tolist() == [109]
    assert weights[0, 1].tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert weights[0, 2].sum() == 0  # an unused block teaches nothing


def test_dense_block_mask_rules():
    anchors, valid = torch.tensor([[3, 6]]), torch.tensor([[True, False]])
    mask = dense_block_mask(anchors, valid, context_len=8, block_size=2)[0, 0]  # (4, 8 + 4)
    # block 0 (queries 0-1): context 0..2 (strictly before anchor 3), its own block (kv 8, 9)
    assert mask[0].tolist() == [True] * 3 + [False] * 5 + [True, True, False, False]
    assert torch.equal(mask[0], mask[1])  # bidirectional inside the block
    # block 1 is unused: it sees only itself, never context (a fully masked row would be NaN)
    assert mask[2].tolist() == [False] * 8 + [False, False, True, True]


def small_drafter(block_size: int = 4, layers: int = 2) -> DFlashDrafter:
    from transformers import Qwen3Config

    target = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    spec = DrafterConfig(num_layers=layers, block_size=block_size, num_anchors=4)
    drafter = DFlashDrafter(drafter_hf_config(target, spec, (1, 3), mask_token_id=7))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    return drafter.eval()


def test_fresh_weights_are_the_seeds_alone_whatever_the_threads_and_start_as_a_qwen3_checkpoint():
    """A new run's drafter weights: decided by the seed (not by how many threads drew them,
    so every host starts alike), every weight of the drafter and nothing else, linears
    Normal(0, initializer_range) with zero biases and norms at one, and no module's draws
    repeated in another's (each has a generator of its own)."""
    config = small_drafter().config
    one, four = fresh_weights(config, 3, threads=1), fresh_weights(config, 3, threads=4)
    assert sorted(one) == sorted(DFlashDrafter(config).state_dict())
    assert all(torch.equal(one[name], four[name]) for name in one)
    other = fresh_weights(config, 4, threads=4)
    assert not any(torch.equal(one[name], other[name]) for name in one if name.endswith("proj.weight"))
    linears = {name: w for name, w in one.items() if w.dim() == 2}
    norms = {name: w for name, w in one.items() if w.dim() == 1}
    assert linears and norms and all(torch.equal(w, torch.ones_like(w)) for w in norms.values())
    drawn = torch.cat([w.flatten() for w in linears.values()])
    assert float(drawn.mean()) == pytest.approx(0.0, abs=3e-3)
    assert float(drawn.std()) == pytest.approx(config.initializer_range, rel=0.05)
    firsts = [tuple(w.flatten()[:4].tolist()) for w in linears.values()]
    assert len(set(firsts)) == len(firsts)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(one)  # strict: the weights a replica loads
    for seed in (-1, 2**70):  # any int the config takes
        assert sorted(fresh_weights(config, seed, threads=2)) == sorted(one)


def run_blocks(drafter, tokens, features, anchors, valid, mask=None):
    """The drafter's output for blocks at `anchors`; `mask`: the dense block mask unless given."""
    block_size = drafter.block_size
    embed = torch.nn.Embedding(50, 32)
    torch.manual_seed(1)
    torch.nn.init.normal_(embed.weight)
    block_ids = torch.full((1, anchors.shape[1], block_size), 7)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    positions = (anchors.unsqueeze(-1) + torch.arange(block_size)).view(1, -1)
    if mask is None:
        mask = dense_block_mask(anchors, valid, tokens.shape[1], block_size)
    with torch.no_grad():
        return drafter(embed(block_ids.view(1, -1)), features, torch.arange(tokens.shape[1]).unsqueeze(0),
                       positions, mask)


def test_a_block_sees_only_context_before_its_anchor_and_itself():
    drafter = small_drafter()
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 50, (1, 20), generator=generator)
    features = torch.randn(1, 20, 64, generator=generator)
    anchors, valid = torch.tensor([[5, 12]]), torch.tensor([[True, True]])
    base = run_blocks(drafter, tokens, features, anchors, valid)  # (1, 8, 32)
    later = features.clone()
    later[:, 5:] += 1.0  # context at/after block 0's anchor
    out = run_blocks(drafter, tokens, later, anchors, valid)
    assert torch.allclose(out[:, :4], base[:, :4], atol=1e-6)  # block 0 cannot see it
    assert not torch.allclose(out[:, 4:], base[:, 4:], atol=1e-4)  # block 1 (anchor 12) can
    other_block = tokens.clone()
    other_block[0, 12] = (other_block[0, 12] + 1) % 50  # block 1's anchor token
    out = run_blocks(drafter, other_block, features, anchors, valid)
    assert torch.allclose(out[:, :4], base[:, :4], atol=1e-6)  # blocks never see each other
    earlier = features.clone()
    earlier[:, 4] += 1.0  # the last context position block 0 may use
    out = run_blocks(drafter, tokens, earlier, anchors, valid)
    assert not torch.allclose(out[:, :4], base[:, :4], atol=1e-4)


def test_flex_mask_matches_dense_mask():
    drafter = small_drafter()
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 50, (1, 16), generator=generator)
    features = torch.randn(1, 16, 64, generator=generator)
    anchors, valid = torch.tensor([[3, 9, 0]]), torch.tensor([[True, True, False]])
    dense = run_blocks(drafter, tokens, features, anchors, valid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention runs unfused outside torch.compile: fine here
        flex = run_blocks(drafter, tokens, features, anchors, valid, flex_block_mask(anchors, valid, 16, 4))
    assert torch.allclose(dense[:, :8], flex[:, :8], atol=1e-5)  # the used blocks


def test_dense_attention_repeats_kv_heads_exactly_as_enable_gqa():
    """The drafter's masked SDPA repeats kv heads itself (so CUDA can use a fused kernel);
    outputs and gradients must be those of SDPA's own grouping, to fp32 rounding."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, context, blocks, block_size, dim = 2, 8, 2, 24, 3, 4, 16
    anchors = torch.tensor([[3, 9, 20], [5, 11, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])  # an unused block too
    mask = dense_block_mask(anchors, valid, context, block_size)  # (2, 1, 12, 36)
    q = torch.randn(batch, heads, blocks * block_size, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, context + blocks * block_size, dim, generator=generator) for _ in range(2))
    upstream = torch.randn(batch, heads, blocks * block_size, dim, generator=generator)  # d loss / d out

    def run(attend):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs)
        out.backward(upstream)
        return out.detach(), [t.grad for t in inputs]

    ours, our_grads = run(lambda q, k, v: dense_attention(q, k, v, mask))
    reference, reference_grads = run(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for got, expected in zip(our_grads, reference_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # The comparison can tell groupings apart: tiling the kv heads instead gives other outputs.
    tiled = torch.nn.functional.scaled_dot_product_attention(q, k.repeat(1, 4, 1, 1), v.repeat(1, 4, 1, 1),
                                                             attn_mask=mask)
    assert not torch.allclose(tiled, reference, atol=1e-3)


def test_export_loads_back_with_public_field_names(tmp_path):
    drafter = small_drafter(block_size=8, layers=1)
    export_drafter(drafter, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    assert config["dflash_config"]["mask_token_id"] == 7
    assert config["dflash_config"]["block_size"] == 8 and config["block_size"] == 8
    assert config["num_target_layers"] == 6 and config["num_hidden_layers"] == 1
    from safetensors import safe_open
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight"} <= names
    loaded = load_drafter(tmp_path / "export").eval()
    tokens = torch.randint(0, 50, (1, 12))
    features = torch.randn(1, 12, 64)
    anchors, valid = torch.tensor([[4]]), torch.tensor([[True]])
    assert torch.equal(run_blocks(drafter, tokens, features, anchors, valid),
                       run_blocks(loaded, tokens, features, anchors, valid))


# --- data ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_assets(workspace):
    from dflash_train.data.tiny import ensure_tiny_assets
    # test_trainer_runs.SMALL's spec: one cache entry serves both files
    return ensure_tiny_assets(TinyTargetSpec(), SyntheticDataSpec(num_train=64, num_eval=2), workspace / "cache")


def test_chat_loss_mask_covers_exactly_the_assistant_turns(tiny_assets):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_assets.target_dir))
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"},
                {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
    ids, turn_ids = tokenize_chat(tokenizer, messages, "test")
    learnt = [(tok, turn) for tok, turn in zip(tokenizer.convert_ids_to_tokens(ids), turn_ids) if turn >= 0]
    assert learnt == [("w3", 0), ("w4", 0), ("<|im_end|>", 0), ("w6", 1), ("<|im_end|>", 1)]


def test_speculative_decoding_is_lossless(tiny_assets):
    """Whatever the drafter proposes, the output is the target's own greedy decode."""
    from dflash_train.model.speculative import speculative_decode
    from dflash_train.model.target import FeatureTap, load_target
    target = load_target(str(tiny_assets.target_dir), "float32", "cpu")
    tap = FeatureTap(target, (1, 3))
    spec = DrafterConfig(num_layers=1, block_size=4, num_anchors=4)
    drafter = DFlashDrafter(drafter_hf_config(target.config, spec, (1, 3), mask_token_id=4)).eval()
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    prompt = [2, 6, 20, 30, 40, 3, 2, 7]
    decoded = speculative_decode(drafter, tap, embed, head, prompt, max_new_tokens=20, stop_ids=set())
    with torch.no_grad():
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert decoded.tokens == greedy
    assert sum(decoded.accepted) + 1 >= len(decoded.tokens) and all(a >= 1 for a in decoded.accepted)
    features = tap.features(torch.tensor([prompt]))  # stops after layer 3, same values as a full pass
    _, full = tap.logits_and_features(torch.tensor([prompt]))
    assert features.shape == (1, len(prompt), 128) and torch.allclose(features, full)


def test_an_eval_fault_fires_for_the_evaluation_of_its_step_a_resumed_runs_baseline_included(tiny_assets, tmp_path):
    """The eval thread and a sequential run's main thread both evaluate through
    Evaluator.measure: a fault at step:N fires for every evaluation of step N."""
    from dflash_train.config import EvalConfig, FaultSpec
    from dflash_train.faults import FaultInjector, InjectedFault
    from dflash_train.model.drafter import cpu_weights
    from dflash_train.runlog import ErrorLog, EventLog, ThreadNames
    from dflash_train.training.schedule import EvalRequest, Evaluator
    from dflash_train.model.target import FeatureTap, load_target
    from dflash_train.threads import StopLatch

    target = load_target(str(tiny_assets.target_dir), "float32", "cpu")
    spec = DrafterConfig(num_layers=1, block_size=4, num_anchors=4)
    drafter = DFlashDrafter(drafter_hf_config(target.config, spec, (1, 3), mask_token_id=4))
    events = EventLog(tmp_path / "events.jsonl")
    latch = StopLatch(ErrorLog(tmp_path / "errors.jsonl"), ThreadNames(tmp_path / "threads.json"))
    faults = FaultInjector((FaultSpec(thread="eval", at="step:4", kind="raise", depth=2),), attempt=0)
    evaluator = Evaluator(events, latch, faults, EvalConfig(max_new_tokens=4), drafter.config, FeatureTap(target, (1, 3)), "cpu",
                          target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                          [[2, 6, 20, 30, 40, 3, 2, 7]], set())
    weights = cpu_weights(drafter)
    evaluator.measure(EvalRequest(3, weights, baseline=True))  # a run resumed at step 3: its baseline
    for request in (EvalRequest(4, weights, baseline=True), EvalRequest(4, weights)):
        with pytest.raises(InjectedFault, match="eval at step 4"):
            evaluator.measure(request)
    measured = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["type"], e["step"], e["baseline"]) for e in measured] == [("eval", 3, True)]


def test_a_training_evaluation_reports_the_speedup_when_eval_speedup_asks(tiny_assets, tmp_path):
    """eval.speedup: the eval event adds both tokens/s and their ratio (valid against the
    event schema); without it, neither."""
    import dflash_contract.events

    from dflash_train.config import EvalConfig
    from dflash_train.faults import FaultInjector
    from dflash_train.model.drafter import cpu_weights
    from dflash_train.model.target import FeatureTap, load_target
    from dflash_train.runlog import ErrorLog, EventLog, ThreadNames
    from dflash_train.threads import StopLatch
    from dflash_train.training.schedule import EvalRequest, Evaluator

    target = load_target(str(tiny_assets.target_dir), "float32", "cpu")
    spec = DrafterConfig(num_layers=1, block_size=4, num_anchors=4)
    drafter = DFlashDrafter(drafter_hf_config(target.config, spec, (1, 3), mask_token_id=4))
    events = EventLog(tmp_path / "events.jsonl")
    latch = StopLatch(ErrorLog(tmp_path / "errors.jsonl"), ThreadNames(tmp_path / "threads.json"))
    for speedup in (True, False):
        evaluator = Evaluator(events, latch, FaultInjector((), attempt=0), EvalConfig(max_new_tokens=12, speedup=speedup),
                              drafter.config, FeatureTap(target, (1, 3)), "cpu", target.get_input_embeddings().weight,
                              target.get_output_embeddings().weight, [[2, 6, 20, 30, 40, 3, 2, 7], [2, 9]], set())
        evaluator.measure(EvalRequest(0, cpu_weights(drafter), baseline=True))
    timed, plain = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    for event in (timed, plain):
        dflash_contract.events.check(event)
        assert event["cuda_graphs"] is False
    assert timed["tokens_per_s"] > 0 and timed["target_tokens_per_s"] > 0
    assert timed["speedup"] == pytest.approx(timed["tokens_per_s"] / timed["target_tokens_per_s"], abs=0.01)
    assert not {"tokens_per_s", "target_tokens_per_s", "speedup"} & set(plain)
    assert {k: timed[k] for k in plain if k not in ("ts", "seconds")} == \
        {k: plain[k] for k in plain if k not in ("ts", "seconds")}


# --- logging, errors, checkpoints ----------------------------------------------------

# A logger made before the trainer's line writers, as torch's and transformers' imports make
# theirs in the warm interpreter before it forks a trainer; then one line logged by a thread.
LOGGER_BEFORE_WRITERS = """
import logging, sys, threading
early = logging.getLogger("made.by.an.import")
early.addHandler(logging.StreamHandler(sys.stderr))
early.propagate = False
from dflash_train.runlog import install_line_writers
writers = install_line_writers()
thread = threading.Thread(target=lambda: early.warning("from the drafter"), name="drafter-0")
thread.start()
thread.join()
writers[1].flush_all()
"""


def test_a_logger_made_before_the_line_writers_writes_prefixed_lines(tmp_path):
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        done = subprocess.run([sys.executable, "-c", LOGGER_BEFORE_WRITERS], stdout=out, stderr=out, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO / "remote")})
    assert done.returncode == 0, log.read_text()
    (line,) = log.read_text().splitlines()
    assert re.fullmatch(r"\S+ \[drafter-0\] from the drafter", line), line


def test_line_writer_never_mixes_threads_inside_a_line(tmp_path):
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    writer = LineWriter(fd)

    def chatter(name: str) -> None:
        threading.current_thread().name = name
        for i in range(200):
            writer.write(f"{name} part-a {i} ")  # a line written in pieces
            writer.write(f"part-b {i}\n{name} second {i}\n")

    threads = [threading.Thread(target=chatter, args=(f"t{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.write("unfinished")
    writer.flush_all()
    os.close(fd)
    lines = path.read_text().splitlines()
    assert len(lines) == 4 * 400 + 1
    import re
    pattern = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} \[(t\d|MainThread)\] (.*)$")
    for line in lines[:-1]:
        match = pattern.match(line)
        assert match, line
        thread, text = match.groups()
        assert re.fullmatch(rf"{thread} (part-a (\d+) part-b \d+|second \d+)", text), line
    assert lines[-1].endswith("unfinished")


def test_error_record_has_the_chain_and_the_root_frames():
    def inner():
        raise KeyError("deep")

    try:
        try:
            inner()
        except KeyError as exc:
            raise RuntimeError("outer") from exc
    except RuntimeError as exc:
        record = error_record(exc, thread="drafter-3", thread_ident=12, phase="train", step=7)
        text = "".join(traceback.format_exception(exc))
    assert record.traceback == text and "direct cause" in text
    assert record.exc_type == "RuntimeError" and record.message == "outer"
    assert record.frames[-1].func == "inner" and record.frames[-1].code == 'raise KeyError("deep")'
    assert {"ts", "run_id", "thread", "thread_ident", "phase", "step", "release_id"} <= set(record.to_json())


def test_checkpoints_are_atomic_pruned_and_load_back(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        state = TrainingState(step=step, epoch=0, batch_index=step, replicas=2, losses=[1.0] * step)
        ckpt.save_checkpoint(root, state, model, optimizer, scheduler, keep=2, config_yaml=TINY_RESOLVED)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert os.readlink(root / "latest") == "step_000003"
    folder = ckpt.resolve_resume("latest", tmp_path)
    loaded = ckpt.load_checkpoint(folder)
    assert loaded.state.step == 3 and loaded.state.losses == [1.0] * 3
    assert torch.equal(loaded.weights["weight"], model.weight.detach())
    assert loaded.optimizer["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert ckpt.resolve_resume("latest", tmp_path / "elsewhere") is None
    # it carries the resolved config, which loads back, and SHA256SUMS covers it
    assert (folder / "config.yaml").read_text() == TINY_RESOLVED
    assert load_job_config(folder / "config.yaml") == load_job_config(TINY_CONFIG)
    sums = dict(reversed(line.split("  ")) for line in (folder / "SHA256SUMS").read_text().splitlines())
    assert sums["config.yaml"] == hashlib.sha256(TINY_RESOLVED.encode()).hexdigest()
    # A run resumed from an older checkpoint writes below the newest: what it wrote is kept,
    # and written again, a step's folder is replaced whole.
    for losses in ([2.0], [3.0]):
        state = TrainingState(step=1, epoch=0, batch_index=1, replicas=2, losses=losses)
        ckpt.save_checkpoint(root, state, model, optimizer, scheduler, keep=1, config_yaml=TINY_RESOLVED)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert ckpt.load_checkpoint(ckpt.resolve_resume("latest", tmp_path)).state.losses == [3.0]



def test_snapshots_reuse_their_buffers_and_hold_the_state_of_their_own_step():
    """Later checkpoints copy into the first one's CPU buffers (pinned on CUDA: pinning
    gigabytes again every checkpoint would hold training for seconds)."""
    from dflash_train.model.drafter import NonFiniteWeights

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    buffers = ckpt.SnapshotBuffers()
    pointers = []
    for step in (1, 2):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        state = TrainingState(step=step, epoch=0, batch_index=step, replicas=1, losses=[1.0] * step)
        snapshot = ckpt.take_snapshot(state, model, optimizer, scheduler, buffers)
        assert torch.equal(snapshot.weights["weight"], model.weight.detach())
        moments = snapshot.optimizer["optimizer"]["state"][0]
        assert torch.equal(moments["exp_avg"], optimizer.state[model.weight]["exp_avg"])
        assert int(moments["step"]) == step
        assert snapshot.weights["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not the live weights
        pointers.append([snapshot.weights["weight"].data_ptr(), moments["exp_avg"].data_ptr()])
    assert pointers[0] == pointers[1]
    with torch.no_grad():
        model.bias[1] = math.nan
    with pytest.raises(NonFiniteWeights, match="1 of 2 weight tensors .*first: bias"):
        ckpt.take_snapshot(state, model, optimizer, scheduler, buffers)


def test_buffers_made_ahead_from_the_layout_are_the_ones_the_first_snapshot_fills():
    """snapshot_layout names every tensor take_snapshot copies: buffers made from it ahead
    (the writer's background reserve) leave the first snapshot nothing to allocate."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    buffers = ckpt.SnapshotBuffers()
    layout = ckpt.snapshot_layout(model, optimizer, scheduler)
    # weight (6 floats) and bias (2): themselves, exp_avg and exp_avg_sq; a float step each
    assert buffers.reserve(layout) == 4 * (6 + 2) * 3 + 4 * 2
    made = dict(buffers._buffers)
    state = TrainingState(step=1, epoch=0, batch_index=1, replicas=1, losses=[1.0])
    snapshot = ckpt.take_snapshot(state, model, optimizer, scheduler, buffers)
    assert snapshot.weights["weight"].data_ptr() == made["weights/weight"].data_ptr()
    moments = snapshot.optimizer["optimizer"]["state"][0]
    assert moments["exp_avg"].data_ptr() == made["optimizer/optimizer/state/0/exp_avg"].data_ptr()
    assert set(buffers._buffers) - set(made) == {"finite"}  # made at the snapshot: one flag a tensor
    assert buffers.reserve(layout) == 0  # nothing left to make


def test_replica_check_catches_a_one_ulp_difference_and_names_the_replica():
    from types import SimpleNamespace

    from dflash_train.training.replica import ReplicasDiverged, verify_replicas_identical, weights_checksum

    replicas = [SimpleNamespace(index=i, device="cpu", completed_step=12, drafter=small_drafter()) for i in range(3)]
    checksums = verify_replicas_identical(replicas)
    assert len(set(checksums)) == 1 and len(checksums[0]) == 64
    weight = replicas[2].drafter.fc.weight.data
    weight.view(-1)[5] = torch.nextafter(weight.view(-1)[5], torch.tensor(math.inf))
    with pytest.raises(ReplicasDiverged, match=r"replicas \[2\] differ from replica 0 after step 12"):
        verify_replicas_identical(replicas)
    # the same bytes under another name or shape are another checksum
    bare = torch.nn.Linear(2, 2, bias=False)
    renamed = torch.nn.Sequential(bare)
    assert weights_checksum(bare) != weights_checksum(renamed)


@pytest.mark.parametrize("compile_mode, attention, flex", [
    ("cudagraphs", "auto", True), ("default", "auto", False), ("off", "auto", False),
    ("cudagraphs", "sdpa", False), ("default", "flex", True)])  # off with flex is refused (test_compile_coverage)
def test_attention_auto_is_flex_only_under_cudagraphs(tmp_path, compile_mode, attention, flex):
    gpu = BASE.replace("cpu", "cuda:0")
    config = load_job_config(write_config(tmp_path, gpu + f"compile: {compile_mode}\n"
                                            f"drafter: {{attention: {attention}}}\n"))
    assert config.uses_flex is flex


# --- non-finite steps and weights ------------------------------------------------------

def small_replica(tmp_path: Path, index: int = 0):
    """A real Replica on CPU: small_drafter's shape, a tiny random Qwen3 as the frozen target."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.training.replica import FrozenTargetWeights, Replica

    config = load_job_config(write_config(tmp_path, BASE + "drafter: {num_layers: 2, block_size: 4}\n"))
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    drafter = small_drafter()
    return Replica(index, "cpu", config, drafter.config, drafter.state_dict(), FrozenTargetWeights({"cpu": target}),
                   total_steps=10)


def gradients_of(replica, fill: dict[str, float]) -> list[torch.Tensor]:
    """A gradient per parameter: 0.01 everywhere, `fill[name]` in the first element of those named."""
    grads = []
    for name, param in replica.drafter.named_parameters():
        grad = torch.full_like(param, 0.01)
        if name in fill:
            grad.view(-1)[0] = fill[name]
        grads.append(grad)
    return grads


def averaged(grads: list[torch.Tensor], losses: list[float]):
    """What the gradient exchange hands a replica: `grads` and every replica's facts
    (its loss, then no accuracy counts: block_size 4, so 3 positions of each)."""
    from dflash_train.devices import Fence
    from dflash_train.training.gradients import Averaged

    facts = torch.tensor([[loss, *[0.0] * 6] for loss in losses])
    return Averaged(grads, facts, facts, Fence("cpu"))


def test_a_non_finite_gradient_is_never_applied_and_its_parameters_are_named_in_module_order(tmp_path):
    from dflash_train.training.replica import NonFiniteStep, weights_checksum

    replica = small_replica(tmp_path)
    names = [name for name, _ in replica.drafter.named_parameters()]
    bad = [names[-1], names[3], names[9]]  # given out of order: reported in module order
    before = weights_checksum(replica.drafter)
    grads = gradients_of(replica, {bad[0]: math.inf, bad[1]: math.nan, bad[2]: -math.inf})
    with pytest.raises(NonFiniteStep) as info:
        replica.apply(averaged(grads, [2.5]), 5)
    exc = info.value
    assert exc.reporter == 0
    assert exc.detail == {"quantity": "grad_norm", "value": "nan", "replica": 0, "grad_norm": "nan",
                          "losses": [2.5], "nonfinite_grads": [names[3], names[9], names[-1]],
                          "nonfinite_grad_count": 3, "parameters": len(names)}
    assert str(exc).startswith(f"step 5: the gradient norm is nan (losses 2.5); non-finite gradients first in "
                               f"{names[3]}, {names[9]}, {names[-1]} (3 of {len(names)} parameters)")
    assert weights_checksum(replica.drafter) == before  # no update, not even a clipped one
    assert replica.optimizer.state_dict()["state"] == {} and replica.completed_step == 0
    # the same replica then takes a finite step as usual
    applied = replica.apply(averaged(gradients_of(replica, {}), [2.0, 3.0]), 6)
    assert applied.losses == [2.0, 3.0] and applied.grad_norm == pytest.approx(0.01 * math.sqrt(
        sum(p.numel() for p in replica.drafter.parameters())), rel=1e-5)
    assert weights_checksum(replica.drafter) != before and replica.completed_step == 6


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_non_finite_loss_names_its_replica_for_every_replica_alike(tmp_path, index):
    from dflash_train.training.replica import NonFiniteStep

    replica = small_replica(tmp_path, index)
    with pytest.raises(NonFiniteStep) as info:
        replica.apply(averaged(gradients_of(replica, {}), [1.0, math.inf, math.nan]), 3)
    # replicas 0, 1 and 2 all see drafter-1's loss first: drafter-1 records it, the others just stop
    assert info.value.reporter == 1
    assert info.value.detail["quantity"] == "loss" and info.value.detail["value"] == "inf"
    assert info.value.detail["losses"] == [1.0, "inf", "nan"] and info.value.detail["nonfinite_grads"] == []
    assert "the loss of drafter-1 is inf" in str(info.value) and "the gradients are finite" in str(info.value)


class StepLog:
    """A replica as training_step steps it (its protocol, no model): what it was asked to
    do goes to `log`; its apply raises `fails` when given."""

    accumulate = 2

    def __init__(self, index: int, log: list, fails: BaseException | None = None):
        from dflash_train.training.distributed import Layout

        self.index = self.global_index = index
        self.layout = Layout(local_replicas=2)
        self.log, self.fails = log, fails

    def run_step(self, batch, poison: bool, summed):
        self.log.append(("run", batch, poison))
        return (summed or 0) + 1

    def post(self, summed):
        self.log.append(("post", self.index, summed))
        return self.index

    def apply(self, averaged, step: int):
        if self.fails is not None:
            raise self.fails
        self.log.append(("apply", self.index, averaged, step))
        return f"applied by {self.index}"


def test_a_step_runs_each_micro_batch_in_turn_and_takes_a_drafters_faults_at_its_first():
    from dflash_train.config import FaultSpec
    from dflash_train.faults import FaultInjector, InjectedFault
    from dflash_train.training.step import training_step

    faults = FaultInjector((FaultSpec(thread="drafter-1", at="step:3", kind="nonfinite"),
                            FaultSpec(thread="drafter-1", at="step:4", kind="raise", depth=2)), attempt=0)
    log: list = []
    replicas = [StepLog(0, log), StepLog(1, log)]

    def exchange(posted):
        log.append(("exchange", posted))
        return [sum(posted)] * len(posted)

    batches = [["a0", "a1"], ["b0", "b1"]]
    assert training_step(replicas, batches, exchange, faults, 3, peers=None) == "applied by 0"
    # drafter-1's step 3 is poisoned, every micro-batch of it; the average comes once all posted
    assert log == [("run", "a0", False), ("run", "b0", True), ("run", "a1", False), ("run", "b1", True),
                   ("post", 0, 2), ("post", 1, 2), ("exchange", [0, 1]), ("apply", 0, 1, 3), ("apply", 1, 1, 3)]
    log.clear()
    with pytest.raises(InjectedFault, match="drafter-1 at step 4"):
        training_step(replicas, batches, exchange, faults, 4, peers=None)
    assert log == [("run", "a0", False)]  # drafter-1's fault comes before its first micro-batch


@pytest.mark.parametrize("stepped, raised", [([0, 1], "NonFiniteStep"), ([1], "NonFiniteStep"),
                                             ([0], "StopRequested")])
def test_a_non_finite_step_is_raised_where_its_reporter_is_stepped_and_stops_the_others(stepped, raised):
    from dflash_train.faults import FaultInjector
    from dflash_train.training.replica import NonFiniteStep
    from dflash_train.threads import StopRequested
    from dflash_train.training.step import training_step

    found = NonFiniteStep("step 2: the loss of drafter-1 is nan", 1, {"quantity": "loss", "value": "nan"})
    log: list = []
    replicas = [StepLog(index, log, fails=found) for index in stepped]
    with pytest.raises((NonFiniteStep, StopRequested)) as info:
        training_step(replicas, [["x", "y"]] * len(replicas), lambda posted: posted, FaultInjector((), attempt=0), 2,
                      peers=None)
    assert type(info.value).__name__ == raised
    if raised == "StopRequested":  # no record of its own: drafter-1's thread records the step
        assert str(info.value) == "drafter-1 found a non-finite step"
    else:
        assert info.value is found
    assert [entry for entry in log if entry[0] == "apply"] == []


def test_error_record_carries_the_detail_of_its_root_cause():
    from dflash_train.training.replica import NonFiniteStep

    try:
        try:
            raise NonFiniteStep("step 2: …", 0, {"quantity": "loss", "value": "nan"})
        except NonFiniteStep as exc:
            raise RuntimeError("drafter-0 failed") from exc
    except RuntimeError as outer:
        record = error_record(outer, thread="coordinator", thread_ident=1, phase="train", step=None)
    assert record.detail == {"quantity": "loss", "value": "nan"}
    assert json.loads(json.dumps(record.to_json(), allow_nan=False))["detail"]["value"] == "nan"  # strict JSON
    assert "detail" not in error_record(ValueError("x"), thread="t", thread_ident=1, phase="train", step=1).to_json()


def test_the_memory_ledger_keeps_every_threads_notes_and_an_oom_record_carries_them():
    from dflash_train.memory import ledger

    # Parts of a device no test diagnoses: the ledger is the process's, other tests read it too.
    def drafter(index: int) -> None:
        for size in range(200):
            ledger.note(f"ledger-test-{index}", "test:0", size)

    threads = [threading.Thread(target=drafter, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.note("ledger-test-0 CUDA graphs", "test:0", 7)
    for index in range(4):
        own = ledger.snapshot(f"ledger-test-{index}")
        assert [held["bytes"] for held in own] == list(range(200)) + ([7] if index == 0 else [])
    assert ledger.mark("cpu") is None and ledger.note_since(None, "drafter-0") == []
    oom = error_record(torch.OutOfMemoryError("CUDA out of memory."), thread="t", thread_ident=1, phase="train",
                       step=1)
    assert oom.memory == {"devices": {}, "parts": ledger.snapshot()}  # CPU torch: no CUDA device ran
    assert "memory" not in error_record(RuntimeError("CUDA out of memory."), thread="t", thread_ident=1,
                                        phase="train", step=1).to_json()


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_checkpoint_and_export_refuse_non_finite_weights(tmp_path, poison):
    from dflash_train.model.drafter import NonFiniteWeights

    drafter = small_drafter()
    optimizer = torch.optim.AdamW(drafter.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    root = tmp_path / "checkpoints"
    state = TrainingState(step=1, epoch=0, batch_index=0, replicas=1, losses=[1.0])
    ckpt.save_checkpoint(root, state, drafter, optimizer, scheduler, keep=3, config_yaml=TINY_RESOLVED)
    export_drafter(drafter, tmp_path / "export")
    with torch.no_grad():
        drafter.layers[1].mlp.down_proj.weight.view(-1)[7] = poison
    state = TrainingState(step=2, epoch=0, batch_index=1, replicas=1, losses=[1.0, 1.0])
    with pytest.raises(NonFiniteWeights, match=r"1 of \d+ weight tensors hold NaN or infinite values "
                                                r"\(first: layers\.1\.mlp\.down_proj\.weight\); not written"):
        ckpt.save_checkpoint(root, state, drafter, optimizer, scheduler, keep=3, config_yaml=TINY_RESOLVED)
    with pytest.raises(NonFiniteWeights):
        ckpt.replace_dir(tmp_path / "export", lambda staging: export_drafter(drafter, staging))
    # what was there stays whole and finite; no staging folder is left behind
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "export"]
    assert all(t.isfinite().all() for t in load_drafter(tmp_path / "export").state_dict().values())


@pytest.mark.parametrize("saved, configured, refused", [(2, 2, False), (None, 1, False), (None, 3, True), (4, 1, True)])
def test_resume_check_refuses_another_accumulate_naming_both(tmp_path, capsys, saved, configured, refused):
    from dflash_train import resume_check

    config = write_config(tmp_path, BASE + f"optim: {{accumulate: {configured}}}\n")
    folder = tmp_path / "step_000004"
    folder.mkdir()
    state = {"step": 4, "epoch": 0, "batch_index": 15, "replicas": 2, "losses": [], "world_size": 1}
    if saved is not None:  # absent in checkpoints written before optim.accumulate: 1
        state["accumulate"] = saved
    (folder / "state.json").write_text(json.dumps(state))
    code = resume_check.main(["--config", str(config), "--checkpoint", str(folder)])
    out = capsys.readouterr().out
    assert code == (2 if refused else 0), out
    if refused:
        assert f"optim.accumulate {saved or 1}" in out and f"optim.accumulate {configured}" in out


def test_one_rule_says_whether_a_checkpoint_fits_a_config(tmp_path):
    """checkpoint.state.fits, as the trainer asks it at start-up (with the data's plan) and
    resume_check without one: each way a checkpoint cannot go on, in its own words."""
    from dflash_train.checkpoint.state import fits
    from dflash_train.config import DataConfig
    from dflash_train.data.batches import BatchPlan, Sample

    config = load_job_config(write_config(tmp_path, BASE + "optim: {accumulate: 2}\n"))
    capped = load_job_config(write_config(tmp_path, BASE + "optim: {accumulate: 2, max_steps: 4}\n"))
    one_drafter = load_job_config(write_config(tmp_path, BASE.replace("[cpu, cpu]", "[cpu]") +
                                                 "optim: {accumulate: 2}\n"))
    evaluate = load_job_config(write_config(tmp_path, "target: {tiny: {}}\ndata: {synthetic: {}}\njob: evaluate\n"
                                                "evaluate: {drafter: d}\n"))
    samples = [Sample(torch.arange(5 + i % 7), torch.zeros(5 + i % 7, dtype=torch.long)) for i in range(60)]
    data = DataConfig(train="unused.jsonl", max_length=16, token_budget=16, pad_multiple=8)
    plan = BatchPlan(samples, data, replicas=2, epochs=1, max_steps=None, seed=0, accumulate=2)
    folder = tmp_path / "step_000003"

    def at(step: int, **changed) -> TrainingState:
        entry = plan.last_entry(min(step, plan.total_steps))
        return dataclasses.replace(TrainingState(step=step, epoch=entry.epoch, batch_index=entry.index, replicas=2,
                                                 losses=[1.0] * step, accumulate=2), **changed)

    assert fits(at(3), config, folder, 1, plan) is None and fits(at(3), config, folder, 1) is None
    assert fits(at(plan.total_steps), config, folder, 1, plan) is None  # nothing left to train: it still fits
    # the replicas in all decide the data order, not how processes hold them
    assert fits(at(3, world_size=2), one_drafter, folder, 2, plan) is None
    refused = [
        (at(3), evaluate, 1, None, "job: evaluate does not train a drafter from checkpoints"),
        (at(3, replicas=4, world_size=2), config, 1, plan,
         f"{folder} was trained with 4 drafter replica(s) in all (2 process(es)); this run has 2 (1 process(es) x 2 "
         "drafters): the data order depends on the number of replicas, so resume with 4 in all (e.g. 2 process(es) x "
         "2 drafters)"),
        (at(3, world_size=2), one_drafter, 1, None, "this run has 1 (1 process(es) x 1 drafters)"),
        (at(3, accumulate=1), config, 1, None,
         f"{folder} was trained with optim.accumulate 1 (micro-batches per step and drafter); this config has "
         "optim.accumulate 2: which micro-batches make a step depends on it, so resume with optim.accumulate 1"),
        (at(5), capped, 1, None, f"{folder} is at step 5, past this config's optim.max_steps 4"),
        (at(plan.total_steps + 1), config, 1, plan,
         f"{folder} is at step {plan.total_steps + 1}, past this config's {plan.total_steps} steps"),
        (at(3, batch_index=at(3).batch_index + 1), config, 1, plan,
         f"{folder}: its data cursor (epoch 0, batch {at(3).batch_index + 1}) is not where this config's data puts "
         f"step 3 (epoch 0, batch {at(3).batch_index}); the data, token_budget or seed changed since it was written"),
    ]
    for state, configured, world_size, order, problem in refused:
        assert problem in (fits(state, configured, folder, world_size, order) or ""), problem
    # what only the data tells is left to the start-up
    assert fits(at(plan.total_steps + 1), config, folder, 1) is None
    assert fits(at(3, batch_index=0), config, folder, 1) is None


def test_resume_check_answers_without_torch(tmp_path):
    config = write_config(tmp_path, BASE)
    folder = tmp_path / "step_000001"
    folder.mkdir()
    TrainingState(step=1, epoch=0, batch_index=1, replicas=2, losses=[1.0]).write(folder)
    code = ("import sys; from dflash_train import resume_check; "
            f"code = resume_check.main(['--config', {str(config)!r}, '--checkpoint', {str(folder)!r}]); "
            "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "remote")})
    assert out.stdout.strip() == "0 []"


def test_a_thread_that_ends_once_ready_was_ready_and_one_that_ends_before_was_not(tmp_path):
    """A drafter with nothing left to train (a resume at the last step) ends as soon as it
    is ready, maybe before the coordinator looks: that is a start, not a stop (exit 143)."""
    from dflash_train.runlog import ErrorLog, ThreadNames
    from dflash_train.threads import JobThread, StopLatch, StopRequested

    latch = StopLatch(ErrorLog(tmp_path / "errors.jsonl"), ThreadNames(tmp_path / "threads.json"))
    ready_then_done = JobThread("drafter-1", latch, lambda worker: worker.mark_ready())
    ready_then_done.start()
    ready_then_done.join()
    ready_then_done.wait_until_ready(5.0)  # returns: the thread was ready
    never_ready = JobThread("drafter-2", latch, lambda worker: None)
    never_ready.start()
    never_ready.join()
    with pytest.raises(StopRequested, match="drafter-2 ended before it was ready"):
        never_ready.wait_until_ready(5.0)
    assert not latch.stop.is_set() and not (tmp_path / "errors.jsonl").read_text()
