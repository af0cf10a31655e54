"""The target's decoder layers as functions of their weights, for decoding at fixed shapes.

The decode paths (model/static_target.py for the evaluator, model/batched_decode.py for
`job: regenerate`) run the target's layers through these functions rather than through the
modules, for three reasons:

* one compiled graph serves every layer: the weights are arguments, so Dynamo compiles
  `project_and_store`, `output_and_project` and `output_and_mlp` once per step shape, not
  once per layer (a compiled module's forward bakes its layer in); `run_layers` joins each
  layer's output to the next layer's projection, so a graph ends at each attention only;
* attention reads each key-value head once, where the modules' attention first copies every
  KV head once per query head (transformers' repeat_kv), which at a batch of hundreds of
  cached sequences is most of a decode step's memory traffic: compiled steps on CUDA
  attend through `step_attention` (each row's keys up to its own position, read from
  positions set on the device: model/decode_attention.py's split-KV kernels, or
  FlexAttention's `PositionMask` to compare with); the other paths lay the query heads
  that share a KV head along the query axis of one SDPA call (`attend`);
* `fuse_projections` makes q, k and v one matrix and gate and up another, as views that the
  modules keep using: fewer, larger matrix products, with no second copy of the weights.

The functions compute what the modules of the families in SUPPORTED compute (RMSNorm in
fp32 before the weight, q/k RMSNorm of Qwen3, optional q/k/v/o biases, RoPE by
rotate_half, SiLU-gated MLP); tests hold the decodes to `generate` token for token.

Shapes: B rows (cached sequences), Q new positions per row, H query heads, KVH key-value
heads, D head dim, C cached positions per row.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Callable, Collection

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SUPPORTED = ("qwen3", "qwen2", "llama")
ATTENTION = ("sdpa", "eager")
FLEX_BLOCK = 128  # FlexAttention's key block: a flex-attended cache holds a multiple of it
# How compiled decode steps on CUDA attend over per-row caches (step_attention): "split"
# (model/decode_attention.py) reads each key once and spreads a short cache's keys over
# programs; "flex" (PositionMask) is FlexAttention's decoding kernel, slower at every step
# shape measured (bench/RESULTS-h200.md) and kept to compare with.
STEP_ATTENTION = "split"
STEP_ATTENTIONS = ("split", "flex")
# Inductor settings for the steps that advance each row by one token (the target alone,
# job: regenerate's decode): their generated kernels' block sizes are tuned for the step's
# one shape while compiling, which pays there (bench/RESULTS-h200.md) and not in the
# verify and draft steps, whose compiles it only lengthens.
TOKEN_STEP_OPTIONS = {"coordinate_descent_tuning": True}
# A layer's output products (o, and the MLP's down) at steps of a few positions (the verify
# and draft steps' 16) make few output tiles: cuBLAS splits their K and sums the parts in a
# reduction kernel of its own, two a layer. On CUDA, at steps of 2 to SPLIT_K_ROWS
# positions that no Triton kernel runs (TRITON_PRODUCTS: eager steps, or without Triton),
# those SPLIT_K names run as that many batched products over K's parts instead
# (split_linear), and in a compiled step the kernel that adds the residual sums their fp32
# parts: no reduction kernels. Splitting the step's other products, or into more parts,
# gained nothing or lost (bench/RESULTS-h200.md). A product into fp32 from bf16 inputs
# came with torch 2.8: before it, cuBLAS splits them as it chooses.
SPLIT_K = {"o": 2, "down": 2}
SPLIT_K_ROWS = 16
BMM_INTO_FP32 = hasattr(torch.ops.aten.bmm, "dtype")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How model/skinny_products.py's kernel computes one product: `parts` shares of K,
    `block_n` outputs by `block_k` of K per tile, `stages` loads in flight, `warps` per
    program, `swap`: the weight on the tensor cores' tall side."""
    parts: int
    block_n: int
    block_k: int
    stages: int = 3
    warps: int = 4
    swap: bool = False


