"""Speculative decoding (the reference paths with transformers' KV cache or none, and the
fast decode with static caches and the drafter cache), the two acceptance figures, the
speed-up, and the standalone evaluation job (`job: evaluate`), on the tiny CPU target with
a drafter the real trainer trains once for this module, and on random targets of each
family with a drafter built to draft what they decode (_agreeing_drafter); the fast decode
under transformers 4.57.1 too, and with CUDA graphs on a GPU (`-m gpu`).

Of the decode's CUDA graphs (model/decode_graphs.py) the CPU checks the decoder's
bookkeeping (support/graphs.py: each step captured once, before the prefill, its warm-up
runs leaving nothing a decode reads). Only the device proves the rest: that a replayed
step computes what the eager one does on the same buffers, captured on a side stream in
a thread of its own under CAPTURE_LOCK, the target in bf16; the `gpu` test compares the
graphed decode, the target alone and the compiled steps with the eager decode and with
`generate`."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import dflash_contract.events
import pytest
import torch

from dflash_train.config import load_job_config
from support.train_configs import TINY_CPU
from test_export import LEGACY_TRANSFORMERS, legacy_transformers  # noqa: F401 - a fixture, installed once
from support.trainer import end, start_trainer

# On one xdist worker with test_tiny_cpu_config_end_to_end: the shipped config's run whose
# drafter these tests decode with is made once, not once per worker.
pytestmark = pytest.mark.xdist_group("tiny-cpu-run")


def _tiny_sections() -> str:
    """tiny-cpu.yaml's target and synthetic data (so its cached assets are shared)."""
    text = TINY_CPU.read_text()
    return text[text.index("target:"):text.index("drafter:")]


@pytest.fixture(scope="module")
def trained(tiny_cpu_run, workspace):
    """The drafter the real trainer trained on the shipped tiny CPU config (the suite's
    one run of it, tests/conftest.py): its export, and the tiny target and prompts it was
    trained for."""
    from transformers import AutoTokenizer

    from dflash_train.data.batches import load_prompts
    from dflash_train.model.drafter import load_drafter
    from dflash_train.jobs.common import stop_ids
    from dflash_train.model.target import FeatureTap, load_target
    from dflash_train.data.tiny import ensure_tiny_assets

    assert tiny_cpu_run.proc.returncode == 0, tiny_cpu_run.log()[-3000:]
    run_dir = tiny_cpu_run.run_dir
    spec = load_job_config(TINY_CPU)
    assets = ensure_tiny_assets(spec.target.tiny, spec.data.synthetic, workspace / "cache")  # cached: built above
    target = load_target(str(assets.target_dir), "float32", "cpu")
    drafter = load_drafter(run_dir / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(assets.target_dir))
    return {"export": run_dir / "export", "target": target, "drafter": drafter,
            "tap": FeatureTap(target, drafter.target_layer_ids), "assets": assets,
            "prompts": load_prompts(assets.eval_path, tokenizer, 8), "stop_ids": stop_ids(tokenizer),
            "embed": target.get_input_embeddings().weight, "head": target.get_output_embeddings().weight}


def _decode(t, prompt, max_new_tokens, stop_ids=frozenset(), kv_cache=True):
    from dflash_train.model.speculative import speculative_decode
    return speculative_decode(t["drafter"], t["tap"], t["embed"], t["head"], prompt, max_new_tokens, set(stop_ids),
                              kv_cache=kv_cache)


def _fast(t, capacity: int = 256, **kwargs):
    from dflash_train.model.fast_decode import FastDecoder
    return FastDecoder(t["drafter"], t["tap"], t["embed"], t["head"], capacity, **kwargs)


def _greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.timeout(1800)  # the shipped config's run may be made in its setup
@pytest.mark.slow(seconds=34, why="the first test to use the shipped tiny config's run makes it (on CPU)")
def test_kv_cached_verification_is_lossless_and_accepts_as_the_uncached_one(trained):
    """The cached path's output is the target's greedy decode token for token, on several
    prompts, and its acceptance per verify step is the uncached path's, step for step."""
    prompts = trained["prompts"][:3] + [[2, 6] + [10 + i for i in range(12)] + [3, 2, 7]]
    accepted_any = []
    for prompt in prompts:
        cached = _decode(trained, prompt, 40)
        uncached = _decode(trained, prompt, 40, kv_cache=False)
        assert cached.tokens == _greedy(trained["target"], prompt, 40)
        assert uncached.tokens == cached.tokens
        assert cached.accepted == uncached.accepted
        accepted_any += cached.accepted
    assert max(accepted_any) > 1, "the trained drafter must get drafts accepted, or nothing was compared"


