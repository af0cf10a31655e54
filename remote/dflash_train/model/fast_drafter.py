"""The drafter's cached decode as functions of its weights, for the evaluator's draft step.

modeling_dflash's cached path (`extend_context`, `draft_cached`) runs the drafter's
modules: per layer, separate products for q, k and v, for gate and up, and two more for
the context's keys and values, and SDPA for the attention. The modules and that path stay
what an export ships; the decode runs this instead, which computes the same:

* a drafter layer on its block computes what a Qwen3 target layer computes (RMSNorm, q, k
  and v with q/k RMSNorm and RoPE, attention, output projection, SiLU MLP): the block runs
  through fast_layers' layer functions (`run_layers`), whose attention reads keys that
  also hold the context's, and on compiled CUDA steps through `step_attention` (every
  block position sees the context and the whole block: the keys up to the block's last
  position);
* the drafter's projections are fused as the target's are (`fuse_layers`: q/k/v one
  product, gate/up another, as views the modules keep using), and the context's keys and
  values are the k/v rows of each layer's fused q/k/v matrix: one product a layer;
* RoPE comes from a table of the drafter's own rotary values, made once.

Shapes: Q block positions (one row), S context positions, H hidden, C cache positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fast_layers
from .drafter import DFlashDrafter
from .fast_layers import (Geometry, LayerFunctions, LayerWeights, attend, final_logits, layer_weights, rms_norm,
                          rotate, run_layers)


def drafter_geometry(drafter: DFlashDrafter) -> Geometry:
    attention = drafter.layers[0].self_attn
    return Geometry(attention.num_heads, attention.num_kv_heads, attention.head_dim,
                    float(drafter.config.rms_norm_eps), attention.head_dim ** -0.5)


def extend_context(features: torch.Tensor, fc: torch.Tensor, hidden_norm: torch.Tensor, weights: list[LayerWeights],
                   g: Geometry, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor], positions: torch.Tensor) -> None:
    """modeling_dflash `extend_context`: target features (1, S, n*H) of the context positions
    (S,) projected into every layer's keys and values (1, KVH, C, D) at those positions.
    cos, sin (C, D): the RoPE table."""
    context = rms_norm(F.linear(features.to(fc.dtype), fc), hidden_norm, g.eps)  # (1, S, H)
    length = context.shape[1]
    width = g.kv_heads * g.head_dim
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (S, 1, D): every head
    for w, layer_keys, layer_values in zip(weights, keys, values):
        kv_bias = w.qkv_bias[-2 * width:] if w.qkv_bias is not None else None
        kv = F.linear(context, w.qkv[-2 * width:], kv_bias)  # the fused matrix's k and v rows
        k, v = kv.view(1, length, 2, g.kv_heads, g.head_dim).unbind(2)  # (1, S, KVH, D) each
        if w.k_norm is not None:
            k = rms_norm(k, w.k_norm, g.eps)
        layer_keys.index_copy_(2, positions, rotate(k, cos, sin).transpose(1, 2))
        layer_values.index_copy_(2, positions, v.transpose(1, 2))


def drafted(hidden: torch.Tensor, norm: torch.Tensor, eps: float, head: torch.Tensor) -> torch.Tensor:
    """The final hidden states (1, Q, H) -> the drafted tokens (Q-1,): the target's head on
    the normed positions after the anchor, greedy."""
    return final_logits(hidden[0, 1:], norm, eps, head, None).argmax(-1)


class FastDrafter:
    """`drafter`'s cached decode over a cache of `capacity` positions
    (DFlashModules.context_cache: (keys, values) per layer). Its projections are fused: the
    decoder owns the drafter (a snapshot loaded into it later, by load_state_dict, copies
    into the fused tensors). With `compile_steps` the draft step's fixed shapes (`extend`
    with `step=True`, and `drafts`) run compiled, and on CUDA the block attends through
    fast_layers.step_attention."""

    def __init__(self, drafter: DFlashDrafter, capacity: int, compile_steps: bool = False):
        fast_layers.fuse_layers(drafter, drafter.layers)
        self.geometry = g = drafter_geometry(drafter)
        self.weights = [layer_weights(layer) for layer in drafter.layers]
        self.fc, self.hidden_norm, self.norm = drafter.fc.weight, drafter.hidden_norm.weight, drafter.norm.weight
        device = self.fc.device
        with torch.inference_mode():  # the rotary module's own values at 0..capacity-1
            cos, sin = drafter.rotary_emb(self.fc[:1].unsqueeze(0), torch.arange(capacity, device=device).unsqueeze(0))
        self.cos, self.sin = cos[0], sin[0]  # (C, D)
        self.key_index = torch.arange(capacity, device=device)
        self.rows = torch.zeros(1, dtype=torch.long, device=device)
        self._layers = LayerFunctions.compiled() if compile_steps else fast_layers.PLAIN
        self._extend_step = fast_layers.compile_step(extend_context) if compile_steps else extend_context
        self._drafted = fast_layers.compile_step(drafted) if compile_steps else drafted
        self._attention = None
        if compile_steps and device.type == "cuda":
            self._attention = fast_layers.step_attention(fast_layers.STEP_ATTENTION, 1, drafter.block_size, capacity,
                                                         device, g)

    def extend(self, features: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
               step: bool = False) -> None:
        """features (1, S, n*H) of the context positions (S,) into `cache`; `step`: at the
        draft step's fixed shape (compiled, when built so)."""
        keys, values = zip(*cache)
        extend = self._extend_step if step else extend_context
        extend(features, self.fc, self.hidden_norm, self.weights, self.geometry, self.cos, self.sin, list(keys),
               list(values), positions)

    def drafts(self, block_embeds: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
               head: torch.Tensor) -> torch.Tensor:
        """modeling_dflash `draft_cached` of the block (1, Q, H) at `positions` (Q,), its
        context in `cache` (every block position sees the keys up to the block's last), then
        `head` -> the drafted tokens (Q-1,)."""
        g = self.geometry
        at = positions.unsqueeze(0)  # (1, Q)
        if self._attention is not None:
            self._attention.set(positions[-1:].expand_as(at))
            attention = self._attention
        else:
            seen = (self.key_index <= positions[-1]).expand(1, positions.shape[0], -1)  # (1, Q, C)

            def attention(q, keys, values, scale):
                return attend(q, keys, values, seen, scale)
        keys, values = zip(*cache)
        hidden, _ = run_layers(self._layers, block_embeds.to(self.fc.dtype), self.weights, list(keys), list(values),
                               g, self.cos[at], self.sin[at], self.rows, at, attention)
        return self._drafted(hidden, self.norm, g.eps, head)
