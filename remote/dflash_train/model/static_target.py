"""The target's forward over a preallocated KV cache, for decoding at fixed shapes.

`StaticTarget.forward(input_ids, positions)` runs the target's own modules (embedding,
RoPE, decoder layers, final norm, LM head) over new tokens at device-held `positions`,
writing their keys and values into buffers allocated once for `capacity` positions. The
attention mask is built here from the positions (key j is seen by the query at position
p when j <= p), so nothing reads a length on the host: a verify forward of a block has
one shape at every step and can be replayed as a CUDA graph, and cutting the cache back
after a rejection is only moving the next write position (stale keys beyond it are
never seen before they are overwritten).

The layers are called, not the model's forward, because transformers' cache and mask
interfaces differ between 4.57 (a `cache_position` argument, `past_key_values`) and 5.x
(the cache counts its own length on the device, `cache` from 5.24): the decoder layers'
attention calls only `update(keys, values, layer_idx, ...)` on the cache object in both,
which `StaticKV` provides. That loop is the base model's forward for the decoder-only
families listed in SUPPORTED (no sliding-window layers, no embedding scaling); the tests
check it against `generate` token for token. The loop collects the tapped layers' outputs
itself (the tap's hooks record only inside the tap's own forwards).

With `compile_steps`, the decode's fixed-shape forwards (`step=True`: a verify block, the
target alone's one token) call each decoder layer's forward through `torch.compile`
(dynamic=False: one graph per layer and shape, captured once by the decode's CUDA graphs,
so a replay never enters Dynamo). A step of the eager layers is hundreds of small
elementwise kernels (norms, RoPE, residuals, the KV heads' expansion) beside the matrix
products; Inductor fuses them. The prefill, whose length varies, stays eager: compiling it
would compile again for every prompt length.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from .target import FeatureTap

SUPPORTED = ("qwen3", "qwen2", "llama")
ATTENTION = ("sdpa", "eager")


class StaticKV:
    """Per-layer keys and values (1, kv_heads, capacity, head_dim) in the target's dtype;
    `positions` (Q,) says where the current forward's keys go."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.positions: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """What transformers' attention layers call (4.57 and 5.x alike)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.positions, key_states)
        values.index_copy_(2, self.positions, value_states)
        return keys, values


def static_refusal(config: Any) -> str | None:
    """Why the fast decode cannot run this target, or None."""
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED:
        return f"the fast decode supports targets of type {', '.join(SUPPORTED)}; this one is {model_type!r}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "the fast decode supports full-attention layers only; this target has sliding-window layers"
    implementation = getattr(config, "_attn_implementation", "sdpa")
    if implementation not in ATTENTION:
        return f"the fast decode runs attention as sdpa or eager; this target uses {implementation!r}"
    return None


class StaticTarget:
    def __init__(self, tap: FeatureTap, capacity: int, compile_steps: bool = False):
        model = tap.model
        config = model.config
        if problem := static_refusal(config):
            raise ValueError(problem)
        self.model, self.decoder, self.layer_ids = model, model.get_decoder(), tap.layer_ids
        self.layers = list(self.decoder.layers[:config.num_hidden_layers])
        # Calling a layer's forward (not the module) skips its hooks: the tap's, which read a
        # thread-local Dynamo would not trace, and which this loop does not need.
        self.step_layers = [torch.compile(layer.forward, dynamic=False) for layer in self.layers] \
            if compile_steps else self.layers
        self.head = model.get_output_embeddings()
        weight = self.decoder.get_input_embeddings().weight
        self.device, self.dtype, self.capacity = weight.device, weight.dtype, capacity
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = StaticKV(len(self.layers), config.num_key_value_heads, head_dim, capacity, self.dtype,
                              self.device)
        self.key_index = torch.arange(capacity, device=self.device)
        self._boolean_mask = getattr(config, "_attn_implementation", "sdpa") == "sdpa"
        # transformers 5.24 named the layers' cache argument `cache`; 4.x calls it past_key_values.
        parameters = inspect.signature(type(self.layers[0]).forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"

    def _mask(self, positions: torch.Tensor) -> torch.Tensor:
        seen = (self.key_index.unsqueeze(0) <= positions.unsqueeze(1))[None, None]  # (1, 1, Q, capacity)
        if self._boolean_mask:
            return seen
        # eager attention adds its mask to the scores
        return torch.zeros(seen.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~seen, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_logits_only: bool = False,
                features: bool = True, step: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (1, Q) at positions (Q,) (every earlier position already cached) ->
        logits (1, Q, V) (or (1, 1, V) of the last position) and the tap's features
        (1, Q, n*H), or None when not asked for. `step`: a fixed-shape decode step (the
        compiled layers, when built with them)."""
        self.cache.positions = positions
        hidden = self.decoder.embed_tokens(input_ids)
        position_ids = positions.unsqueeze(0)
        rope = self.decoder.rotary_emb(hidden, position_ids)
        mask = self._mask(positions)
        tapped: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.step_layers if step else self.layers):
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rope,
                        use_cache=True, **{self._cache_kwarg: self.cache})
            hidden = out[0] if isinstance(out, tuple) else out
            if index in self.layer_ids:
                tapped[index] = hidden  # what the tap captures: hidden_states[index + 1]
        hidden = self.decoder.norm(hidden)
        logits = self.head(hidden[:, -1:] if last_logits_only else hidden)
        if not features:
            return logits, None
        return logits, torch.cat([tapped[i] for i in self.layer_ids], dim=-1)
