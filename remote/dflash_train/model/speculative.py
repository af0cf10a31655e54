"""Acceptance length by real block-draft-and-verify speculative decoding (greedy).

Per prompt: the target prefills and picks the first token; then, until max_new_tokens
or an end token, the drafter fills a block [last token, MASK...] from the target features
of every position before it, the target verifies the whole block in one forward, the
longest agreeing prefix is accepted plus the target's own next token (the bonus), and
the features of the accepted positions become context. The output is exactly the
target's greedy decode (lossless), which the tests check.

Two paths decode this way. `evaluate` (the evaluator of training runs, `job: evaluate`)
runs the fast one, model/fast_decode.py: static KV caches, the drafter's context keys
and values kept, CUDA graphs on CUDA. `speculative_decode` here is the reference the
tests hold it to: the target keeps a transformers DynamicCache (the prompt prefilled
once, each verify forward runs only the block's positions, the cache cut back to the
accepted length after it), or with `kv_cache=False` re-runs the whole sequence at every
verify; its drafter re-projects the whole context at each block, as the training forward
does.

Acceptance, counted as the reference benchmark (z-lab/dflash `benchmark.py`) counts it:
each verify forward gains the accepted drafts plus the bonus token (1 = no draft
accepted); the first token, from the prefill, belongs to no verify forward. Two means:
`acceptance_length`, all tokens gained over all verify forwards of all prompts
(pooled: long answers weigh more), and `mean_per_prompt`, each prompt's own mean
averaged over the prompts (the reference's "Average Acceptance length"). Decoding ends
at the first end token, wherever it lands in a gained block, as the reference's does.

The speed-up (`evaluate(..., speedup=True)`), as the reference benchmark prints it: each
prompt is decoded again by the target alone through the same fast path (static cache,
graphs, greedy, one token a forward); each decode's time per token after its prefill is
averaged over the prompts; tokens/s is one over that mean, and the speed-up the target
alone's mean over the speculative one.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from transformers import DynamicCache

from .drafter import DFlashDrafter
from .fast_decode import Decoded, FastDecoder, accepted_length, draft_tokens, synchronize
from .static_target import static_refusal
from .target import FeatureTap


@dataclasses.dataclass(frozen=True)
class Speed:
    """Decode speed as the reference benchmark reports it: each prompt's time per output
    token (after its prefill), averaged over the prompts, inverted; the speed-up is the
    target-alone mean over the speculative mean."""
    tokens_per_s: float  # speculative decoding
    target_tokens_per_s: float  # the target alone
    speedup: float


@dataclasses.dataclass(frozen=True)
class EvalResult:
    acceptance_length: float  # tokens per verify forward, pooled over all prompts
    mean_per_prompt: float  # the mean of per_prompt (the reference benchmark's figure)
    per_prompt: list[float]  # each prompt's tokens per verify forward (prompts with none left out)
    verify_steps: int
    new_tokens: int
    prompts: int
    speed: Speed | None = None  # when asked for (evaluate's `speedup`)
    # seconds per token after the prefill, per prompt timed: speculative, the target alone
    spec_times: list[float] = dataclasses.field(default_factory=list)
    alone_times: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, per_prompt: list[float], verify_steps: int, new_tokens: int, prompts: int,
           spec_times: list[float], alone_times: list[float], speedup: bool) -> "EvalResult":
        speed = None
        if speedup and spec_times:
            spec, base = _mean(spec_times), _mean(alone_times)
            speed = Speed(tokens_per_s=1 / spec, target_tokens_per_s=1 / base, speedup=base / spec)
        return cls(acceptance_length=new_tokens / verify_steps if verify_steps else 0.0,
                   mean_per_prompt=_mean(per_prompt), per_prompt=per_prompt, verify_steps=verify_steps,
                   new_tokens=new_tokens, prompts=prompts, speed=speed, spec_times=spec_times,
                   alone_times=alone_times)

    @classmethod
    def pooled(cls, parts: list["EvalResult"], speedup: bool) -> "EvalResult":
        """One result of several hosts' shares of the prompts, as if one had decoded them all."""
        return cls.of([x for p in parts for x in p.per_prompt], sum(p.verify_steps for p in parts),
                      sum(p.new_tokens for p in parts), sum(p.prompts for p in parts),
                      [x for p in parts for x in p.spec_times], [x for p in parts for x in p.alone_times], speedup)

    def shared(self) -> dict[str, Any]:
        """What another host needs to pool this result (JSON)."""
        return {"per_prompt": self.per_prompt, "verify_steps": self.verify_steps, "new_tokens": self.new_tokens,
                "prompts": self.prompts, "spec_times": self.spec_times, "alone_times": self.alone_times}

    def fields(self, seconds: float) -> dict[str, Any]:
        """The figures as an "eval" event and eval.json carry them."""
        fields = {"acceptance_length": round(self.acceptance_length, 4),
                  "mean_per_prompt": round(self.mean_per_prompt, 4),
                  "per_prompt": [round(x, 4) for x in self.per_prompt], "prompts": self.prompts,
                  "verify_steps": self.verify_steps, "new_tokens": self.new_tokens, "seconds": round(seconds, 3)}
        if self.speed is not None:
            fields.update(tokens_per_s=round(self.speed.tokens_per_s, 2),
                          target_tokens_per_s=round(self.speed.target_tokens_per_s, 2),
                          speedup=round(self.speed.speedup, 2))
        return fields

    def summary(self) -> str:
        text = (f"acceptance length {self.acceptance_length:.3f} (pooled), {self.mean_per_prompt:.3f} "
                f"(mean of per-prompt means)")
        if self.speed is not None:
            text += (f"; target alone {self.speed.target_tokens_per_s:.2f} tok/s, speculative "
                     f"{self.speed.tokens_per_s:.2f} tok/s, speedup {self.speed.speedup:.2f}x")
        return text