# The products of compiled steps on CUDA, at 2 to SPLIT_K_ROWS positions (the verify and
# draft steps), that run through model/skinny_products.py's Triton kernel with these
# tiles, where they fit the product's shape: bench/skinny_products.py's best at the 8B
# shapes on an H200, each faster than cuBLAS and the split (bench/RESULTS-h200.md).
TRITON_PRODUCTS: dict[str, Tiles] = {
    "qkv": Tiles(2, 64, 128, stages=4, swap=True),
    "o": Tiles(4, 64, 128, swap=True),
    "gate_up": Tiles(1, 64, 128, swap=True),
    "down": Tiles(2, 64, 256, stages=4, swap=True),
}
TRITON = importlib.util.find_spec("triton") is not None

# RoPE types whose frequencies depend on the sequence's length (transformers'
# dynamic_rope_update): a table made once would be wrong past the original length.
DYNAMIC_ROPE = ("dynamic", "longrope")


def compile_step(function, one_token: bool = False):
    """`function` compiled for fixed shapes (a graph per step shape); `one_token`: for steps
    of one new token per row, its kernels tuned for them (TOKEN_STEP_OPTIONS)."""
    return torch.compile(function, dynamic=False, options=TOKEN_STEP_OPTIONS if one_token else None)


def _rope_type(config: Any) -> str:
    """transformers 5 keeps it in rope_parameters, 4.x in rope_scaling (None: default)."""
    for field in ("rope_parameters", "rope_scaling"):
        value = getattr(config, field, None)
        if isinstance(value, dict):
            return value.get("rope_type") or value.get("type") or "default"
    return "default"


def fast_refusal(config: Any) -> str | None:
    """Why these functions cannot run the layers of a target with this config, or None."""
    model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED:
        return f"the fast decode supports targets of type {', '.join(SUPPORTED)}; this one is {model_type!r}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "the fast decode supports full-attention layers only; this target has sliding-window layers"
    implementation = getattr(config, "_attn_implementation", "sdpa")
    if implementation not in ATTENTION:
        return f"the fast decode runs attention as sdpa or eager; this target uses {implementation!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the fast decode supports SiLU-gated MLPs; this target's activation is {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "the fast decode supports MLPs without biases; this target's have biases"
    if (rope := _rope_type(config)) in DYNAMIC_ROPE:
        return f"the fast decode needs fixed RoPE frequencies; this target's RoPE is {rope!r}"
    return None


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors. `qkv` and `gate_up` are one fused matrix each after
    fuse_projections, else a tuple of the separate ones."""
    input_norm: torch.Tensor
    qkv: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qkv_bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    q_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm of queries and keys
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    down: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What every layer shares: constants of the compiled graphs."""
    heads: int
    kv_heads: int
    head_dim: int
    eps: float  # the layers' RMSNorm epsilon (one value in these families' configs)
    scale: float


def geometry(model: nn.Module) -> Geometry:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = model.get_decoder().layers[0].self_attn
    return Geometry(config.num_attention_heads, config.num_key_value_heads, head_dim, float(config.rms_norm_eps),
                    float(attention.scaling))


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return linear.bias if linear.bias is not None else None


def fuse_projections(model: nn.Module) -> None:
    """Make each layer's q/k/v weights (and biases) rows of one tensor, and gate/up rows of
    another; the modules' parameters become views of them, so the model computes what it
    did and holds no second copy. Done once per model (later calls see it done); only for
    a model no other thread is using, since its parameters are replaced."""
    fuse_layers(model, model.get_decoder().layers)


def fuse_layers(owner: nn.Module, layers: nn.ModuleList) -> None:
    """fuse_projections over `layers` (self_attn.{q,k,v}_proj, mlp.{gate,up}_proj), marked
    done on `owner`: a target's decoder layers, or a drafter's."""
    if getattr(owner, "_dflash_fused", False):
        return
    with torch.no_grad():
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            _fuse(attention.q_proj, attention.k_proj, attention.v_proj)
            _fuse(mlp.gate_proj, mlp.up_proj)
    owner._dflash_fused = True


