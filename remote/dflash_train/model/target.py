"""The frozen target model and the taps that read its hidden states.

Forward hooks on the decoder layers capture the outputs of the feature layers: what HF
returns as `hidden_states[id + 1]` and servers capture, for every layer but the last one
(refused, see config.last_layer_refusal). For training, the hook on the last needed layer
stops the forward there: the later layers and the LM head are never computed. Capture
is per thread (thread-local), so the evaluation thread can run full forwards on the same
model while the target thread extracts features.
"""
from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..config import last_layer_refusal
from ..devices import is_cuda


class _EnoughLayers(Exception):
    """Raised by the last feature layer's hook to end a features-only forward early."""


def load_target(source: str, dtype: str, device: str) -> nn.Module:
    """`source`: a model folder or a hub id (resolved from the host's HF cache)."""
    from transformers import AutoModelForCausalLM

    if dtype == "auto":
        dtype = "bfloat16" if is_cuda(device) else "float32"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    model.requires_grad_(False)
    return model.eval().to(device)


class FeatureTap:
    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...]):
        layers = model.get_decoder().layers
        if problem := last_layer_refusal(layer_ids, len(layers)):
            raise ValueError(problem)
        self.model = model
        self.layer_ids = layer_ids
        # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name
        # warns, and goes in 5.40); 4.x knows only the old one and would ignore the new.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._local = threading.local()
        for layer_id in sorted(set(layer_ids)):
            layers[layer_id].register_forward_hook(self._hook(layer_id))

    def _hook(self, layer_id: int):
        last = max(self.layer_ids)

        def hook(module: nn.Module, args, output) -> None:
            captured = getattr(self._local, "captured", None)
            if captured is None:
                return  # this thread is not capturing
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == last and self._local.stop_early:
                raise _EnoughLayers

        return hook

    @contextmanager
    def _capture(self, stop_early: bool) -> Iterator[dict[int, torch.Tensor]]:
        self._local.captured, self._local.stop_early = {}, stop_early
        try:
            yield self._local.captured
        finally:
            self._local.captured = None

    def _concat(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # (B, S, n*H)

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S) -> features (B, S, n*H), stopping after the last feature layer."""
        with self._capture(stop_early=True) as captured:
            try:
                self.model.get_decoder()(input_ids=input_ids, use_cache=False)
            except _EnoughLayers:
                pass
            return self._concat(captured)

    @torch.inference_mode()
    def logits_and_features(self, input_ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A full forward: logits (B, S, V) and features (B, S, n*H). With `cache` (a
        transformers DynamicCache holding the positions before `input_ids`), only the new
        positions are computed, attending to the cached ones, and the cache grows by S."""
        with self._capture(stop_early=False) as captured:
            logits = self.model(input_ids=input_ids, use_cache=cache is not None, **{self._cache_kwarg: cache}).logits
            return logits, self._concat(captured)