@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=3, why="speculative decoding on CPU with the module's trained drafter")
def test_fast_decode_is_lossless_and_accepts_as_the_reference_with_and_without_the_drafter_cache(trained):
    """One decoder (its buffers reused across prompts of different lengths): the output is
    the target's greedy decode token for token, and its acceptance per verify step is the
    full re-run's, with the drafter's context keys and values kept and without, and with
    each step launched before the last is read (as on CUDA: the step launched past a
    decode's end leaves the next prompt's decode as it would be); the target alone
    through the same static cache decodes the same tokens, overlapped or not."""
    prompts = trained["prompts"][:3] + [[2, 6] + [10 + i for i in range(12)] + [3, 2, 7], [2, 6]]
    decoders = {"drafter cache": _fast(trained, overlap=False), "overlapped": _fast(trained, overlap=True),
                "no drafter cache": _fast(trained, drafter_cache=False)}
    accepted_any = []
    for prompt in prompts:
        greedy = _greedy(trained["target"], prompt, 40)
        reference = _decode(trained, prompt, 40, kv_cache=False)
        assert reference.tokens == greedy
        for name, decoder in decoders.items():
            fast = decoder.decode(prompt, 40, set())
            assert fast.tokens == greedy, name
            assert fast.accepted == reference.accepted, name
        assert decoders["drafter cache"].decode_alone(prompt, 40, set()).tokens == greedy
        assert decoders["overlapped"].decode_alone(prompt, 40, set()).tokens == greedy
        accepted_any += reference.accepted
    assert max(accepted_any) > 1, "the trained drafter must get drafts accepted, or nothing was compared"


# Run in a fresh process (transformers 4.57.1 before this environment's): the fast decode,
# with and without the drafter cache, the target alone, the full re-run and `generate`.
DECODE_IN_FRESH_PROCESS = """
import json, sys, torch, transformers
from pathlib import Path
from dflash_train.model.drafter import load_drafter
from dflash_train.model.fast_decode import FastDecoder
from dflash_train.model.speculative import speculative_decode
from dflash_train.model.target import FeatureTap, load_target
target_dir, export, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
target = load_target(target_dir, "float32", "cpu")
drafter = load_drafter(Path(export)).eval()
tap = FeatureTap(target, drafter.target_layer_ids)
embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
out = {"version": transformers.__version__, "runs": []}
for prompt in prompts:
    run = {}
    for cache in (True, False):
        decoded = FastDecoder(drafter, tap, embed, head, 256, drafter_cache=cache).decode(prompt, 40, set())
        run[f"fast_{cache}"] = [decoded.tokens, decoded.accepted]
    run["alone"] = FastDecoder(drafter, tap, embed, head, 256).decode_alone(prompt, 40, set()).tokens
    reference = speculative_decode(drafter, tap, embed, head, prompt, 40, set(), kv_cache=False)
    run["reference"] = [reference.tokens, reference.accepted]
    with torch.no_grad():
        run["greedy"] = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out["runs"].append(run)
print(json.dumps(out))
"""


