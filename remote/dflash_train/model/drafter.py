"""The DFlash drafter as the trainer holds it, its Hugging Face config, and the export.

It has no embedding and no LM head of its own (it borrows the target's, frozen). Its
layers and computation live in modeling_dflash.py, the file every export ships so that
`AutoModel.from_pretrained(export, trust_remote_code=True)` runs the same code.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from ..config import DrafterConfig
from . import modeling_dflash
from .modeling_dflash import DFlashModules


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` layers spread evenly from layer 1 to L-3 (Qwen3-8B, 5 of 36: 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"the target has {num_target_layers} layers; spreading {count} feature "
                         "layers from 1 to L-3 needs at least 4 (or set drafter.target_layer_ids)")
    return tuple(int(round(start + i * (end - start) / (count - 1))) for i in range(count))


def full_attention_rope(parameters: dict | None) -> dict | None:
    """The target's RoPE parameters as one set: a target whose layers differ by type (Gemma
    3: `{"full_attention": {...}, "sliding_attention": {...}}`) gives its full-attention
    layers' set, the layers the drafter's attention over the whole context is like."""
    if isinstance(parameters, dict) and isinstance(parameters.get("full_attention"), dict):
        return dict(parameters["full_attention"])
    return parameters


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
        rope_parameters=full_attention_rope(getattr(target_config, "rope_parameters", None)),
        attention_bias=False,
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        block_size=spec.block_size,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config={"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id,
                       "mask_token": spec.mask_token, "block_size": spec.block_size},
    )


class DFlashDrafter(DFlashModules, nn.Module):
    """The drafter as the trainer holds it: a plain module (the exported Hugging Face class,
    modeling_dflash.DFlashDraftModel, shares its modules and computation)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.build_modules(config)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Normal(0, initializer_range) linears and unit norms, like a Qwen3 checkpoint; the
        random weights drawn from `generator` one after another, in module order."""
        for fill in self.initializers():
            fill(generator)

    def initializers(self) -> list[Callable[[torch.Generator], None]]:
        """One function per module that sets its weights as a Qwen3 checkpoint starts, in
        module order: a linear's weight from Normal(0, initializer_range) drawn from the
        generator it is given, its bias zero; a norm's weight one."""
        def linear(module: nn.Linear, generator: torch.Generator) -> None:
            with torch.no_grad():
                module.weight.normal_(0.0, self.config.initializer_range, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()

        def norm(module: Qwen3RMSNorm, generator: torch.Generator) -> None:
            nn.init.ones_(module.weight)

        return [functools.partial(linear, module) if isinstance(module, nn.Linear) else functools.partial(norm, module)
                for module in self.modules() if isinstance(module, (nn.Linear, Qwen3RMSNorm))]

    def forward(self, block_embeds: torch.Tensor, features: torch.Tensor, context_positions: torch.Tensor,
                block_positions: torch.Tensor, mask: Any) -> torch.Tensor:
        return self.draft(block_embeds, features, context_positions, block_positions, mask)


def drafter_on(config: Qwen3Config, device: str | torch.device) -> DFlashDrafter:
    """A drafter built where it will live, for weights loaded into it next: torch's default
    initialization, which those replace, runs there (at the Qwen3-8B shape, a billion
    weights: seconds on the CPU, milliseconds on a GPU), and the rotary buffers are made
    there."""
    with torch.device(device):
        return DFlashDrafter(config)


def fresh_weights(config: Qwen3Config, seed: int, threads: int) -> dict[str, torch.Tensor]:
    """A new drafter's weights, on the CPU, the same on every host and device: each module's
    drawn from a CPU generator of its own, seeded from `seed` and its place in module
    order (`_module_seed`), `threads` modules at a time (a CPU normal_ is serial: at the
    Qwen3-8B shape, a billion draws take seconds on one core). The drafter is laid out on
    the meta device first, so torch's default initialization, which these replace whole,
    is never computed; its buffers (rotary frequencies) are not weights and stay unset."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    drafter.to_empty(device="cpu")
    fills = drafter.initializers()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(lambda i: fills[i](torch.Generator().manual_seed(_module_seed(seed, i))), range(len(fills))))
    # What state_dict holds (the buffers are not persistent; a strict load would name one that became so).
    return {name: weight.detach() for name, weight in drafter.named_parameters()}


def _module_seed(seed: int, index: int) -> int:
    """The seed of the module at `index` for the run's `seed`: 63 bits of a hash of both, so
    any int the config allows (negative, past 64 bits) gives one torch takes, and the
    modules' streams are unrelated."""
    return int.from_bytes(hashlib.sha256(f"drafter weights {seed} {index}".encode()).digest()[:8], "little") >> 1


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
    refuse_non_finite([name for name, tensor in weights.items()
                       if tensor.is_floating_point() and not tensor.isfinite().all()], len(weights))
    return weights


def refuse_non_finite(bad: list[str], total: int) -> None:
    """NonFiniteWeights naming the `bad` of `total` weight tensors, if any."""
    if bad:
        raise NonFiniteWeights(f"{len(bad)} of {total} weight tensors hold NaN or infinite values "
                               f"(first: {', '.join(bad[:8])}); not written")


# Shipped in every export, beside config.json: the model class its `auto_map` names.
MODELING_FILE = Path(modeling_dflash.__file__)


def reader_config(config: Qwen3Config, dtype: torch.dtype) -> dict[str, Any]:
    """config.json as every reader loads it the same way. transformers 5 keeps RoPE in
    `rope_parameters`; 4.x ignores that and reads `rope_theta` and `rope_scaling` (without
    them it silently uses theta 10000, the wrong RoPE for e.g. Qwen3's 1e6), so both forms
    are written. `auto_map` points AutoModel at the modeling file shipped beside it."""
    fields = config.to_dict()
    rope = dict(fields.get("rope_parameters") or {})
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    fields["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    fields["dtype"] = str(dtype).removeprefix("torch.")
    fields["auto_map"] = {"AutoModel": f"{MODELING_FILE.stem}.{modeling_dflash.DFlashDraftModel.__name__}"}
    return fields


def export_drafter(drafter: DFlashDrafter, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write a Hugging Face-style folder: config.json, model.safetensors (weights in
    `dtype`) and modeling_dflash.py (the model class `auto_map` names)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
             for name, tensor in finite_cpu_weights(drafter).items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(MODELING_FILE, out_dir / MODELING_FILE.name)
    config = reader_config(drafter.config, dtype)
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


def load_drafter(folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load an exported drafter back, ours or another tool's (strict: every weight must match),
    in `dtype` (default fp32): an inference decode runs it in its target's dtype, as the
    reference does, since an fp32 drafter beside a bf16 target costs a decode step several
    times the draft's own time."""
    from safetensors.torch import load_file

    config = Qwen3Config.from_pretrained(str(folder))
    complete_dflash_config(config, str(folder / "config.json"))
    drafter = drafter_on(config, device)
    drafter.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return drafter if dtype is None else drafter.to(dtype)