@torch.inference_mode()
def draft_block(drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                features: torch.Tensor, anchor_token: int) -> list[int]:
    """Draft block_size-1 tokens after `anchor_token`; features (1, start, n*H) cover the
    positions before the anchor, which sits at position `start`."""
    block = torch.full((1, drafter.block_size), drafter.mask_token_id, dtype=torch.long, device=features.device)
    block[0, 0] = anchor_token
    return draft_tokens(drafter, embed_weight, lm_head_weight, features, block).tolist()


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
    `lm_head_weight` should have the drafter's dtype (FastDecoder casts its own once); another
    dtype is cast for every drafted block."""
    device = embed_weight.device
    cache = DynamicCache() if kv_cache else None
    logits, context = tap.logits_and_features(torch.tensor([prompt], device=device), cache)
    tokens = [int(logits[0, -1].argmax())]
    del logits  # (1, prompt, V): not kept through the decode
    accepted: list[int] = []
    started = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        start = len(prompt) + len(tokens) - 1  # position of the newest token: the anchor
        draft = draft_block(drafter, embed_weight, lm_head_weight, context, tokens[-1])
        if cache is not None:
            logits, features = tap.logits_and_features(torch.tensor([tokens[-1:] + draft], device=device), cache)
        else:
            logits, features = tap.logits_and_features(torch.tensor([prompt + tokens + draft], device=device))
            logits, features = logits[:, start:], features[:, start:]
        verdict = logits[0].argmax(-1).tolist()  # the target's choice after each block position
        agree = accepted_length(draft, verdict)
        gained = draft[:agree] + [verdict[agree]]
        accepted.append(len(gained))
        # The anchor and the accepted drafts are now context; the bonus is the next anchor.
        context = torch.cat([context, features[:, :agree + 1]], dim=1)
        if cache is not None:
            _drop_last(cache, len(draft) - agree)
        stop = next((i for i, token in enumerate(gained) if token in stop_ids), None)
        tokens += gained if stop is None else gained[:stop + 1]
        on_step()
    synchronize(device)
    return Decoded(tokens[:max_new_tokens], accepted, time.perf_counter() - started)


class ReferenceDecoder:
    """FastDecoder's interface over the reference path (transformers' DynamicCache, eager,
    no drafter cache): what the evaluator decodes with for a target whose forward the fast
    decode's layer loop is not (static_target.static_refusal)."""

    cuda_graphs = False
    compiled = False

    def __init__(self, drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor):
        self.drafter, self.tap, self.embed = drafter, tap, embed_weight
        self.head = lm_head_weight.to(drafter.fc.weight.dtype)
        self.block_size = drafter.block_size

    def capture(self, alone: bool = True) -> None:
        """Nothing to capture: the reference path runs eagerly."""

    def decode(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
               on_step: Callable[[], None] = lambda: None) -> Decoded:
        return speculative_decode(self.drafter, self.tap, self.embed, self.head, prompt, max_new_tokens, stop_ids,
                                  on_step)

    @torch.inference_mode()
    def decode_alone(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                     on_step: Callable[[], None] = lambda: None) -> Decoded:
        """The target's greedy decode with its DynamicCache, one token a forward."""
        device, cache = self.embed.device, DynamicCache()
        logits, _ = self.tap.logits_and_features(torch.tensor([prompt], device=device), cache)
        tokens = [int(logits[0, -1].argmax())]
        started = time.perf_counter()
        while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
            logits, _ = self.tap.logits_and_features(torch.tensor([tokens[-1:]], device=device), cache)
            tokens.append(int(logits[0, -1].argmax()))
            on_step()
        return Decoded(tokens, [], time.perf_counter() - started)