@pytest.mark.timeout(900)  # the first run installs transformers 4.57.1
@pytest.mark.slow(seconds=12, why="decodes in a new interpreter under transformers 4.57.1 (the first installs it)")
def test_fast_decode_is_lossless_under_transformers_4_57(trained, legacy_transformers, tmp_path):
    """The static cache drives transformers' own attention layers through the cache
    argument 4.57 names `past_key_values` (5.x: `cache`): lossless there too, and with the
    reference path's acceptance."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(legacy_transformers), os.environ.get("PYTHONPATH")]))}
    prompts = trained["prompts"][:2]
    out = subprocess.run([sys.executable, "-c", DECODE_IN_FRESH_PROCESS, str(trained["assets"].target_dir),
                          str(trained["export"]), json.dumps(prompts)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["version"] == LEGACY_TRANSFORMERS.split("==")[1]
    for prompt, run in zip(prompts, result["runs"]):
        assert run["greedy"] == _greedy(trained["target"], prompt, 40)  # the same target as here
        assert run["reference"][0] == run["greedy"] == run["alone"]
        assert run["fast_True"] == run["fast_False"] == run["reference"]
    assert max(a for run in result["runs"] for a in run["reference"][1]) > 1


def _random_target(model_type: str, **extra):
    """A tiny random target of `model_type` (transformers' own class for it)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=512, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _drafter_of(target, token: int):
    """A drafter that drafts `token` at every MASK of a block, whatever its context: its
    layers add nothing (their output projections zero), so a MASK position's final hidden
    state is its norm of the MASK embedding, and the MASK is a token whose normed embedding
    the target's head reads as `token`. None when no token's is."""
    import torch.nn.functional as F

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config

    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():  # the drafter's norm weighs one: its RMS norm alone
        read = F.linear(F.rms_norm(embed, (embed.shape[1],), eps=target.config.rms_norm_eps), head).argmax(-1)
    masks = (read == token).nonzero().flatten().tolist()
    if not masks:
        return None
    drafter = DFlashDrafter(drafter_hf_config(target.config, DrafterConfig(num_layers=1, block_size=4), (1, 3),
                                              masks[0]))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return drafter.eval()


def _agreeing_drafter(target, greedy: list[int]):
    """A drafter (_drafter_of) of the token `greedy` holds most often after its first
    token (and other than it), of those one can draft, and that token. Every occurrence of
    it in a speculative decode is an accepted draft, not a bonus token (a bonus is the
    target's choice where it differs from the draft, and every draft is that token): the
    target accepts some drafts, a verify step gaining several tokens, and rejects the
    others (those it decodes otherwise)."""
    import collections

    for token, _ in collections.Counter(t for t in greedy[1:] if t != greedy[0]).most_common():
        drafter = _drafter_of(target, token)
        if drafter is not None:
            return drafter, token
    raise AssertionError(f"no MASK makes a drafter of any token of {greedy}")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_the_fast_decode_runs_every_family_it_claims_losslessly(model_type):
    """The static target's layer loop is the base model's forward for every supported
    family: the target alone and the speculative decode (with and without the drafter's
    cache) decode `generate`'s tokens, with a drafter whose drafts the target accepts at
    some positions of a block and rejects at others."""
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.fast_layers import SUPPORTED
    from dflash_train.model.target import FeatureTap

    assert model_type in SUPPORTED
    target = _random_target(model_type)
    prompt = [3, 9, 11, 20, 7, 8]
    greedy = _greedy(target, prompt, 24)
    drafter, _ = _agreeing_drafter(target, greedy)
    tap = FeatureTap(target, (1, 3))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    for cache in (True, False):
        decoder = FastDecoder(drafter, tap, embed, head, 64, drafter_cache=cache)
        decoded = decoder.decode(prompt, 24, set())
        assert decoded.tokens == greedy
        # drafts accepted (a step gained more than its bonus) and rejected (one gained less than a block)
        assert max(decoded.accepted) > 1 and min(decoded.accepted) < drafter.block_size, decoded.accepted
        assert decoder.decode_alone(prompt, 24, set()).tokens == greedy


@pytest.mark.timeout(900)
@pytest.mark.slow(seconds=40, why="torch.compile (Inductor's C++ on CPU) of a random target's layers and a drafter")
def test_compiled_decode_steps_are_lossless_and_a_new_prompt_length_compiles_nothing():
    """With `compile_steps` the verify, draft and target-alone steps run through
    torch.compile: still `generate`'s tokens, and once a decode has compiled them, decoding
    prompts of other lengths compiles nothing (the prefill stays eager): an evaluator that
    is ready compiles no more."""
    from torch._dynamo.utils import counters

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.target import FeatureTap

    target = _random_target("qwen3")
    drafter = DFlashDrafter(drafter_hf_config(target.config, DrafterConfig(num_layers=1, block_size=4), (1, 3), 5))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    tap = FeatureTap(target, (1, 3))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    decoder = FastDecoder(drafter.eval(), tap, embed, head, 64, compile_steps=True)
    assert decoder.compiled
    before = counters["stats"]["unique_graphs"]
    first = [3, 9, 11, 20, 7, 8]
    assert decoder.decode(first, 24, set()).tokens == _greedy(target, first, 24)
    assert decoder.decode_alone(first, 24, set()).tokens == _greedy(target, first, 24)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > before, "nothing was compiled"
    for prompt in ([5, 6, 7], [12, 4, 4, 9, 30, 2, 2, 17, 8, 1, 6]):
        greedy = _greedy(target, prompt, 20)
        assert decoder.decode(prompt, 20, set()).tokens == greedy
        assert decoder.decode_alone(prompt, 20, set()).tokens == greedy
    assert counters["stats"]["unique_graphs"] == compiled, "a prompt of another length compiled again"


@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=25, why="torch.compile (Inductor's C++ on CPU) of a drafter's step functions")
@pytest.mark.parametrize("compile_steps", [False, True], ids=["plain", "compiled"])
def test_the_fast_drafter_writes_and_drafts_what_the_modules_cached_path_does(compile_steps):
    """FastDrafter (fused projections, fast_layers' layer functions) against modeling_dflash's
    extend_context and draft_cached on a copy of the same drafter: the same keys and values
    in every layer's cache and the same drafts, over a prefill and two blocks, the second
    extension and block overlapping (the context's keys past the accepted length must be
    the block's)."""
    import copy

    import torch.nn.functional as F

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
    from dflash_train.model.fast_drafter import FastDrafter

    target = _random_target("qwen3")
    reference = DFlashDrafter(drafter_hf_config(target.config, DrafterConfig(num_layers=3, block_size=4), (1, 3), 5))
    reference.reset_parameters(torch.Generator().manual_seed(3))
    reference.eval()
    fast_module = copy.deepcopy(reference)
    fast = FastDrafter(fast_module, 32, compile_steps=compile_steps)
    assert fast_module.layers[0].self_attn.k_proj.weight.data_ptr() != \
        reference.layers[0].self_attn.k_proj.weight.data_ptr()
    head = target.get_output_embeddings().weight.detach()
    width = 2 * target.config.hidden_size
    generator = torch.Generator().manual_seed(4)
    caches = reference.context_cache(32), fast_module.context_cache(32)
    key_index = torch.arange(32)
    with torch.inference_mode():
        prompt = torch.randn(1, 7, width, generator=generator)
        reference.extend_context(prompt, torch.arange(7), caches[0])
        fast.extend(prompt, torch.arange(7), caches[1])
        for verified, start in ((7, 7), (7, 9)):  # the second block starts inside the first's context
            features = torch.randn(1, 4, width, generator=generator)
            positions = torch.arange(4)
            reference.extend_context(features, verified + positions, caches[0])
            fast.extend(features, verified + positions, caches[1], step=True)
            block = torch.randn(1, 4, target.config.hidden_size, generator=generator)
            hidden = reference.draft_cached(block, start + positions, caches[0], (key_index < start + 4)[None, None, None])
            expected = F.linear(hidden[0, 1:], head).argmax(-1)
            assert fast.drafts(block, start + positions, caches[1], head).tolist() == expected.tolist()
            for (keys, values), (fast_keys, fast_values) in zip(*caches):
                torch.testing.assert_close(fast_keys, keys, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(fast_values, values, rtol=1e-5, atol=1e-5)


def test_a_target_whose_layer_types_have_their_own_rope_gets_a_drafter_that_decodes_losslessly():
    """Gemma 3 keeps RoPE parameters per layer type ({full_attention: ..., sliding_attention:
    ...}): the drafter takes its full-attention layers' (it attends to its whole context),
    and the target's sliding-window layers send its evaluation down the reference path."""
    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
    from dflash_train.model.speculative import ReferenceDecoder, evaluation_decoder
    from dflash_train.model.target import FeatureTap

    target = _random_target("gemma3_text", sliding_window=4, rope_theta=10000.0)
    per_type = target.config.rope_parameters
    assert set(per_type) == {"full_attention", "sliding_attention"}
    config = drafter_hf_config(target.config, DrafterConfig(num_layers=1, block_size=4), (1, 3), 5)
    assert config.rope_parameters == per_type["full_attention"]
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    tap = FeatureTap(target, (1, 3))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    decoder, refused = evaluation_decoder(drafter, tap, embed, head, 64, cuda_graphs=True)
    assert isinstance(decoder, ReferenceDecoder), refused
    prompt = [3, 9, 11, 20, 7, 8]
    assert decoder.decode(prompt, 24, set()).tokens == _greedy(target, prompt, 24)


def test_a_target_the_fast_decode_refuses_is_evaluated_by_the_reference_path_losslessly():
    """A family whose forward the layer loop is not (or sliding-window layers) is refused,
    and the evaluator decodes it the reference way instead: still the target's greedy
    decode, the target alone and the speed-up included."""
    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.speculative import ReferenceDecoder, evaluate, evaluation_decoder
    from dflash_train.model.static_target import static_refusal
    from dflash_train.model.target import FeatureTap

    assert static_refusal(_random_target("qwen3").config) is None
    assert "sliding-window" in static_refusal(_random_target("qwen2", use_sliding_window=True, sliding_window=16,
                                                             max_window_layers=2).config)
    target = _random_target("gemma")
    drafter = DFlashDrafter(drafter_hf_config(target.config, DrafterConfig(num_layers=1, block_size=4), (1, 3), 5))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    tap = FeatureTap(target, (1, 3))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with pytest.raises(ValueError, match="'gemma'"):
        FastDecoder(drafter.eval(), tap, embed, head, 64)
    decoder, refused = evaluation_decoder(drafter, tap, embed, head, 64, cuda_graphs=True)
    assert isinstance(decoder, ReferenceDecoder) and "'gemma'" in refused
    prompt = [3, 9, 11, 20, 7, 8]
    greedy = _greedy(target, prompt, 24)
    assert decoder.decode(prompt, 24, set()).tokens == decoder.decode_alone(prompt, 24, set()).tokens == greedy
    assert evaluate(decoder, [prompt], 24, set(), speedup=True).speed.speedup > 0


@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=1, why="speculative decoding on CPU with the module's trained drafter")
def test_the_fast_decode_refuses_a_prompt_its_buffers_cannot_hold(trained):
    decoder = _fast(trained, capacity=32)
    with pytest.raises(ValueError, match="need 52 positions; the decoder holds 32"):
        decoder.decode(list(range(2, 14)), 32, set())
    with pytest.raises(ValueError, match="need 52 positions"):
        decoder.decode_alone(list(range(2, 14)), 32, set())


