"""The export loads the same way in every reader: transformers 5 (this environment) and
4.57 (what the public DFlash inference code pins), through AutoModel's trust_remote_code;
so does the tiny target's tokenizer, through AutoTokenizer.

transformers 4.57.1 is installed once, from PyPI, into the user's cache folder (outside the
checkout, which the suite leaves as it found it); a subprocess puts it before this
environment's site-packages, so it reuses our torch while its own transformers, tokenizers
and huggingface-hub shadow ours (only there)."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from dflash_schema import SchemaError
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.config import DrafterConfig, load_job_config
from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config, export_drafter
from dflash_train.model.target import FeatureTap
from support.trainer import end, start_trainer

REPO = Path(__file__).resolve().parents[1]
LEGACY_TRANSFORMERS = "transformers==4.57.1"
# Per Python version: tokenizers is a compiled wheel.
LEGACY_DIR = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-tests"
              / f"{LEGACY_TRANSFORMERS.replace('==', '-')}-py{sys.version_info.major}{sys.version_info.minor}")

pytestmark = pytest.mark.timeout(600)  # the first run installs transformers 4.57.1

ROPES = {
    # Qwen3's theta: transformers 4.x falls back to 10000 unless `rope_theta` is top-level.
    "theta-1e6": {"rope_type": "default", "rope_theta": 1e6},
    # A scaled RoPE: 4.x reads the scaling from `rope_scaling`, 5.x from `rope_parameters`.
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
}

# Run in a fresh process: load the export the way users do, run it on the saved inputs.
LOAD_AND_RUN = """
import json, sys, torch, transformers
from transformers import AutoModel
export, inputs_path, out_path = sys.argv[1:]
model = AutoModel.from_pretrained(export, trust_remote_code=True, dtype="auto").eval()
inputs = torch.load(inputs_path)
with torch.no_grad():
    hidden = model(noise_embedding=inputs["noise_embedding"].to(model.dtype),
                   target_hidden=inputs["target_hidden"].to(model.dtype), position_ids=inputs["position_ids"])
    logits = hidden.float() @ inputs["lm_head"].T
    # The decode's cached path: the context's keys and values projected in two parts, the
    # second with rows at the block's positions that the block's own keys overwrite.
    features, block = inputs["target_hidden"].to(model.dtype), inputs["noise_embedding"].to(model.dtype)
    context, q_len = features.shape[1], block.shape[1]
    cache = model.context_cache(context + q_len + 5)
    model.extend_context(features[:, :context // 2], torch.arange(context // 2), cache)
    overwritten = torch.randn(1, q_len, features.shape[-1], dtype=model.dtype)
    model.extend_context(torch.cat([features[:, context // 2:], overwritten], dim=1),
                         torch.arange(context // 2, context + q_len), cache)
    key_valid = (torch.arange(context + q_len + 5) < context + q_len)[None, None, None]
    cached = model.draft_cached(block, torch.arange(context, context + q_len), cache, key_valid)
    cached_logits = cached.float() @ inputs["lm_head"].T
rope = model.rotary_emb
torch.save({"logits": logits, "cached_logits": cached_logits, "inv_freq": rope.inv_freq,
            "attention_scaling": rope.attention_scaling}, out_path)
print(json.dumps({"version": transformers.__version__, "class": type(model).__name__, "dtype": str(model.dtype),
                  "keys": sorted(model.state_dict())}))
"""


def _install_legacy_transformers() -> None:
    """pip install --target into a staging folder moved into place when complete, so an
    interrupted install is never taken for a finished one."""
    LEGACY_DIR.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{LEGACY_DIR.name}-", dir=LEGACY_DIR.parent))
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              "--target", str(staging), LEGACY_TRANSFORMERS],
                             capture_output=True, text=True, timeout=540)
        if out.returncode != 0:
            pytest.fail(f"could not install {LEGACY_TRANSFORMERS} into {staging}:\n{out.stderr[-3000:]}")
        try:
            os.replace(staging, LEGACY_DIR)
        except OSError:
            if not LEGACY_DIR.exists():  # else a concurrent run installed it first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@pytest.fixture(scope="session")
def legacy_transformers() -> Path:
    if not LEGACY_DIR.exists():
        _install_legacy_transformers()
    return LEGACY_DIR


def load_in_fresh_process(export: Path, inputs: Path, tmp_path: Path, site: Path | None) -> tuple[dict, dict]:
    """Run LOAD_AND_RUN on `export`; `site`: a folder put before our site-packages."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    out_path = tmp_path / "outputs.pt"
    out = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(export), str(inputs), str(out_path)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), torch.load(out_path)


def drafter_for(rope: dict, layers: int = 2) -> DFlashDrafter:
    target = Qwen3Config(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         rope_parameters=dict(rope))
    spec = DrafterConfig(num_layers=layers, block_size=4, num_anchors=4)
    drafter = DFlashDrafter(drafter_hf_config(target, spec, (1, 3, 5), mask_token_id=7))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    return drafter.eval()


def drafter_inputs(drafter: DFlashDrafter, context: int = 300) -> dict[str, torch.Tensor]:
    """A block of 4 after `context` tokens; positions far enough out for theta to matter."""
    generator = torch.Generator().manual_seed(3)
    hidden = drafter.config.hidden_size
    q_len = drafter.block_size
    return {"noise_embedding": torch.randn(1, q_len, hidden, generator=generator),
            "target_hidden": torch.randn(1, context, len(drafter.target_layer_ids) * hidden, generator=generator),
            "position_ids": torch.arange(context + q_len).unsqueeze(0),
            "lm_head": torch.randn(drafter.config.vocab_size, hidden, generator=generator)}


def trainer_logits(drafter: DFlashDrafter, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the trainer's drafter computes on `inputs` (every block position sees everything)."""
    context = inputs["target_hidden"].shape[1]
    positions = inputs["position_ids"]
    mask = torch.ones(1, 1, drafter.block_size, positions.shape[1], dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter(inputs["noise_embedding"], inputs["target_hidden"], positions[:, :context],
                         positions[:, context:], mask)
    return hidden @ inputs["lm_head"].T


@pytest.mark.parametrize("rope_name", sorted(ROPES))
@pytest.mark.parametrize("reader", ["current", LEGACY_TRANSFORMERS])
@pytest.mark.slow(seconds=14,
                  why="loads the export in another interpreter per case (the first installs transformers 4.57.1)")
def test_every_transformers_loads_the_export_as_the_drafter_that_was_trained(
        reader, rope_name, request, tmp_path):
    """The export's forward and its cached path (context keys and values kept, as the
    decode runs it) both compute the trained drafter's logits, under each transformers."""
    site = request.getfixturevalue("legacy_transformers") if reader == LEGACY_TRANSFORMERS else None
    drafter = drafter_for(ROPES[rope_name])
    export_drafter(drafter, tmp_path / "export")
    inputs = drafter_inputs(drafter)
    torch.save(inputs, tmp_path / "inputs.pt")
    expected = trainer_logits(drafter, inputs)

    info, outputs = load_in_fresh_process(tmp_path / "export", tmp_path / "inputs.pt", tmp_path, site)

    if reader == LEGACY_TRANSFORMERS:
        assert info["version"] == LEGACY_TRANSFORMERS.split("==")[1]
    assert info["class"] == "DFlashDraftModel" and info["dtype"] == "torch.float32"
    assert info["keys"] == sorted(drafter.state_dict())  # fc and hidden_norm included
    # RoPE as the trainer had it (4.x without top-level rope_theta: theta 10000)
    torch.testing.assert_close(outputs["inv_freq"], drafter.rotary_emb.inv_freq)
    assert outputs["attention_scaling"] == pytest.approx(drafter.rotary_emb.attention_scaling)
    torch.testing.assert_close(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["cached_logits"], expected, rtol=1e-5, atol=1e-5)  # the decode's path
    # ...and the logits tell RoPEs apart: the same weights under the default theta differ.
    default_rope = drafter_for({"rope_type": "default", "rope_theta": 10000.0})
    default_rope.load_state_dict(drafter.state_dict())
    assert (trainer_logits(default_rope, inputs) - expected).abs().max() > 1e-2


def test_export_config_carries_both_rope_forms_and_the_auto_map(tmp_path):
    export_drafter(drafter_for(ROPES["yarn"]), tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and config["rope_parameters"]["rope_theta"] == 1e6
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    # the modeling file stands alone: it imports nothing but torch, transformers and the stdlib
    source = (tmp_path / "export" / "modeling_dflash.py").read_text()
    imported = {(node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
                for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert imported == {"__future__", "typing", "torch", "transformers"}
    export_drafter(drafter_for(ROPES["theta-1e6"]), tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["rope_scaling"] is None


@pytest.mark.slow(seconds=6, why="loads the export in another interpreter (torch and transformers imported there)")
def test_bf16_export_loads_as_bf16_and_drafts_like_the_trained_weights(tmp_path):
    drafter = drafter_for(ROPES["theta-1e6"])
    export_drafter(drafter, tmp_path / "export", torch.bfloat16)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "bfloat16"
    inputs = drafter_inputs(drafter, context=40)
    torch.save(inputs, tmp_path / "inputs.pt")
    info, outputs = load_in_fresh_process(tmp_path / "export", tmp_path / "inputs.pt", tmp_path, None)
    assert info["dtype"] == "torch.bfloat16"
    expected = trainer_logits(drafter, inputs)
    # bf16 weights and activations: close to the fp32 drafter, not equal
    assert (outputs["logits"] - expected).abs().max() < 0.05 * expected.abs().max()


def _config(tmp_path: Path, name: str, edit) -> Path:
    config = yaml.safe_load((REPO / "configs" / "train" / name).read_text())
    edit(config)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_export_dtype_is_bf16_where_the_drafters_train_on_cuda_unless_set(tmp_path):
    assert load_job_config(REPO / "configs/train/tiny-cpu.yaml").export_dtype == "float32"
    assert load_job_config(REPO / "configs/train/tiny-gpu.yaml").export_dtype == "bfloat16"
    fp32 = _config(tmp_path, "tiny-gpu.yaml", lambda c: c.update(export={"dtype": "float32"}))
    assert load_job_config(fp32).export_dtype == "float32"
    bad = _config(tmp_path, "tiny-cpu.yaml", lambda c: c.update(export={"dtype": "fp8"}))
    with pytest.raises(SchemaError, match="export"):
        load_job_config(bad)


def test_the_last_target_layer_is_refused_naming_target_layer_ids(tmp_path):
    # tiny-cpu's target has 6 layers: 5 is the last, whose feature readers disagree on
    last = _config(tmp_path, "tiny-cpu.yaml", lambda c: c["drafter"].update(target_layer_ids=[1, 5]))
    with pytest.raises(SchemaError, match=r"drafter\.target_layer_ids \[1, 5\].*at most 4"):
        load_job_config(last)
    fine = _config(tmp_path, "tiny-cpu.yaml", lambda c: c["drafter"].update(target_layer_ids=[1, 4]))
    assert load_job_config(fine).drafter.target_layer_ids == (1, 4)
    # a target from a folder: its layer count is known only once loaded, so the tap refuses
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match=r"drafter\.target_layer_ids \[0, 2\]"):
        FeatureTap(target, (0, 2))
    FeatureTap(target, (0, 1))


# A short real run (test_trainer_runs.SMALL's data and drafter), on `device`.
SHORT_RUN = """
target: {{tiny: {{}}}}
data:
  synthetic: {{num_train: 64, num_eval: 2}}
  max_length: 128
  token_budget: 512
  pad_multiple: 16
drafter: {{num_layers: 1, block_size: 4, num_anchors: 8, num_target_features: 2}}
devices: {{target: [{device}], drafters: [{device}]}}
optim: {{max_steps: 4}}
eval: {{num_prompts: 0}}
runtime: {{torch_threads: 1}}
{export}
"""


@pytest.mark.parametrize("device, export", [
    pytest.param("cuda:0", "", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs CUDA")]),
    ("cpu", "export: {dtype: bfloat16}"),  # on CPU the default is fp32: bf16 must be asked for
])
@pytest.mark.slow(seconds=7, why="a trainer run per case that exports, then a load of the export in another interpreter")
def test_a_run_exports_bf16_that_loads_as_the_drafter_it_trained(device, export, workspace, tmp_path):
    from dflash_train.model.drafter import load_drafter

    run = start_trainer(workspace, tmp_path / "run", SHORT_RUN.format(device=device, export=export), "run")
    try:
        assert run.wait(400) == 0, run.log()[-4000:]
    finally:
        end(run)
    exported = run.run_dir / "export"
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file
    # The trained weights as training held them (fp32): the last step's checkpoint, written
    # at the step the export was made from.
    weights = load_file(str(run.run_dir / "checkpoints" / "latest" / "model.safetensors"))
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    export = load_file(str(exported / "model.safetensors"))
    assert export.keys() == weights.keys()
    for name, tensor in export.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, weights[name].to(torch.bfloat16)), name
    trained = load_drafter(exported).eval()  # the config the export carries, with the trained fp32 weights
    trained.load_state_dict(weights, strict=True)
    inputs = drafter_inputs(trained, context=40)
    torch.save(inputs, tmp_path / "inputs.pt")
    info, outputs = load_in_fresh_process(exported, tmp_path / "inputs.pt", tmp_path, None)
    assert info["class"] == "DFlashDraftModel" and info["dtype"] == "torch.bfloat16"
    expected = trainer_logits(trained, inputs)
    assert (outputs["logits"] - expected).abs().max() < 0.05 * expected.abs().max()


# Run in a fresh process: load a tokenizer folder the way users do and render a chat with it.
TOKENIZE = """
import json, sys, transformers
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
text = tokenizer.apply_chat_template(json.loads(sys.argv[2]), tokenize=False, add_generation_prompt=True)
print(json.dumps({"version": transformers.__version__, "text": text, "ids": tokenizer(text)["input_ids"],
                  "special": [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id]}))
"""


@pytest.mark.slow(seconds=8, why="builds the tiny target, then loads its tokenizer in two other interpreters "
                                 "(the first run installs transformers 4.57.1)")
def test_the_tiny_targets_tokenizer_loads_under_every_transformers_and_its_cache_key_names_the_version(
        workspace, legacy_transformers, tmp_path):
    """The tiny target's folder is cached per transformers version (what it saves and the
    answers it makes are that version's), and the tokenizer this one saves reads the same
    under transformers 4.57.1 (5.x's own name for its class, TokenizersBackend, is one
    4.x does not know)."""
    import hashlib

    import transformers

    from dflash_train.config import TinyTargetSpec
    from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets

    assets = ensure_tiny_assets(TinyTargetSpec(), TARGET_DATA, workspace / "cache")
    entry = assets.target_dir.parent
    hashed = (entry / "spec.json").read_text().rstrip("\n")
    assert json.loads(hashed)["transformers"] == transformers.__version__
    assert entry.name == f"tiny-{hashlib.sha256(hashed.encode()).hexdigest()[:16]}"
    chat = json.dumps([{"role": "user", "content": "w1 w2 w3"}])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    read = {}
    for reader, site in (("current", None), (LEGACY_TRANSFORMERS, legacy_transformers)):
        paths = os.pathsep.join(filter(None, [str(site) if site else None, env.get("PYTHONPATH")]))
        out = subprocess.run([sys.executable, "-c", TOKENIZE, str(assets.target_dir), chat], capture_output=True,
                             text=True, env={**env, "PYTHONPATH": paths}, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-4000:]
        read[reader] = json.loads(out.stdout.strip().splitlines()[-1])
    assert read[LEGACY_TRANSFORMERS].pop("version") == LEGACY_TRANSFORMERS.split("==")[1]
    assert read["current"].pop("version") == transformers.__version__
    assert read[LEGACY_TRANSFORMERS] == read["current"]
    assert read["current"]["text"].startswith("<|im_start|>user w1 w2 w3<|im_end|>")
