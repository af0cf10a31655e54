"""The DFlash drafter's layers, and the Hugging Face model class shipped with every export.

This file is copied next to an export's config.json, whose `auto_map` names
`DFlashDraftModel`, so `AutoModel.from_pretrained(export, trust_remote_code=True)` builds
the drafter from the very code that trained it. It must therefore import only torch,
transformers and the standard library (no package-relative imports), and work under
transformers 4.57 and 5.x: it uses only Qwen3 building blocks both versions have.

The drafter: hidden states of a few target layers are concatenated, projected by a
bias-free linear (`fc`) and RMS-normalised (`hidden_norm`). In every layer the queries come
from the block tokens only, while keys and values are the same k_proj/v_proj applied to
[context features ; block tokens]. Module names match the public DFlash inference code
(z-lab/dflash `DFlashDraftModel`), so its state dict loads there unchanged too.

The cached path (`context_cache`, `extend_context`, `draft_cached`) decodes without
re-projecting the context: its keys and values are projected once per accepted position
into per-layer buffers, and a drafted block attends to them plus its own, the same
computation as `draft` over the whole context (keys and values are per-position: k_norm
and RoPE act on each row alone). An export's users can decode with it; the evaluator's
decode computes the same as functions of the weights (fast_drafter.py), held to it by the
tests. Training runs `draft`, which this path leaves untouched.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen3's RoPE for one tensor. transformers' apply_rotary_pos_emb rotates q and k at
    the same positions; here queries (block) and keys (context + block) differ in length."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with an explicit mask and grouped key/value heads.

    q (B, h, Q, d); k, v (B, hk, S+Q, d); mask bool (B, 1, Q, S+Q) -> (B, h, Q, d).
    The kv heads are repeated up to the query heads here, in the grouping enable_gqa=True
    applies (query head i reads kv head i // (h // hk)). On CUDA, SDPA's flash kernel
    takes grouped heads but no mask and its memory-efficient kernel a mask but no grouped
    heads: given both, SDPA falls back to the math kernel, which materializes the scores
    in fp32 (measured, bench/RESULTS-h200.md). Repeated heads cost (B, h, S+Q, d) twice."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """SDPA of q (B, h, Q, d) over k, v (B, hk, C, d) where every query sees the keys that
    `key_valid` (B, 1, 1, C) marks. The query heads that share a kv head become one longer
    query (the grouping enable_gqa applies: head i reads kv head i // (h // hk)), so the
    keys are read once, not repeated per query head, and SDPA takes the mask with a
    memory-efficient kernel on CUDA."""
    batch, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, (heads // kv_heads) * q_len, dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=key_valid)
    return out.reshape(batch, heads, q_len, dim)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, block: torch.Tensor, context: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_k: tuple[torch.Tensor, torch.Tensor], mask: Any) -> torch.Tensor:
        # block (B, Q, H); context (B, S, H); rope_q (B, Q, d) x2; rope_k (B, S+Q, d) x2
        batch, q_len, _ = block.shape
        kv_len = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(block).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(block)], dim=1)
        k = self.k_norm(k.view(batch, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = torch.cat([self.v_proj(context), self.v_proj(block)], dim=1)
        v = v.view(batch, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, *rope_q), _rotate(k, *rope_k)  # q (B, h, Q, d); k, v (B, hk, S+Q, d)
        if isinstance(mask, torch.Tensor):
            out = dense_attention(q, k, v, mask)
        else:  # a FlexAttention BlockMask
            from torch.nn.attention.flex_attention import flex_attention
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))

    def keys_values(self, states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """states (B, S, H) -> keys (B, hk, S, d), normalised and rotated, and values: what
        `forward` attends to for these positions."""
        batch, length, _ = states.shape
        k = self.k_norm(self.k_proj(states).view(batch, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(states).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, *rope), v

    def cached(self, block: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
               values: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """`forward` with the context's keys and values already in `keys`, `values` (B, hk, C, d):
        the block's own are written at `positions` (Q,), then the block attends to what
        `key_valid` (B, 1, 1, C) marks (the context and the block)."""
        batch, q_len, _ = block.shape
        q = self.q_norm(self.q_proj(block).view(batch, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k, v = self.keys_values(block, rope)
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        out = grouped_attention(_rotate(q, *rope), keys, values, key_valid)
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope_q, rope_k, mask) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope_q, rope_k, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def cached(self, hidden: torch.Tensor, rope, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               key_valid: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn.cached(self.input_layernorm(hidden), rope, keys, values, positions, key_valid)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashModules:
    """The drafter's modules and its computation, shared by the trainer's plain module and
    the Hugging Face class below (one definition, so the export runs what was trained)."""

    def build_modules(self, config: Qwen3Config) -> None:
        dflash = config.dflash_config
        self.target_layer_ids = tuple(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(dflash["block_size"])
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def draft(self, block_embeds: torch.Tensor, features: torch.Tensor, context_positions: torch.Tensor,
              block_positions: torch.Tensor, mask: Any) -> torch.Tensor:
        # block_embeds (B, Q, H): target embeddings of [anchor, MASK...] per block
        # features (B, S, n*H): concatenated target layer outputs; positions (B, S) and (B, Q)
        # mask: bool (B, 1, Q, S+Q), True = may attend, or a FlexAttention BlockMask
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # (B, S, H)
        hidden = block_embeds.to(context.dtype)
        cos, sin = self.rotary_emb(hidden, torch.cat([context_positions, block_positions], dim=1))
        q_len = block_positions.shape[1]
        rope_q, rope_k = (cos[:, -q_len:], sin[:, -q_len:]), (cos, sin)
        for layer in self.layers:
            hidden = layer(hidden, context, rope_q, rope_k, mask)
        return self.norm(hidden)  # (B, Q, H)

    def context_cache(self, capacity: int, batch: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed keys and values (B, hk, capacity, d) per layer, for positions 0..capacity-1
        of context and block, on the drafter's device and in its dtype."""
        attention = self.layers[0].self_attn
        shape = (batch, attention.num_kv_heads, capacity, attention.head_dim)
        weight = self.fc.weight
        return [(torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                 torch.zeros(shape, dtype=weight.dtype, device=weight.device)) for _ in self.layers]

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor,
                       cache: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Project target features (B, S, n*H) of the context positions `positions` (S,) into
        every layer's keys and values in `cache` (written at those positions)."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        rope = self.rotary_emb(context, positions.unsqueeze(0).expand(context.shape[0], -1))
        for layer, (keys, values) in zip(self.layers, cache):
            k, v = layer.self_attn.keys_values(context, rope)
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)

    def draft_cached(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                     cache: list[tuple[torch.Tensor, torch.Tensor]], key_valid: torch.Tensor) -> torch.Tensor:
        """`draft` of one block (B, Q, H) at `positions` (Q,) whose context is in `cache`
        (extend_context): key_valid (B, 1, 1, C) marks the context's positions and the
        block's own (written into the cache here, so a later extend_context overwrites
        them). Returns the final hidden states (B, Q, H)."""
        hidden = block_embeds.to(self.fc.weight.dtype)
        rope = self.rotary_emb(hidden, positions.unsqueeze(0).expand(hidden.shape[0], -1))
        for layer, (keys, values) in zip(self.layers, cache):
            hidden = layer.cached(hidden, rope, keys, values, positions, key_valid)
        return self.norm(hidden)


class DFlashDraftModel(DFlashModules, PreTrainedModel):
    """The drafter as `AutoModel.from_pretrained(export, trust_remote_code=True)` returns it.

    Its forward takes the public DFlash inference arguments: `noise_embedding` (B, Q, H), the
    target's input embeddings of one block [last accepted token, MASK, ...]; `target_hidden`
    (B, S, n*H), the target's hidden states `hidden_states[i + 1]` for i in
    `target_layer_ids`, concatenated; `position_ids` (B, S+Q) of context then block. It
    returns the drafter's final hidden states (B, Q, H): the target's LM head on positions
    1..Q-1 gives the drafted tokens' logits."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.build_modules(config)
        self.post_init()

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """attention_mask: bool (B, 1, Q, S+Q), True = may attend; default: every block
        position sees the whole context and the whole block (DFlash drafts non-causally)."""
        batch, q_len = noise_embedding.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones((batch, 1, q_len, position_ids.shape[1]), dtype=torch.bool,
                                        device=noise_embedding.device)
        context_len = target_hidden.shape[1]
        return self.draft(noise_embedding, target_hidden, position_ids[:, :context_len],
                          position_ids[:, context_len:], attention_mask)