def test_decoding_ends_at_an_end_token_inside_an_accepted_block():
    """An end token accepted in the middle of a block ends the answer there, as in the
    reference benchmark: no further verify step is run or counted. The end token is the
    one the drafter drafts (_agreeing_drafter): its first occurrence in the target's
    greedy decode is an accepted draft, inside a block of several tokens."""
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.speculative import speculative_decode
    from dflash_train.model.target import FeatureTap

    target = _random_target("qwen3")
    prompt = [3, 9, 11, 20, 7, 8]
    greedy = _greedy(target, prompt, 48)
    drafter, stop = _agreeing_drafter(target, greedy)
    tap = FeatureTap(target, (1, 3))
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    free = speculative_decode(drafter, tap, embed, head, prompt, 48, set())
    assert free.tokens == greedy
    first = greedy.index(stop)
    starts = list(itertools.accumulate([1] + free.accepted[:-1]))  # each verify step's first token's index
    step = max(k for k, start in enumerate(starts) if start <= first)  # the step that gained it
    assert first < starts[step] + free.accepted[step] - 1, "the end token must be an accepted draft, not the bonus"
    assert step + 1 < len(free.accepted), "a verify step must follow it, for the end to leave that step out"
    ended = speculative_decode(drafter, tap, embed, head, prompt, 48, {stop})
    assert ended.tokens == greedy[:greedy.index(stop) + 1]
    assert ended.accepted == free.accepted[:step + 1]
    for overlap in (False, True):  # overlapped: the step launched past the end token is not counted
        fast = FastDecoder(drafter, tap, embed, head, 128, overlap=overlap)
        for _ in range(2):  # and what it moved does not reach the next decode
            decoded = fast.decode(prompt, 48, {stop})
            assert (decoded.tokens, decoded.accepted) == (ended.tokens, ended.accepted), overlap
            assert fast.decode_alone(prompt, 48, {stop}).tokens == ended.tokens, overlap