def _fuse(*linears: nn.Linear) -> None:
    fused = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    fused_bias = torch.cat(biases) if all(b is not None for b in biases) else None
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        if fused_bias is not None:
            linear.bias = nn.Parameter(fused_bias[start:start + rows], requires_grad=False)
        start += rows


def _rows_of(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose consecutive row ranges `parts` are (fuse_projections' work), or None."""
    base = parts[0]
    offset = base.storage_offset()
    for part in parts:
        if part.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() \
                or part.storage_offset() != offset or not part.is_contiguous():
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return base.as_strided((rows, *base.shape[1:]), base.stride(), base.storage_offset())


def layer_weights(layer: nn.Module) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    qkv = _rows_of([p.weight for p in projections])
    biases = [_bias(p) for p in projections]
    qkv_bias = None if biases[0] is None else (_rows_of(biases) if qkv is not None else tuple(biases))
    gate_up = _rows_of([mlp.gate_proj.weight, mlp.up_proj.weight])
    q_norm = getattr(attention, "q_norm", None)
    k_norm = getattr(attention, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=qkv if qkv is not None else tuple(p.weight for p in projections),
        qkv_bias=qkv_bias,
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        o=attention.o_proj.weight, o_bias=_bias(attention.o_proj),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=gate_up if gate_up is not None else (mlp.gate_proj.weight, mlp.up_proj.weight),
        down=mlp.down_proj.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As the families' RMSNorm: the statistics in fp32, the weight applied in x's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by rotate_half, as these families apply it; cos and sin broadcast over x."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _linear3(x: torch.Tensor, weights, biases) -> tuple[torch.Tensor, ...]:
    if isinstance(weights, tuple):
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases or (None,) * len(weights)))
    return (step_linear("qkv", x, weights, biases),)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., K) as `splits` products over K's parts, each
    into fp32, summed: (S, M, K/S) @ (S, K/S, N), both views, nothing copied."""
    *lead, width = x.shape
    outputs = weight.shape[0]
    part = width // splits
    xs = x.reshape(-1, splits, part).transpose(0, 1)  # (S, M, K/S)
    ws = weight.view(outputs, splits, part).permute(1, 2, 0)  # (S, K/S, N): the columns of each part
    out = torch.bmm(xs, ws, out_dtype=torch.float32).sum(0)  # (M, N)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).view(*lead, outputs)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., K) through model/skinny_products.py's kernel:
    its fp32 parts over K summed (in the consumer's kernel, when compiled)."""
    from .skinny_products import product_parts  # Triton: CUDA only

    *lead, width = x.shape
    out = product_parts(x.reshape(-1, width), weight, tiles.parts, tiles.block_n, tiles.block_k, tiles.stages,
                        tiles.warps, tiles.swap).sum(0)  # (M, N)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).view(*lead, weight.shape[0])


def _few_positions_on_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x (..., K) is a step of 2 to SPLIT_K_ROWS positions on CUDA, by a dense weight: a
    product cuBLAS tiles poorly (TRITON_PRODUCTS, SPLIT_K)."""
    return x.is_cuda and 1 < x.numel() // x.shape[-1] <= SPLIT_K_ROWS and weight.is_contiguous()


def triton_tiles(role: str, x: torch.Tensor, weight: torch.Tensor) -> Tiles | None:
    """The tiles of the Triton kernel for a layer's product `role` of x (..., K) by
    `weight`, or None: on CUDA, at 2 to SPLIT_K_ROWS positions, where TRITON_PRODUCTS
    names the role and its tiles fit the shape."""
    tiles = TRITON_PRODUCTS.get(role)
    if not (tiles and TRITON and _few_positions_on_cuda(x, weight)):
        return None
    from .skinny_products import fits

    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    return tiles if fits(rows, weight.shape[0], width, tiles.parts, tiles.block_n, tiles.block_k) else None


def step_linear(role: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a layer's product `role` (qkv, o, gate_up, down): in a compiled step,
    through the Triton kernel where triton_tiles gives tiles (compiled with the step, so
    an eager step never compiles a kernel when it first runs, in whichever thread); else
    split over K where SPLIT_K says, on CUDA at 2 to SPLIT_K_ROWS positions."""
    if torch.compiler.is_compiling() and (tiles := triton_tiles(role, x, weight)):
        return triton_linear(x, weight, bias, tiles)
    splits = SPLIT_K.get(role, 0)
    if splits and BMM_INTO_FP32 and _few_positions_on_cuda(x, weight) and x.shape[-1] % splits == 0:
        return split_linear(x, weight, bias, splits)
    return F.linear(x, weight, bias)


