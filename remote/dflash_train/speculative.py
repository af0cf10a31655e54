"""Acceptance length by real block-draft-and-verify speculative decoding (greedy).

Per prompt: the target prefills and picks the first token; then, until max_new_tokens
or an end token, the drafter fills a block [last token, MASK...] from the target features
of every position before it, the target verifies the whole block in one forward, the
longest agreeing prefix is accepted plus the target's own next token (the bonus), and
the features of the accepted positions become context. Acceptance length = tokens gained
per verify forward. The output is exactly the target's greedy decode (lossless), which
the tests check.

The target is re-run over the whole sequence at each verify (no KV cache): slower, but it
depends on no cache API of a particular transformers release, and the acceptance
length, the quantity measured here, is the same.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from .model import DFlashDrafter
from .objective import dense_block_mask
from .target import FeatureTap


@dataclasses.dataclass(frozen=True)
class Decoded:
    tokens: list[int]  # the new tokens
    accepted: list[int]  # tokens gained per verify forward (1 = only the bonus token)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    acceptance_length: float  # mean tokens per verify forward over all prompts
    per_prompt: list[float]
    verify_steps: int
    new_tokens: int


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


@torch.inference_mode()
def speculative_decode(drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor, prompt: list[int], max_new_tokens: int,
                       stop_ids: set[int], on_step: Callable[[], None] = lambda: None) -> Decoded:
    """`on_step` runs after every verify forward (progress reports; it may raise to stop).
    `lm_head_weight` should have the drafter's dtype (`evaluate` casts it once); another
    dtype is cast for every drafted block."""
    device = embed_weight.device
    logits, features = tap.logits_and_features(torch.tensor([prompt], device=device))
    tokens = [int(logits[0, -1].argmax())]
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        start = len(prompt) + len(tokens) - 1  # position of the newest token: the anchor
        draft = draft_block(drafter, embed_weight, lm_head_weight, features[:, :start], tokens[-1])
        sequence = torch.tensor([prompt + tokens + draft], device=device)
        logits, features = tap.logits_and_features(sequence)
        verdict = logits[0, start:start + len(draft) + 1].argmax(-1).tolist()  # target's choice after each
        agree = 0
        while agree < len(draft) and draft[agree] == verdict[agree]:
            agree += 1
        gained = draft[:agree] + [verdict[agree]]
        accepted.append(len(gained))
        tokens += gained
        on_step()
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_ids:
            tokens = tokens[:i + 1]
            break
    return Decoded(tokens, accepted)


def evaluate(drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
             prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
             on_step: Callable[[], None] = lambda: None) -> EvalResult:
    # The head in the drafter's dtype once per evaluation, not per prompt or drafted block: a
    # bf16 (V, H) head cast to an fp32 drafter's dtype is a copy the size of the head.
    lm_head_weight = lm_head_weight.to(drafter.norm.weight.dtype)
    per_prompt, steps, new_tokens = [], 0, 0
    for prompt in prompts:
        decoded = speculative_decode(drafter, tap, embed_weight, lm_head_weight, prompt, max_new_tokens, stop_ids,
                                     on_step)
        if decoded.accepted:
            per_prompt.append(sum(decoded.accepted) / len(decoded.accepted))
        steps += len(decoded.accepted)
        new_tokens += sum(decoded.accepted)
    return EvalResult(acceptance_length=new_tokens / steps if steps else 0.0, per_prompt=per_prompt,
                      verify_steps=steps, new_tokens=new_tokens)