@pytest.mark.slow(seconds=1, why="speculative decoding on CPU with the module's trained drafter")
def test_acceptance_is_reported_pooled_and_as_the_mean_of_per_prompt_means(trained):
    from dflash_train.model.speculative import evaluate
    prompts = trained["prompts"][:3]
    result = evaluate(_fast(trained), prompts, 32, set())
    runs = [_decode(trained, p, 32).accepted for p in prompts]
    assert result.per_prompt == [sum(a) / len(a) for a in runs]
    assert result.mean_per_prompt == pytest.approx(sum(result.per_prompt) / len(prompts))
    assert result.acceptance_length == pytest.approx(sum(map(sum, runs)) / sum(map(len, runs)))
    assert result.verify_steps == sum(map(len, runs)) and result.prompts == 3
    assert result.speed is None and "speedup" not in result.fields(1.0)


@pytest.mark.slow(seconds=2, why="speculative decoding and the target alone on CPU with the module's trained drafter")
def test_the_speedup_is_the_target_alones_time_per_token_over_the_speculative_ones(trained):
    """As the reference benchmark reports it: each prompt's time per token after its
    prefill, averaged over prompts; tokens/s of both and their ratio, in the event's
    fields and the log line."""
    from dflash_train.model.speculative import evaluate
    prompts = trained["prompts"][:3]
    plain = evaluate(_fast(trained), prompts, 32, set())
    timed = evaluate(_fast(trained), prompts, 32, set(), speedup=True)
    assert timed.fields(1.0) == {**plain.fields(1.0), "tokens_per_s": round(timed.speed.tokens_per_s, 2),
                                 "target_tokens_per_s": round(timed.speed.target_tokens_per_s, 2),
                                 "speedup": round(timed.speed.speedup, 2)}
    assert timed.speed.tokens_per_s > 0 and timed.speed.target_tokens_per_s > 0
    assert timed.speed.speedup == pytest.approx(timed.speed.tokens_per_s / timed.speed.target_tokens_per_s)
    assert (f"target alone {timed.speed.target_tokens_per_s:.2f} tok/s, speculative {timed.speed.tokens_per_s:.2f} "
            f"tok/s, speedup {timed.speed.speedup:.2f}x") in timed.summary()


