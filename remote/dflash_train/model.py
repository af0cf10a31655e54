"""The DFlash drafter: a small Qwen3-style decoder conditioned on target features.

It has no embedding and no LM head of its own (it borrows the target's, frozen).
Hidden states of a few target layers are concatenated, projected by a bias-free
linear (`fc`) and RMS-normalised (`hidden_norm`). In every layer the queries come from
the block tokens only, while keys and values are the same k_proj/v_proj applied to
[context features ; block tokens]. Module names match the public DFlash inference code
(z-lab/dflash `DFlashDraftModel`), so an exported state dict loads there unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .config import DrafterConfig


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly from layer 1 to L-3 (Qwen3-8B, 5 of 36: 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"the target has {num_target_layers} layers; spreading {count} feature "
                         "layers from 1 to L-3 needs at least 4 (or set drafter.target_layer_ids)")
    return tuple(int(round(start + i * (end - start) / (count - 1))) for i in range(count))


def drafter_hf_config(target_config: Any, spec: DrafterConfig, layer_ids: tuple[int, ...],
                      mask_token_id: int) -> Qwen3Config:
    """Qwen3 fields from the target, plus the DFlash fields under the names the public
    inference code reads: `dflash_config.{target_layer_ids, mask_token_id, block_size}`
    (current z-lab and SGLang), and top-level `block_size` / `num_target_layers` (older code)."""
    head_dim = getattr(target_config, "head_dim", None) or (
        target_config.hidden_size // target_config.num_attention_heads)
    return Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=spec.intermediate_size or target_config.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=getattr(target_config, "rope_parameters", None),
        attention_bias=False,
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        block_size=spec.block_size,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config={"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id,
                       "mask_token": spec.mask_token, "block_size": spec.block_size},
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen3's RoPE for one tensor. transformers' apply_rotary_pos_emb rotates q and k at
    the same positions; here queries (block) and keys (context + block) differ in length."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


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


class DFlashDrafter(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dflash = config.dflash_config
        self.target_layer_ids = tuple(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(dflash["block_size"])
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Normal(0, initializer_range) linears and unit norms, like a Qwen3 checkpoint."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.normal_(0.0, self.config.initializer_range, generator=generator)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, block_embeds: torch.Tensor, features: torch.Tensor, context_positions: torch.Tensor,
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


def cpu_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the weights, contiguous (as safetensors wants). A copy even when
    training runs on the CPU, where `.to("cpu")` alone would alias weights still training."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in module.state_dict().items()}


class NonFiniteWeights(ValueError):
    """Weights that hold NaN or infinite values, refused by a checkpoint or an export."""


def finite_cpu_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """`cpu_weights`, refusing NaN and infinities: the last guard before weights are written
    where they would be resumed from or deployed (a non-finite step is never applied, but
    finite gradients can still overflow a weight)."""
    weights = cpu_weights(module)
    bad = [name for name, tensor in weights.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    if bad:
        raise NonFiniteWeights(f"{len(bad)} of {len(weights)} weight tensors hold NaN or infinite values "
                               f"(first: {', '.join(bad[:8])}); not written")
    return weights


def export_drafter(drafter: DFlashDrafter, out_dir: Path) -> None:
    """Write a Hugging Face-style folder: config.json + model.safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = finite_cpu_weights(drafter)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = drafter.config.to_dict()
    config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def complete_dflash_config(config: Qwen3Config, source: str) -> None:
    """Fill the DFlash fields a drafter folder written by other tools may leave out, the way
    the public inference code reads them: block_size from the top level, target_layer_ids
    spread over the target's layers (`num_target_layers`) as ours are by default."""
    dflash = dict(getattr(config, "dflash_config", None) or {})
    if dflash.get("block_size") is None:
        dflash["block_size"] = getattr(config, "block_size", None)
    if dflash.get("target_layer_ids") is None and getattr(config, "num_target_layers", None):
        dflash["target_layer_ids"] = list(default_target_layer_ids(config.num_target_layers, config.num_hidden_layers))
    missing = [key for key in ("block_size", "mask_token_id", "target_layer_ids") if dflash.get(key) is None]
    if missing:
        raise ValueError(f"{source}: config.json is not a DFlash drafter's: dflash_config lacks "
                         f"{', '.join(missing)}")
    config.dflash_config = dflash


def load_drafter(folder: Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Load an exported drafter back, ours or another tool's (strict: every weight must match)."""
    from safetensors.torch import load_file

    config = Qwen3Config.from_pretrained(str(folder))
    complete_dflash_config(config, str(folder / "config.json"))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return drafter.to(device)
