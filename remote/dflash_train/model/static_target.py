"""The target's forward over a preallocated KV cache, for decoding one prompt at fixed shapes.

`StaticTarget.forward(input_ids, positions)` runs the target's layers (model/fast_layers.py:
the modules' computation as functions of their weights) over new tokens at device-held
`positions`, writing their keys and values into buffers allocated once for `capacity`
positions. The attention mask is built here from the positions (key j is seen by the
query at position p when j <= p), so nothing reads a length on the host: a verify forward
of a block has one shape at every step and can be replayed as a CUDA graph, and cutting
the cache back after a rejection is only moving the next write position (stale keys
beyond it are never seen before they are overwritten).

The loop collects the tapped layers' outputs itself (what the tap captures:
hidden_states[index + 1]). With `compile_steps`, the fixed-shape forwards (`step=True`: a
verify block, the target alone's one token) run the layer functions through
`torch.compile` (dynamic=False: one graph per function and step shape for all the layers,
captured by the decode's CUDA graphs, so a replay never enters Dynamo). The prefill, whose
length varies, stays eager.
"""
from __future__ import annotations

from typing import Any

import torch

from . import fast_layers
from .fast_layers import FLEX_BLOCK, FastLayers, attend, fast_refusal, run_layers
from .target import FeatureTap


def static_refusal(config: Any) -> str | None:
    """Why the fast decode cannot run the target of this model config, or None."""
    return fast_refusal(config)


class StaticTarget:
    """`fuse`: fuse the model's projections (fast_layers.fuse_projections) for this decode:
    only for a model no other thread runs. Compiled steps on CUDA attend through
    fast_layers.step_attention (only the keys up to the step's positions are read), the
    rest through SDPA."""

    def __init__(self, tap: FeatureTap, capacity: int, compile_steps: bool = False, fuse: bool = False):
        self.layers = FastLayers(tap.model, compile_steps=compile_steps, fuse=fuse)
        self.layer_ids = tap.layer_ids
        self.per_row = self.layers.compiled and self.layers.device.type == "cuda"  # step_attention
        if self.per_row:
            capacity = -(-capacity // FLEX_BLOCK) * FLEX_BLOCK
        self.device, self.dtype, self.capacity = self.layers.device, self.layers.dtype, capacity
        self.keys, self.values = self.layers.kv_cache(1, capacity)
        self.key_index = torch.arange(capacity, device=self.device)
        self.rows = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cos, self.sin = self.layers.rope_table(capacity)
        self._attentions: dict[int, object] = {}  # fast_layers.step_attention's, by the step's query count

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_logits_only: bool = False,
                features: bool = True, step: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (1, Q) at positions (Q,) (every earlier position already cached) ->
        logits (1, Q, V) (or (1, 1, V) of the last position) and the tap's features
        (1, Q, n*H), or None when not asked for. `step`: a fixed-shape decode step (the
        compiled functions, when built with them)."""
        layers, g = self.layers, self.layers.geometry
        functions = fast_layers.PLAIN
        if step:
            functions = layers.token if input_ids.shape[1] == 1 else layers.step
        at = positions.unsqueeze(0)  # (1, Q)
        hidden = layers.embed(input_ids)
        cos, sin = self.cos[at], self.sin[at]
        if step and self.per_row:
            attention = self._step_attention(at)
        else:
            seen = (self.key_index.unsqueeze(0) <= positions.unsqueeze(1)).unsqueeze(0)  # (1, Q, capacity)

            def attention(q, keys, values, scale):
                return attend(q, keys, values, seen, scale)
        hidden, tapped = run_layers(functions, hidden, layers.weights, self.keys, self.values, g, cos, sin, self.rows,
                                    at, attention, self.layer_ids if features else ())
        logits = layers.final(hidden[:, -1:] if last_logits_only else hidden, functions)
        if not features:
            return logits, None
        return logits, torch.cat([tapped[i] for i in self.layer_ids], dim=-1)

    def _step_attention(self, at: torch.Tensor):
        """The step attention of this step's shape, set to its positions (1, Q)."""
        if at.shape[1] not in self._attentions:
            self._attentions[at.shape[1]] = fast_layers.step_attention(
                fast_layers.STEP_ATTENTION, 1, at.shape[1], self.capacity, self.device, self.layers.geometry)
        attention = self._attentions[at.shape[1]]
        attention.set(at)
        return attention