def _evaluate_config(drafter: Path) -> str:
    return _tiny_sections() + (f"job: evaluate\nevaluate: {{drafter: {json.dumps(str(drafter))}, "
                                "max_new_tokens: 32, num_prompts: 4}\n")


@pytest.mark.timeout(900)
@pytest.mark.slow(seconds=7, why="evaluate jobs on CPU, after the module's drafter is trained")
def test_evaluate_job_measures_our_export_and_a_foreign_format_drafter(trained, workspace, tmp_path):
    """`job: evaluate` on our export and on a copy written the way the reference
    checkpoints are (bf16 weights, block_size only at the top level, dflash_config with
    only mask_token_id and target_layer_ids): eval.json and the eval event carry both
    figures, the same as measured in this process."""
    from safetensors.torch import load_file, save_file

    from dflash_train.model.drafter import load_drafter
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.speculative import evaluate

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = json.loads((trained["export"] / "config.json").read_text())
    config["dflash_config"] = {k: config["dflash_config"][k] for k in ("mask_token_id", "target_layer_ids")}
    (foreign / "config.json").write_text(json.dumps(config))
    weights = load_file(str(trained["export"] / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(foreign / "model.safetensors"))

    for drafter_dir in (trained["export"], foreign):
        run_dir = tmp_path / f"eval-{drafter_dir.name}"
        job = start_trainer(workspace, run_dir, _evaluate_config(drafter_dir), run_dir.name)
        assert job.wait(400) == 0, job.log()[-3000:]
        log = job.log()
        written = json.loads((run_dir / "eval.json").read_text())
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        [event] = [e for e in events if e["type"] == "eval"]
        assert {k: event[k] for k in written} == written
        for each in events:
            dflash_contract.events.check(each)
        assert events[-1]["type"] == "done" and events[-1]["exit_code"] == 0
        drafter = load_drafter(drafter_dir).eval()
        decoder = FastDecoder(drafter, trained["tap"], trained["embed"], trained["head"], 256)
        expected = evaluate(decoder, trained["prompts"][:4], 32, trained["stop_ids"])
        assert written["prompts"] == 4
        assert written["acceptance_length"] == round(expected.acceptance_length, 4) > 1.0
        assert written["mean_per_prompt"] == round(expected.mean_per_prompt, 4)
        assert written["verify_steps"] == expected.verify_steps and written["drafter"] == str(drafter_dir)
        assert f"{expected.acceptance_length:.3f} (pooled), {expected.mean_per_prompt:.3f} (mean of per-prompt " \
               "means)" in log
        # evaluate.speedup is on by default: both speeds and their ratio, and in the log line
        assert written["tokens_per_s"] > 0 and written["target_tokens_per_s"] > 0 and written["speedup"] > 0
        assert written["cuda_graphs"] is False  # on the CPU
        assert (f"target alone {written['target_tokens_per_s']:.2f} tok/s, speculative "
                f"{written['tokens_per_s']:.2f} tok/s, speedup {written['speedup']:.2f}x") in log


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=1, why="an evaluate job on CPU")
def test_evaluate_job_names_a_folder_that_is_no_drafter(workspace, tmp_path):
    not_a_drafter = tmp_path / "empty"
    not_a_drafter.mkdir()
    (not_a_drafter / "config.json").write_text("{}")
    run_dir = tmp_path / "run"
    job = start_trainer(workspace, run_dir, _evaluate_config(not_a_drafter), run_dir.name)
    assert job.wait(250) == 1, job.log()[-3000:]
    [error] = job.errors()
    assert "evaluate.drafter" in error["message"] and str(not_a_drafter) in error["message"]
    assert not (run_dir / "eval.json").exists()


