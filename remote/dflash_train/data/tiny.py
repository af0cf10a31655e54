"""The tiny CPU path: a random-weight Qwen3 target, its tokenizer and synthetic data.

Everything is made locally (no download) and cached under a key that hashes the spec:
$DFLASH_WORKSPACE/cache/<key> when set, else <run-dir>/cache/<key>. The cache entry is
built in a temp dir and moved in with os.replace, so concurrent runs never see half of
one; the loser of a race discards its copy.

The data is what makes the drafter learnable: responses are the target's own greedy
continuations of random prompts, so a drafter that predicts the target well has a long
acceptance length in greedy speculative decoding.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..config import SyntheticDataSpec, TinyTargetSpec
from ..runlog import say

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
ROLE_WORDS = ("system", "user", "assistant")
# The shape of Qwen's ChatML, on a whitespace-split word vocabulary.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
_LAYOUT_VERSION = 2  # bump when what is built for a spec changes


@dataclasses.dataclass(frozen=True)
class TinyAssets:
    target_dir: Path  # model + tokenizer, loadable with from_pretrained
    train_path: Path
    eval_path: Path


# The synthetic data a tiny target is built with when a job brings no data.synthetic of its
# own (job: regenerate, or training on a data.train file): the small spec the trainer's CPU
# tests use too, so they all share one cache entry and so one target.
TARGET_DATA = SyntheticDataSpec(num_train=64, num_eval=2)


def ensure_tiny_assets(spec: TinyTargetSpec, data: SyntheticDataSpec, root: Path) -> TinyAssets:
    blob = json.dumps({"v": _LAYOUT_VERSION, "target": dataclasses.asdict(spec),
                       "data": dataclasses.asdict(data)}, sort_keys=True)
    entry = root / f"tiny-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    if not (entry / "spec.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=root))
        building.chmod(0o755)  # shared by every run of the workspace
        say(f"building the tiny target and synthetic data in {entry}")
        try:
            _build(spec, data, building)
            (building / "spec.json").write_text(blob + "\n")
            os.replace(building, entry)
        except OSError:
            if not (entry / "spec.json").exists():
                raise
            say(f"another run built {entry} first; using it")  # we lost the race
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return TinyAssets(entry / "target", entry / "train.jsonl", entry / "eval.jsonl")


def _build_tokenizer(spec: TinyTargetSpec):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(SPECIAL_TOKENS) + list(ROLE_WORDS) + [f"w{i}" for i in range(spec.vocab_words)]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>", eos_token="<|im_end|>",
        mask_token="<|MASK|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(spec: TinyTargetSpec, vocab_size: int, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, max_position_embeddings=4096,
        initializer_range=spec.init_std, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(spec.seed)
    return Qwen3ForCausalLM(config)


def _build(spec: TinyTargetSpec, data: SyntheticDataSpec, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = out / "target"
    tokenizer = _build_tokenizer(spec)
    # Not model.save_pretrained: under torch.distributed, transformers writes only on rank 0,
    # and every host of a run on several hosts builds the tiny target in its own workspace.
    model = _build_model(spec, len(tokenizer), tokenizer)
    model.config.architectures = [type(model).__name__]  # what save_pretrained records
    model.config.dtype = next(model.parameters()).dtype
    model.config.save_pretrained(str(staging))
    model.generation_config.save_pretrained(str(staging))
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(staging / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(staging))
    # Generate with what from_pretrained gives back: the data must match the saved target.
    model = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    generator = torch.Generator().manual_seed(data.seed)
    total = data.num_train + data.num_eval
    word_ids = torch.randint(0, spec.vocab_words, (total, data.prompt_words), generator=generator)
    prompts = [" ".join(f"w{i}" for i in row.tolist()) for row in word_ids]
    responses = _greedy_responses(model, tokenizer, prompts, data.response_tokens)
    with open(out / "train.jsonl", "w", encoding="utf-8") as f:
        for prompt, (response, truncated) in zip(prompts[:data.num_train], responses[:data.num_train]):
            row = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]}
            if truncated:  # cut at response_tokens: the target never closed this answer
                row["truncated"] = True
            f.write(json.dumps(row) + "\n")
    with open(out / "eval.jsonl", "w", encoding="utf-8") as f:
        for prompt in prompts[data.num_train:]:
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")


@torch.inference_mode()
def _greedy_responses(model, tokenizer, prompts: list[str], max_tokens: int) -> list[tuple[str, bool]]:
    """The target's greedy continuation of every prompt, up to <|im_end|> (excluded), and
    whether it was cut at `max_tokens` before the target ended it."""
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in prompts]
    ids = torch.tensor([tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered])  # (N, P)
    prompt_len = ids.shape[1]  # all prompts have the same length, so no padding is needed
    ids = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    responses = []
    for row in ids[:, prompt_len:].tolist():
        truncated = tokenizer.eos_token_id not in row
        if not truncated:
            row = row[:row.index(tokenizer.eos_token_id)]
        responses.append((" ".join(tokenizer.convert_ids_to_tokens(row)), truncated))
    return responses