def evaluation_decoder(drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor,
                       lm_head_weight: torch.Tensor, capacity: int,
                       cuda_graphs: bool, compile_steps: bool = False, fuse: bool = False
                       ) -> tuple[FastDecoder | ReferenceDecoder, str | None]:
    """The fast decoder for `capacity` positions, or the reference one and why not.
    `compile_steps` applies on CUDA only, as the graphs do; `fuse` (fast_layers.
    fuse_projections) only for a target no other thread runs."""
    if problem := static_refusal(tap.model.config):
        return ReferenceDecoder(drafter, tap, embed_weight, lm_head_weight), problem
    return FastDecoder(drafter, tap, embed_weight, lm_head_weight, capacity, cuda_graphs=cuda_graphs,
                       compile_steps=compile_steps and embed_weight.device.type == "cuda", fuse=fuse), None


def _time_per_token(decoded: Decoded) -> float | None:
    """Seconds per token decoded after the prefill's first one (None: it decoded none)."""
    return decoded.seconds / (len(decoded.tokens) - 1) if len(decoded.tokens) > 1 else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def evaluate(decoder: FastDecoder | ReferenceDecoder, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
             on_step: Callable[[], None] = lambda: None, speedup: bool = False,
             on_target_step: Callable[[], None] | None = None) -> EvalResult:
    """Acceptance over `prompts`, decoded by `decoder` (the fast path); `on_step` after
    every verify step. With `speedup`, every prompt is also decoded by the target alone
    (`on_target_step` after each of its forwards; default `on_step`), and both are timed:
    a warm-up of each (its CUDA graphs captured) on the first prompt comes first."""
    if speedup and prompts:
        decoder.decode(prompts[0], min(max_new_tokens, 2 * decoder.block_size), stop_ids)
        decoder.decode_alone(prompts[0], min(max_new_tokens, 8), stop_ids)
    per_prompt, steps, new_tokens, spec_times, alone_times = [], 0, 0, [], []
    for prompt in prompts:
        decoded = decoder.decode(prompt, max_new_tokens, stop_ids, on_step)
        if decoded.accepted:
            per_prompt.append(sum(decoded.accepted) / len(decoded.accepted))
        steps += len(decoded.accepted)
        new_tokens += sum(decoded.accepted)
        if speedup:
            alone = decoder.decode_alone(prompt, max_new_tokens, stop_ids, on_target_step or on_step)
            spec, base = _time_per_token(decoded), _time_per_token(alone)
            if spec is not None and base is not None:
                spec_times.append(spec)
                alone_times.append(base)
    return EvalResult.of(per_prompt, steps, new_tokens, len(prompts), spec_times, alone_times, speedup)