def test_the_config_says_what_an_evaluate_job_lacks(tmp_path):
    import dflash_schema
    cases = {
        "job: evaluate\ntarget: {path: t}\n": "evaluate: missing required key for job: evaluate",
        "job: evaluate\ntarget: {path: t}\nevaluate: {drafter: d}\n": "needs evaluate.prompts",
        "job: evaluate\ntarget: {tiny: {}}\nevaluate: {drafter: d}\n": "needs data.synthetic",
        "target: {path: t}\n": "data: missing required key for job: train",
        "target: {path: t}\ndata: {train: x}\nevaluate: {drafter: d}\n": "job: train does not read evaluate",
        "job: evaluate\ntarget: {path: t}\nevaluate: {drafter: d, prompts: p, max_new_tokens: 0}\n": "positive",
    }
    for text, message in cases.items():
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(dflash_schema.SchemaError, match=message):
            load_job_config(path)
    path.write_text("job: evaluate\ntarget: {path: t}\nevaluate: {drafter: d, prompts: p}\n")
    config = load_job_config(path)
    assert config.evaluate.max_new_tokens == 2048 and config.evaluate.num_prompts is None
    from dflash_cli.commands.launch import host_paths
    # launch has the host check the job's paths before it starts anything
    assert host_paths(config) == [("model", "target.path", "t"), ("model", "evaluate.drafter", "d"),
                                  ("file", "evaluate.prompts", "p")]


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=1, why="an evaluate job on CPU, stopped")
def test_sigterm_stops_an_evaluate_job_between_verify_steps(workspace, tmp_path):
    """A stopped evaluation exits 128+SIGTERM at its next verify step, with no eval.json."""
    import signal

    from transformers import AutoConfig

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config, export_drafter
    from dflash_train.data.tiny import ensure_tiny_assets

    spec = load_job_config(TINY_CPU)
    assets = ensure_tiny_assets(spec.target.tiny, spec.data.synthetic, workspace / "cache")
    target_config = AutoConfig.from_pretrained(str(assets.target_dir))
    drafter = DFlashDrafter(drafter_hf_config(target_config, DrafterConfig(num_layers=1, block_size=4), (1, 3), 4))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    export_drafter(drafter, tmp_path / "drafter")
    run_dir = tmp_path / "run"
    job = start_trainer(workspace, run_dir, _tiny_sections() + "job: evaluate\nevaluate: {drafter: %s, "
                        "max_new_tokens: 100000}\nruntime: {heartbeat_s: 0.2}\n" % json.dumps(str(tmp_path / "drafter")),
                        "run")
    events = run_dir / "events.jsonl"
    try:
        job.wait_for("the job to start decoding", lambda: events.exists() and '"type": "heartbeat"' in events.read_text(),
                     200)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(60) == 128 + signal.SIGTERM
    finally:
        end(job)
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert rows[-1]["type"] == "done" and rows[-1]["exit_code"] == 128 + signal.SIGTERM
    assert not [r for r in rows if r["type"] == "eval"] and not (run_dir / "eval.json").exists()
    assert (run_dir / "errors.jsonl").read_text() == ""


@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=3, why="speculative decoding on CPU with the module's trained drafter")
def test_steps_captured_before_a_decode_leave_it_lossless_and_are_captured_once(trained, monkeypatch):
    """The decode's CUDA-graph bookkeeping, on the CPU (support/graphs.py): `capture` makes
    the draft, verify and target-alone steps, each run as a capture's warm-up runs it,
    before any prefill; the decodes after it (prompts of other lengths, the buffers
    reused) take those steps and capture nothing more, with an uncaptured decoder's tokens
    and acceptance. A decoder not captured beforehand captures at its first decode, before
    its prefill, with the same outcome. That a replay is the eager step is the device's
    test (test_cuda_graphed_decode_is_the_eager_one_and_the_targets_greedy_decode_in_bf16)."""
    from dflash_train.model import fast_decode

    from support.graphs import run_as_captured

    prompts = trained["prompts"][:3] + [[2, 6] + [10 + i for i in range(12)] + [3, 2, 7], [2, 6]]
    plain = _fast(trained, cuda_graphs=False)
    captured = run_as_captured(monkeypatch, fast_decode)
    early, lazy = _fast(trained), _fast(trained)
    early.cuda_graphs = lazy.cuda_graphs = True
    early.capture()
    assert len(captured) == 3  # draft, verify, the target alone
    accepted = []
    for prompt in prompts:
        want, want_alone = plain.decode(prompt, 40, set()), plain.decode_alone(prompt, 40, set())
        assert want.tokens == want_alone.tokens
        for decoder in (early, lazy):
            got = decoder.decode(prompt, 40, set())
            assert (got.tokens, got.accepted) == (want.tokens, want.accepted)
            assert decoder.decode_alone(prompt, 40, set()).tokens == want.tokens
        accepted += want.accepted
    assert len(captured) == 6  # the lazy decoder's three at its first decodes; none after
    assert max(accepted) > 1, "the trained drafter must get drafts accepted, or the verify step's moves went unseen"