def project_and_store(hidden: torch.Tensor, w: LayerWeights, g: Geometry, cos: torch.Tensor, sin: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
                      ) -> torch.Tensor:
    """hidden (B, Q, hidden) -> the queries (B, H, Q, D), RoPE applied; the keys and values
    are written into `keys`/`values` (rows' caches, (N, KVH, C, D)) at `positions` (B, Q).
    cos, sin (B, Q, D): the positions' RoPE."""
    batch, length, _ = hidden.shape
    x = rms_norm(hidden, w.input_norm, g.eps)
    parts = _linear3(x, w.qkv, w.qkv_bias)
    if len(parts) == 1:
        q, k, v = parts[0].split([g.heads * g.head_dim, g.kv_heads * g.head_dim, g.kv_heads * g.head_dim], dim=-1)
    else:
        q, k, v = parts
    q = q.view(batch, length, g.heads, g.head_dim)
    k = k.view(batch, length, g.kv_heads, g.head_dim)
    v = v.view(batch, length, g.kv_heads, g.head_dim)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, g.eps), rms_norm(k, w.k_norm, g.eps)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, Q, 1, D): every head
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    index = rows.unsqueeze(1).expand(batch, length)
    keys[index, :, positions] = k  # (B, Q, KVH, D) into (N, KVH, C, D)
    values[index, :, positions] = v
    return q.transpose(1, 2)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, scale: float
           ) -> torch.Tensor:
    """q (B, H, Q, D) over keys/values (B, KVH, L, D) where `seen` (B, Q, L) is true ->
    (B, H, Q, D). The G = H/KVH query heads of a KV head are rows of one attention over
    it, so each key and value is read once and nothing is copied per query head."""
    batch, heads, length, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * length, dim)  # head h = kv*G + g: rows (g, q)
    mask = seen.unsqueeze(1).unsqueeze(1).expand(batch, 1, group, length, seen.shape[-1])
    out = F.scaled_dot_product_attention(grouped, keys, values,
                                         attn_mask=mask.reshape(batch, 1, group * length, seen.shape[-1]),
                                         scale=scale)
    return out.reshape(batch, heads, length, dim)  # SDPA may return it transposed in memory


