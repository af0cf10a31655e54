"""The next token of many sequences at once: greedy, or sampled with noise keyed per prompt.

A batched decode refills a finished sequence's row with the next prompt, so which rows a
prompt shares its steps with depends on the batch size, the devices and where a resumed
job starts. For its sampled answers to depend on none of that, the randomness of prompt
i's t-th token is a function of (seed, i, t) alone: Gumbel noise from a counter-based
hash of (seed, i, t, vocabulary id), added to the filtered, temperature-scaled logits;
the argmax of the sum is a draw from their softmax (the Gumbel-max trick). The filters
are transformers' warpers in their order: temperature, top-k, then top-p (the smallest
set of most likely tokens whose mass reaches top_p, the most likely always kept).

Every operation is a tensor operation of fixed shape, so a decode step's CUDA graph holds
the choice too; the hash keeps its 32-bit values in int64 and multiplies in 16-bit halves,
so nothing overflows on any device.
"""
from __future__ import annotations

import torch

from ..config import SamplingConfig

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2**32, for x in [0, 2**32): every product stays below 2**49."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (murmur3's finalizer) of x in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def stream_keys(seed: int, index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One key per (prompt index, token step) under `seed`: (N,) int64 in [0, 2**32)."""
    key = mix32(((index & MASK32) ^ mix32(torch.full_like(index, seed & MASK32))))
    return mix32(key ^ mix32((step + GOLDEN) & MASK32))


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise (N, K) in fp32 for keys (N,) and vocabulary ids (N, K) or (K,)."""
    bits = mix32(keys.unsqueeze(-1) ^ mix32(token_ids & MASK32))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(uniform))


class Chooser:
    """`choose(logits (N, V), index (N,), step (N,)) -> (N,)`: the tokens picked."""

    def __init__(self, sampling: SamplingConfig | None, vocab_size: int, device: torch.device):
        self.sampling = sampling
        self.vocab = torch.arange(vocab_size, device=device)

    def choose(self, logits: torch.Tensor, index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        sampling = self.sampling
        if sampling is None:
            return logits.argmax(-1)
        scores = logits.to(torch.float32) / sampling.temperature
        if sampling.top_k:  # the k best, most likely first
            scores, ids = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1)
        elif sampling.top_p < 1.0:
            scores, ids = scores.sort(dim=-1, descending=True)
        else:
            ids = self.vocab
        if sampling.top_p < 1.0:
            probs = scores.softmax(-1)
            before = probs.cumsum(-1) - probs  # the mass of the more likely tokens
            scores = scores.masked_fill(before >= sampling.top_p, float("-inf"))
        noise = gumbel(stream_keys(sampling.seed, index, step), ids)
        best = (scores + noise).argmax(-1, keepdim=True)
        if ids.dim() == 1:
            return best.squeeze(-1)
        return ids.gather(-1, best).squeeze(-1)