def test_a_step_is_graphed_on_cuda_only():
    from dflash_train.model.decode_graphs import graphed

    def step() -> None:
        raise AssertionError("graphed on the CPU must not run the step")

    assert graphed(step, torch.device("cpu")) is step


def _in_a_thread(work):
    """`work()` in a thread of its own, as the evaluator of a training run decodes."""
    import threading
    outcome = {}

    def body():
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=body, name="eval")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _near_tie(target, prompt: list[int], agreed: list[int], ours: int, theirs: int) -> bool:
    """Whether the target's logits after prompt + agreed put `ours` and `theirs` within
    2**-6 of the larger's magnitude (about two bf16 ulps): where a different kernel order
    may pick either (bench/eval_speed.py says the same of its decodes)."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + agreed], device=target.device)).logits[0, -1].float()
    a, b = float(logits[ours]), float(logits[theirs])
    return abs(a - b) <= 2 ** -6 * max(abs(a), abs(b), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(1800)  # the shipped config's run may be made in its setup
@pytest.mark.slow(seconds=40, why="the module's drafter trained on CPU, then decoded with CUDA graphs")
def test_cuda_graphed_decode_is_the_eager_one_and_the_targets_greedy_decode_in_bf16(trained):
    """The trained tiny drafter (fp32, as the training evaluator holds it) with the tiny
    target in bf16 on cuda:0: the graphed decode, captured and replayed in a thread of its
    own, gives exactly the eager decode's tokens and acceptance (the same kernels), and
    the target alone likewise; against `generate` in bf16 the tokens agree up to a first
    difference, if any, that is a near tie of the target's logits (_near_tie)."""
    from dflash_train.model.drafter import load_drafter
    from dflash_train.model.fast_decode import FastDecoder
    from dflash_train.model.target import FeatureTap, load_target

    target = load_target(str(trained["assets"].target_dir), "bfloat16", "cuda:0")
    drafter = load_drafter(trained["export"], "cuda:0").float().eval()
    tap = FeatureTap(target, drafter.target_layer_ids)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    graphed = FastDecoder(drafter, tap, embed, head, 256, cuda_graphs=True)
    eager = FastDecoder(drafter, tap, embed, head, 256, cuda_graphs=False)
    # Inductor's kernels round differently from eager ones: compared with generate, as below
    compiled = FastDecoder(drafter, tap, embed, head, 256, cuda_graphs=True, compile_steps=True)
    assert graphed.cuda_graphs and not eager.cuda_graphs and compiled.compiled
    accepted_any, exact = [], 0
    for prompt in trained["prompts"]:
        on = _in_a_thread(lambda: graphed.decode(prompt, 40, set()))
        off = eager.decode(prompt, 40, set())
        assert (on.tokens, on.accepted) == (off.tokens, off.accepted)
        alone = _in_a_thread(lambda: graphed.decode_alone(prompt, 40, set()))
        assert alone.tokens == eager.decode_alone(prompt, 40, set()).tokens
        greedy = _greedy_on(target, prompt, 40)
        fused = _in_a_thread(lambda: compiled.decode(prompt, 40, set()))
        fused_alone = _in_a_thread(lambda: compiled.decode_alone(prompt, 40, set()))
        for tokens in (on.tokens, alone.tokens, fused.tokens, fused_alone.tokens):
            first = next((i for i, (a, b) in enumerate(zip(tokens, greedy)) if a != b), None)
            if first is None:
                assert tokens == greedy
                exact += 1
            else:
                assert _near_tie(target, prompt, greedy[:first], tokens[first], greedy[first]), (prompt, first)
        accepted_any += on.accepted
    assert max(accepted_any) > 1, "the trained drafter must get drafts accepted, or nothing was compared"
    assert exact > 0, "every decode differed from generate: ties cannot explain that"


def _greedy_on(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt], device=target.device), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