def attend_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, Q, D) of positions 0..Q-1 over their own keys/values (B, KVH, Q, D): a
    prefill from position 0, where causality is the whole mask. The KV heads are repeated
    per query head (a prefill's keys are few beside its compute), and SDPA is held to its
    flash kernel (or the math one, where flash cannot run): cuDNN's, which SDPA prefers
    on Hopper, builds a plan for every new shape, and a prefill's shapes vary."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)


class PositionMask:
    """FlexAttention over per-row caches (B, KVH, capacity, D) where the query at position p
    sees the keys at positions <= p, for a step of B rows of Q queries: `set(positions)`,
    on the device (inside a CUDA graph too), gives each row as many key blocks as its
    furthest query needs, so the kernel reads those and no more (SDPA reads every key it
    is given, and picks kernels tiled for long queries). Compiled, on CUDA: uncompiled,
    flex_attention is a slow reference implementation."""

    def __init__(self, rows: int, queries: int, capacity: int, device: torch.device):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        if capacity % FLEX_BLOCK:
            raise ValueError(f"a flex attention cache holds a multiple of {FLEX_BLOCK} positions, not {capacity}")
        blocks = capacity // FLEX_BLOCK
        self.positions = torch.zeros(rows, queries, dtype=torch.long, device=device)
        self.kv_blocks = torch.zeros(rows, 1, 1, dtype=torch.int32, device=device)
        indices = torch.arange(blocks, dtype=torch.int32, device=device).expand(rows, 1, 1, blocks).contiguous()
        positions = self.positions

        def seen(row, head, query, key):
            return key <= positions[row, query]

        self.mask = BlockMask.from_kv_blocks(self.kv_blocks, indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=seen,
                                             seq_lengths=(queries, capacity), compute_q_blocks=False)
        self._attend = compile_step(flex_attention)

    def set(self, positions: torch.Tensor) -> None:
        """positions (B, Q): where this step's queries are."""
        self.positions.copy_(positions)
        self.kv_blocks.copy_((positions.max(dim=1).values // FLEX_BLOCK + 1).view(-1, 1, 1))

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        return self._attend(q, keys, values, block_mask=self.mask, scale=scale, enable_gqa=True)


def step_attention(kind: str, rows: int, queries: int, capacity: int, device: torch.device, g: Geometry):
    """The attention (`kind`, one of STEP_ATTENTIONS) of compiled CUDA steps of `rows` rows
    of `queries` new positions over per-row caches: `set(positions)` each step, then
    `(q, keys, values, scale)`; the query at position p sees the keys at positions <= p."""
    if kind == "flex":
        return PositionMask(rows, queries, capacity, device)
    from .decode_attention import SplitAttention  # Triton: CUDA only

    return SplitAttention(rows, queries, capacity, device, g.heads, g.kv_heads, g.head_dim)


def output_and_mlp(attention: torch.Tensor, residual: torch.Tensor, w: LayerWeights, g: Geometry) -> torch.Tensor:
    """attention (B, H, Q, D) and the layer's input (B, Q, hidden) -> the layer's output."""
    batch, _, length, _ = attention.shape
    hidden = residual + step_linear("o", attention.transpose(1, 2).reshape(batch, length, -1), w.o, w.o_bias)
    x = rms_norm(hidden, w.post_norm, g.eps)
    if isinstance(w.gate_up, tuple):
        gate, up = F.linear(x, w.gate_up[0]), F.linear(x, w.gate_up[1])
    else:
        gate, up = step_linear("gate_up", x, w.gate_up, None).chunk(2, dim=-1)
    return hidden + step_linear("down", F.silu(gate) * up, w.down, None)


def output_and_project(attention: torch.Tensor, residual: torch.Tensor, w: LayerWeights, next_w: LayerWeights,
                       g: Geometry, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """output_and_mlp of one layer, then project_and_store of the next (`next_w`, writing
    into its `keys`/`values`) -> (the layer's output, the next layer's queries). One graph
    when compiled: the residual add that ends a layer and the RMSNorm that starts the next
    become one kernel, where two graphs launch one each."""
    hidden = output_and_mlp(attention, residual, w, g)
    return hidden, project_and_store(hidden, next_w, g, cos, sin, keys, values, rows, positions)


def final_logits(hidden: torch.Tensor, norm: torch.Tensor, eps: float, head: torch.Tensor,
                 head_bias: torch.Tensor | None) -> torch.Tensor:
    """The last layer's output (..., hidden) -> logits (..., V): the final RMSNorm, the head."""
    return F.linear(rms_norm(hidden, norm, eps), head, head_bias)


@dataclasses.dataclass(frozen=True)
class LayerFunctions:
    """What `run_layers` calls, and the head after it: plain or compiled, one graph per
    step shape each."""
    project: Callable  # project_and_store: the first layer's
    output_and_project: Callable  # each layer's output with the next one's projection
    output: Callable  # output_and_mlp: the last layer's
    final: Callable  # final_logits

    @staticmethod
    def compiled(one_token: bool = False) -> LayerFunctions:
        return LayerFunctions(*(compile_step(f, one_token=one_token) for f in PLAIN_FUNCTIONS))


def run_layers(functions: LayerFunctions, hidden: torch.Tensor, weights: list[LayerWeights], keys: list[torch.Tensor],
               values: list[torch.Tensor], g: Geometry, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor, attention: Callable, taps: Collection[int] = ()
               ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """hidden (B, Q, hidden) of new positions (B, Q) through the layers of `weights`, layer
    i writing its keys and values into keys[i], values[i] at `rows` and those positions,
    then attending through `attention(q, keys, values, scale)` -> the last layer's output,
    and {i: layer i's output} for the layer indices in `taps`."""
    tapped: dict[int, torch.Tensor] = {}
    q = functions.project(hidden, weights[0], g, cos, sin, keys[0], values[0], rows, positions)
    for index, w in enumerate(weights):
        out = attention(q, keys[index], values[index], g.scale)
        if index + 1 < len(weights):
            hidden, q = functions.output_and_project(out, hidden, w, weights[index + 1], g, cos, sin,
                                                     keys[index + 1], values[index + 1], rows, positions)
        else:
            hidden = functions.output(out, hidden, w, g)
        if index in taps:
            tapped[index] = hidden
    return hidden, tapped


PLAIN_FUNCTIONS = (project_and_store, output_and_project, output_and_mlp, final_logits)
PLAIN = LayerFunctions(*PLAIN_FUNCTIONS)


class FastLayers:
    """A target's layers as LayerWeights, with the LayerFunctions that run them: `step`,
    compiled for fixed-shape steps when `compile_steps` (one graph per function and step
    shape for every layer, which the decode's CUDA graphs capture), `token` likewise for
    steps of one token a row, tuned for them; plain otherwise. `fuse`: fuse_projections
    first (only for a model this decode owns)."""

    def __init__(self, model: nn.Module, compile_steps: bool = False, fuse: bool = False):
        if problem := fast_refusal(model.config):
            raise ValueError(problem)
        if fuse:
            fuse_projections(model)
        self.model, self.decoder = model, model.get_decoder()
        self.config = model.config
        self.geometry = geometry(model)
        self.weights = [layer_weights(layer) for layer in self.decoder.layers[:self.config.num_hidden_layers]]
        self.final_norm = self.decoder.norm.weight
        self.head = model.get_output_embeddings()
        self.embed = self.decoder.get_input_embeddings()
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.compiled = compile_steps
        self.step = LayerFunctions.compiled() if compile_steps else PLAIN
        self.token = LayerFunctions.compiled(one_token=True) if compile_steps else PLAIN

    def rope_table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (positions, D) in the model's dtype: the rotary module's own values at
        0..positions-1, looked up per step instead of computed."""
        with torch.inference_mode():
            ids = torch.arange(positions, device=self.device).unsqueeze(0)
            cos, sin = self.decoder.rotary_emb(self.embed.weight[:1].unsqueeze(0), ids)
        return cos[0], sin[0]

    def kv_cache(self, rows: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, keys and values (rows, KVH, capacity, D), zeroed: stale entries are
        never attended to, but SDPA adds its mask to the scores, so they must be finite."""
        g = self.geometry
        shape = (rows, g.kv_heads, capacity, g.head_dim)
        make = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)  # noqa: E731
        return [make() for _ in self.weights], [make() for _ in self.weights]

    def kv_bytes_per_position(self) -> int:
        g = self.geometry
        return len(self.weights) * 2 * g.kv_heads * g.head_dim * self.embed.weight.element_size()

    def final(self, hidden: torch.Tensor, functions: LayerFunctions = PLAIN) -> torch.Tensor:
        """The last layer's output (..., hidden) -> logits (..., V), through `functions`."""
        return functions.final(hidden, self.final_norm, self.geometry.eps, self.head.weight, self.head.bias)

