"""Acceptance length by real block-draft-and-verify speculative decoding (greedy).

Per prompt: the target prefills and picks the first token; then, until max_new_tokens
or an end token, the drafter fills a block [last token, MASK...] from the target features
of every position before it, the target verifies the whole block in one forward, the
longest agreeing prefix is accepted plus the target's own next token (the bonus), and
the features of the accepted positions become context. The output is exactly the
target's greedy decode (lossless), which the tests check.

Verification keeps the target's KV cache (a transformers DynamicCache): the prompt is
prefilled once, each verify forward runs only the block's positions, and the cache is
cut back to the accepted length after it (the rejected drafts' entries dropped). The
tapped features of a verify forward then cover only the block, and the accepted ones
are appended to the drafter's context. `kv_cache=False` re-runs the target over the
whole sequence at every verify instead: the same tokens and acceptance, for comparison
(tests, bench/eval_kv.py). The drafter re-projects its whole context at each block, as
the training forward does (no drafter cache).

Acceptance, counted as the reference benchmark (z-lab/dflash `benchmark.py`) counts it:
each verify forward gains the accepted drafts plus the bonus token (1 = no draft
accepted); the first token, from the prefill, belongs to no verify forward. Two means:
`acceptance_length`, all tokens gained over all verify forwards of all prompts
(pooled: long answers weigh more), and `mean_per_prompt`, each prompt's own mean
averaged over the prompts (the reference's "Average Acceptance length"). Decoding ends
at the first end token, wherever it lands in a gained block, as the reference's does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .drafter import DFlashDrafter
from .objective import dense_block_mask
from .target import FeatureTap


@dataclasses.dataclass(frozen=True)
class Decoded:
    tokens: list[int]  # the new tokens
    accepted: list[int]  # tokens gained per verify forward (1 = only the bonus token)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    acceptance_length: float  # tokens per verify forward, pooled over all prompts
    mean_per_prompt: float  # the mean of per_prompt (the reference benchmark's figure)
    per_prompt: list[float]  # each prompt's tokens per verify forward (prompts with none left out)
    verify_steps: int
    new_tokens: int
    prompts: int

    def fields(self, seconds: float) -> dict[str, Any]:
        """The figures as an "eval" event and eval.json carry them."""
        return {"acceptance_length": round(self.acceptance_length, 4),
                "mean_per_prompt": round(self.mean_per_prompt, 4),
                "per_prompt": [round(x, 4) for x in self.per_prompt], "prompts": self.prompts,
                "verify_steps": self.verify_steps, "new_tokens": self.new_tokens, "seconds": round(seconds, 3)}

    def summary(self) -> str:
        return (f"acceptance length {self.acceptance_length:.3f} (pooled), {self.mean_per_prompt:.3f} "
                f"(mean of per-prompt means)")


@torch.inference_mode()
def draft_block(drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                features: torch.Tensor, anchor_token: int) -> list[int]:
    """Draft block_size-1 tokens after `anchor_token`; features (1, start, n*H) cover the
    positions before the anchor, which sits at position `start`."""
    block_size, start = drafter.block_size, features.shape[1]
    device = features.device
    block = torch.full((1, block_size), drafter.mask_token_id, dtype=torch.long, device=device)
    block[0, 0] = anchor_token
    anchors = torch.tensor([[start]], device=device)
    mask = dense_block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), start, block_size)
    hidden = drafter(F.embedding(block, embed_weight), features,
                     torch.arange(start, device=device).unsqueeze(0),
                     (start + torch.arange(block_size, device=device)).unsqueeze(0), mask)
    logits = F.linear(hidden[0, 1:], lm_head_weight.to(hidden.dtype))  # (bs-1, V)
    return logits.argmax(-1).tolist()


def _drop_last(cache: Any, count: int) -> None:
    """Drop the cache's last `count` positions. A negative argument to crop means "this
    many fewer" under transformers 4.x and 5.x alike (5.x refuses a positive one, 4.x
    reads it as the length to keep); crop(0) would empty a 4.x cache, hence the guard."""
    if count:
        cache.crop(-count)


@torch.inference_mode()
def speculative_decode(drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor, prompt: list[int], max_new_tokens: int,
                       stop_ids: set[int], on_step: Callable[[], None] = lambda: None,
                       kv_cache: bool = True) -> Decoded:
    """`on_step` runs after every verify forward (progress reports; it may raise to stop).
    `lm_head_weight` should have the drafter's dtype (`evaluate` casts it once); another
    dtype is cast for every drafted block."""
    device = embed_weight.device
    cache = DynamicCache() if kv_cache else None
    logits, context = tap.logits_and_features(torch.tensor([prompt], device=device), cache)
    tokens = [int(logits[0, -1].argmax())]
    del logits  # (1, prompt, V): not kept through the decode
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        start = len(prompt) + len(tokens) - 1  # position of the newest token: the anchor
        draft = draft_block(drafter, embed_weight, lm_head_weight, context, tokens[-1])
        if cache is not None:
            logits, features = tap.logits_and_features(torch.tensor([tokens[-1:] + draft], device=device), cache)
        else:
            logits, features = tap.logits_and_features(torch.tensor([prompt + tokens + draft], device=device))
            logits, features = logits[:, start:], features[:, start:]
        verdict = logits[0].argmax(-1).tolist()  # the target's choice after each block position
        agree = 0
        while agree < len(draft) and draft[agree] == verdict[agree]:
            agree += 1
        gained = draft[:agree] + [verdict[agree]]
        accepted.append(len(gained))
        # The anchor and the accepted drafts are now context; the bonus is the next anchor.
        context = torch.cat([context, features[:, :agree + 1]], dim=1)
        if cache is not None:
            _drop_last(cache, len(draft) - agree)
        stop = next((i for i, token in enumerate(gained) if token in stop_ids), None)
        tokens += gained if stop is None else gained[:stop + 1]
        on_step()
    return Decoded(tokens[:max_new_tokens], accepted)


def evaluate(drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
             prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
             on_step: Callable[[], None] = lambda: None, kv_cache: bool = True) -> EvalResult:
    # The head in the drafter's dtype once per evaluation, not per prompt or drafted block: a
    # bf16 (V, H) head cast to an fp32 drafter's dtype is a copy the size of the head.
    lm_head_weight = lm_head_weight.to(drafter.norm.weight.dtype)
    per_prompt, steps, new_tokens = [], 0, 0
    for prompt in prompts:
        decoded = speculative_decode(drafter, tap, embed_weight, lm_head_weight, prompt, max_new_tokens, stop_ids,
                                     on_step, kv_cache)
        if decoded.accepted:
            per_prompt.append(sum(decoded.accepted) / len(decoded.accepted))
        steps += len(decoded.accepted)
        new_tokens += sum(decoded.accepted)
    return EvalResult(acceptance_length=new_tokens / steps if steps else 0.0,
                      mean_per_prompt=sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
                      per_prompt=per_prompt, verify_steps=steps, new_tokens=new_tokens,
                      prompts=len(prompts))
