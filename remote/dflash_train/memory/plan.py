"""Peak GPU memory of a training run, per device, from its config and the target's shape.

`dflash launch` calls `estimate` before anything is deployed and refuses a run whose
estimate exceeds a GPU (docs/fit-check.md); `launch --dry-run` prints the terms.
Torch-free, like config.py: the CLI imports it, and the trainer may too.

What a device holds at its peak, as the trainer places it (jobs/startup.py, training/replica.py):

* a target model per target device, loaded whole (all its layers, though the feature
  tap stops the forward after the deepest feature layer), and one micro-batch forward
  under no_grad per target thread on that device;
* per drafter replica: fp32 master weights, fp32 gradients (twice under `compile:
  cudagraphs`: the graph's own and the copies it hands out, cudagraphs._hand_out_gradients),
  the optimizer's own gradient copy (compile default and cudagraphs, training/optimizer_step.py),
  AdamW's two fp32 moments, the gradient exchange's flat buffer and the averaged copy it
  gets back (training/gradients.py; none with one replica in the run), the target features
  waiting in its queue, and the activations of the largest micro-batch the data can
  make (under cudagraphs: its private graph pool, sized by that bucket and reserved all
  run; otherwise freed between steps, with the same peak);
* the target's embedding and LM head copied once to every device that holds drafters
  but no target (replica.FrozenTargetWeights: on the target's device they are the
  target's own tensors);
* the evaluator, on the first target device: a drafter in fp32, the LM head cast to
  fp32, and one prompt's decode (prefill logits, KV cache);
* per device, the CUDA context and the caching allocator's slack.

Every coefficient is a named constant in the block below, and only there: they are
counted from the code, to be calibrated against measured peaks
(`peak_memory_bytes` of step events, bench/RESULTS-h200.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import DataConfig, DrafterConfig, TinyTargetSpec, JobConfig, blocks_per_row, rows_per_micro_batch

GIB = 1 << 30
MIB = 1 << 20
FP32 = 4
BF16 = 2

# --- the coefficients (calibrate here) ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PerToken:
    """Bytes one token keeps, as multiples of the model's widths: `hidden`, `query` (heads
    x head_dim), `kv` (kv heads x head_dim), `intermediate`, `features` (feature layers x
    hidden) and `head_dim`."""

    hidden: float = 0.0
    query: float = 0.0
    kv: float = 0.0
    intermediate: float = 0.0
    features: float = 0.0
    head_dim: float = 0.0

    def of(self, widths: Widths) -> float:
        return (self.hidden * widths.hidden + self.query * widths.query + self.kv * widths.kv
                + self.intermediate * widths.intermediate + self.features * widths.features
                + self.head_dim * widths.head_dim)


@dataclasses.dataclass(frozen=True)
class Widths:
    """A model's widths, in elements (PerToken's units)."""

    hidden: int
    query: int
    kv: int
    intermediate: int
    features: int
    head_dim: int


# Drafter activations kept for the backward, counted from model/modeling_dflash.py under bf16
# autocast over fp32 master weights: a Qwen3RMSNorm keeps its fp32 input and its bf16
# normed value and returns fp32 (its weight is fp32), so the residual stream is fp32;
# autocast casts a linear's input to bf16 at every call (k_proj and v_proj each cast
# the context).
# Per block token and drafter layer: residuals and norms 26 hidden (input norm 4+4,
# three bf16 casts for q/k/v 6, post-attention norm 4+4+4, MLP input casts 4), queries
# 20 (q_norm 4+2, RoPE 4+4, SDPA's bf16 cast 2, attention output and its reshape 4),
# keys and values 14 (k_norm 4+2, RoPE 4+4, the concatenated values 2, SDPA's bf16
# cast of the keys 2), the MLP 8 intermediate (gate, silu, up and their product, bf16).
BLOCK_TOKEN_PER_LAYER = PerToken(hidden=26, query=20, kv=14, intermediate=8)
# Per context token and drafter layer: the two bf16 casts of the context for k_proj and
# v_proj, and its keys and values (k_norm, RoPE, v).
CONTEXT_TOKEN_PER_LAYER = PerToken(hidden=4, kv=14)
# Per block token, once: its embedding (bf16) and fp32 copy, the final norm's fp32 input
# and normed value, and the loss's fp32 gradient basis (model/head_loss.py).
BLOCK_TOKEN_ONCE = PerToken(hidden=18)
# Per context token, once: the features' bf16 input of `fc`, hidden_norm's fp32 input and
# normed value, the fp32 context every layer reads.
CONTEXT_TOKEN_ONCE = PerToken(hidden=10, features=2)
# Per key position (context + block), once: RoPE's fp32 cos and sin.
ROPE_PER_KEY = PerToken(head_dim=8)
# drafter.attention sdpa only (modeling_dflash.dense_attention): per key position and
# layer, the key and value heads repeated up to the query heads, in bf16; per (query,
# key) pair of a row, the boolean block mask once and, per layer, the bf16 additive mask
# the memory-efficient kernel keeps for its backward. FlexAttention's BlockMask is sparse
# and counted as nothing.
SDPA_PER_KEY_PER_LAYER = PerToken(query=4)
SDPA_MASK_BYTES_PER_PAIR = 1
SDPA_BIAS_BYTES_PER_PAIR_PER_LAYER = 2
# compile: default and cudagraphs keep fewer of the forward's tensors than eager (Inductor
# fuses the norms, casts and RoPE and recomputes pointwise results). Fitted on the H200
# (bench/RESULTS-h200.md, "The shipped configs on one H200"): the eager count above is
# what the eager step measured at 4x3072 (50 GiB beyond weights), and a cudagraphs
# drafter's private pool at 2x3072 held 18.4 GiB, 0.62 of its eager count with the loss
# chunk beside it.
COMPILED_ACTIVATIONS = 0.62
# The LM-head loss runs over chunks of block positions (model/head_loss.py), so the (positions,
# vocab) logits are never whole: a chunk holds LOSS_CHUNK_BYTES of fp32 logits (the
# trainer's head_loss.LOSS_CHUNK_BYTES: keep them equal), and with its softmax and casts
# about LOSS_CHUNK_PEAK times that at its peak.
LOSS_CHUNK_BYTES = 1 << 30
LOSS_CHUNK_PEAK = 2.5
# The target's no_grad forward, per token, in elements of the target's dtype: a layer's
# residual, norms, q/k/v, attention output (hidden-wide, a few at a time) and its MLP
# (intermediate-wide), and the captured features with their concatenation. Against the
# 0.8 GB the Qwen3-8B target took beyond its weights for one 3072-token sequence
# (bench/RESULTS-h200.md, 2 H200s: 17.2 GB peak on the target's GPU).
TARGET_TOKEN = PerToken(hidden=10, intermediate=4, features=2)
# Feature batches a drafter's device holds beyond its queue's `pipeline.queue_size`: the
# one its step reads and the one a target thread made and waits to put (threaded).
FEATURE_BATCHES_BEYOND_QUEUE = 2
# The evaluator's drafter context, per position: the tapped features and their
# concatenation in the target's dtype, and `fc`'s fp32 input of them.
EVAL_CONTEXT = PerToken(features=2)
EVAL_CONTEXT_FP32 = PerToken(features=1)
# Per device: the CUDA context, cuBLAS workspaces and NCCL's buffers.
CUDA_CONTEXT_BYTES = 1 * GIB
# The caching allocator's slack (blocks split and rounded, streams' pools), as a share
# of every tensor counted: with it the estimate of the one-GPU Qwen3-8B run is 1% above
# what that run held (step events' peak plus the graph pools' reserve, RESULTS-h200.md).
FRAGMENTATION = 0.04
# What a run may plan on: nvidia-smi's memory.total less this share (the driver's and
# ECC's reservations, which torch never sees: torch reports 139.8 GiB of an H200's
# 143771 MiB).
CAPACITY_MARGIN = 0.03
# A tiny target's vocabulary beyond its words: tiny.SPECIAL_TOKENS and tiny.ROLE_WORDS.
TINY_EXTRA_TOKENS = 8
# tiny._build_model's positions.
TINY_MAX_POSITIONS = 4096


# --- the target's shape ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TargetShape:
    """The target fields the plan needs, from its config.json (or a tiny spec)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    model_type: str = "qwen3"
    attention_bias: bool = False
    # Mixture of experts (Qwen3-MoE's num_experts, Mixtral's num_local_experts); 0: dense.
    num_experts: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, 0 without

    @classmethod
    def from_config_json(cls, fields: dict[str, Any]) -> TargetShape:
        """A Hugging Face config.json's fields; ValueError naming the keys it lacks."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [key for key in required if not isinstance(fields.get(key), int)]
        if missing:
            raise ValueError(f"config.json has no {', '.join(missing)} (not a decoder language model's?)")
        heads = fields["num_attention_heads"]
        experts = fields.get("num_experts") or fields.get("num_local_experts") or 0
        return cls(
            vocab_size=fields["vocab_size"], hidden_size=fields["hidden_size"],
            intermediate_size=fields["intermediate_size"], num_layers=fields["num_hidden_layers"],
            num_heads=heads, num_kv_heads=fields.get("num_key_value_heads") or heads,
            head_dim=fields.get("head_dim") or fields["hidden_size"] // heads,
            # transformers' own default where a config.json leaves the key out
            tie_word_embeddings=bool(fields.get("tie_word_embeddings", True)),
            model_type=str(fields.get("model_type", "")), attention_bias=bool(fields.get("attention_bias", False)),
            num_experts=experts,
            expert_intermediate_size=fields.get("moe_intermediate_size") or fields["intermediate_size"],
            shared_expert_intermediate_size=fields.get("shared_expert_intermediate_size") or 0)

    @classmethod
    def from_tiny(cls, spec: TinyTargetSpec) -> TargetShape:
        """The random Qwen3 target data/tiny.py builds from `spec`."""
        return cls(vocab_size=spec.vocab_words + TINY_EXTRA_TOKENS, hidden_size=spec.hidden_size,
                   intermediate_size=spec.intermediate_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, tie_word_embeddings=False)

    @property
    def query_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def parameters(self) -> int:
        """What transformers builds for this config: exact for Qwen3 and Qwen3-MoE; for
        other dense decoders (Llama, Qwen2, Mistral) the same layout, with Qwen2's q/k/v
        biases; other MoE layouts are a best effort (every layer counted as experts +
        router, plus a shared expert where the config names one)."""
        hidden, query, kv = self.hidden_size, self.query_width, self.kv_width
        qkv_bias = self.attention_bias or self.model_type.startswith("qwen2")
        attention = hidden * (query + 2 * kv) + query * hidden
        attention += (query + 2 * kv) * qkv_bias + hidden * self.attention_bias
        if self.model_type.startswith("qwen3"):
            attention += 2 * self.head_dim  # q_norm, k_norm
        if self.num_experts:
            mlp = self.num_experts * (3 * hidden * self.expert_intermediate_size + hidden)  # experts + router
            if self.shared_expert_intermediate_size:
                mlp += 3 * hidden * self.shared_expert_intermediate_size + hidden  # + its gate
        else:
            mlp = 3 * hidden * self.intermediate_size
        layer = attention + mlp + 2 * hidden  # + input and post-attention norms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + hidden  # + the final norm


def feature_layers(drafter: DrafterConfig) -> int:
    """How many target layers feed the drafter (model.drafter.default_target_layer_ids' count)."""
    if drafter.target_layer_ids is not None:
        return len(drafter.target_layer_ids)
    return drafter.num_target_features or drafter.num_layers


def drafter_parameters(target: TargetShape, drafter: DrafterConfig) -> int:
    """model.drafter.DFlashDrafter's: Qwen3 layers at the target's widths (no embedding, no head),
    `fc` from the feature layers to hidden, and the norms."""
    hidden, query, kv = target.hidden_size, target.query_width, target.kv_width
    intermediate = drafter.intermediate_size or target.intermediate_size
    layer = hidden * (query + 2 * kv) + query * hidden + 2 * target.head_dim + 3 * hidden * intermediate + 2 * hidden
    return drafter.num_layers * layer + feature_layers(drafter) * hidden * hidden + 2 * hidden  # + norm, hidden_norm


# --- micro-batches -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
    """A micro-batch: `rows` sequences of `length` tokens, `blocks` anchors a row (as
    data.batches.BatchShape, which needs torch)."""

    rows: int
    length: int
    blocks: int

    def __str__(self) -> str:
        return f"{self.rows}x{self.length} ({self.blocks} blocks)"


def micro_batch_shapes(data: DataConfig, drafter: DrafterConfig) -> tuple[Shape, ...]:
    """The largest micro-batch of every padded length data/batches.py can make: as many rows as
    the token budgets allow (config.rows_per_micro_batch), each with as many blocks as a
    row of that length can have (length - 2 anchors, rounded up to 8, at most
    num_anchors). The same shapes as cudagraphs.bucket_shapes, whose buckets are these."""
    return tuple(Shape(rows_per_micro_batch(data, drafter, n), n, blocks_per_row(n - 2, drafter.num_anchors))
                 for n in data.padded_lengths())


def loss_chunk_rows(vocab: int) -> int:
    """Block positions per chunk of the loss (head_loss.chunk_rows)."""
    return max(1, LOSS_CHUNK_BYTES // (FP32 * vocab))


def _activation_bytes(config: JobConfig, target: TargetShape, shape: Shape) -> float:
    widths = _widths(config, target)
    blocks = shape.blocks * config.drafter.block_size
    keys = shape.length + blocks
    layers = config.drafter.num_layers
    row = (shape.length * (CONTEXT_TOKEN_ONCE.of(widths) + layers * CONTEXT_TOKEN_PER_LAYER.of(widths))
           + blocks * (BLOCK_TOKEN_ONCE.of(widths) + layers * BLOCK_TOKEN_PER_LAYER.of(widths))
           + keys * ROPE_PER_KEY.of(widths))
    if not config.uses_flex:
        row += keys * layers * SDPA_PER_KEY_PER_LAYER.of(widths)
        row += blocks * keys * (SDPA_MASK_BYTES_PER_PAIR + layers * SDPA_BIAS_BYTES_PER_PAIR_PER_LAYER)
    return shape.rows * row * (1.0 if config.compile == "off" else COMPILED_ACTIVATIONS)


def _widths(config: JobConfig, target: TargetShape) -> Widths:
    return Widths(hidden=target.hidden_size, query=target.query_width, kv=target.kv_width,
                  intermediate=config.drafter.intermediate_size or target.intermediate_size,
                  features=feature_layers(config.drafter) * target.hidden_size, head_dim=target.head_dim)


# --- the plan ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Term:
    """`count` times `each` bytes of one kind on a device; `knob`: the config keys that
    change it ("" for what no key changes)."""

    name: str
    each: int
    count: int = 1
    knob: str = ""

    @property
    def bytes(self) -> int:
        return self.each * self.count


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    device: str  # "cuda:N"
    roles: tuple[str, ...]  # the threads using it: target-0, drafter-1, eval
    terms: tuple[Term, ...]  # the tensors
    overhead: tuple[Term, ...]  # the CUDA context and the allocator's slack

    @property
    def total(self) -> int:
        return sum(term.bytes for term in self.terms + self.overhead)

    @property
    def index(self) -> int:
        return int(self.device.split(":")[1])

    def largest(self, count: int | None = None) -> tuple[Term, ...]:
        """The tensor terms, largest first."""
        return tuple(sorted(self.terms, key=lambda term: -term.bytes)[:count])


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    devices: tuple[DevicePlan, ...]  # in the order the config first names them
    worst: Shape | None  # the micro-batch whose activations are the largest (None: a regenerate job)
    drafter_parameters: int
    target_parameters: int


def usable_bytes(memory_total_mib: float) -> int:
    """What a run may plan on of a GPU whose nvidia-smi memory.total is this."""
    return int(memory_total_mib * MIB * (1 - CAPACITY_MARGIN))


def _device(name: str) -> str:
    return "cuda:0" if name == "cuda" else name  # devices.canonical, torch-free


def _evaluates(config: JobConfig, rank: int) -> bool:
    """Whether this process evaluates (startup.prepare: rank 0, with eval prompts)."""
    data = config.data
    if rank != 0 or config.eval.num_prompts == 0 or data is None:
        return False
    if data.eval is not None:
        return True
    return config.target.tiny is not None and (data.synthetic is None or data.synthetic.num_eval > 0)


def _target_bytes(config: JobConfig) -> int:
    return FP32 if config.target.dtype == "float32" else BF16  # auto: bf16 on CUDA


def estimate(config: JobConfig, target: TargetShape, *, world_size: int = 1, rank: int = 0) -> MemoryPlan:
    """The peak of every CUDA device of a `job: train` or `job: regenerate` config on one
    host, that host being rank `rank` of `world_size` (the gradient exchange and the
    evaluator depend on it)."""
    if config.job == "regenerate":
        return _regenerate_plan(config, target)
    if config.job != "train" or config.data is None:
        raise ValueError(f"job: {config.job}: only training and regenerate runs are planned")
    if config.devices.cpu_only:
        raise ValueError("the config runs on the CPU only: it uses no GPU memory")
    target_devices = [_device(d) for d in config.devices.target]
    drafter_devices = [_device(d) for d in config.devices.drafters]
    element = _target_bytes(config)
    shapes = micro_batch_shapes(config.data, config.drafter)
    worst = max(shapes, key=lambda shape: _activation_bytes(config, target, shape))
    tokens = max(shape.rows * shape.length for shape in shapes)  # the target's largest forward
    params = drafter_parameters(target, config.drafter)
    per_drafter = _drafter_terms(config, target, params, worst, tokens, replicas=world_size * len(drafter_devices))
    evaluator = _evaluator_terms(config, target, params, element) if _evaluates(config, rank) else []
    plans = []
    for device in dict.fromkeys(target_devices + drafter_devices):
        roles = [f"target-{i}" for i, d in enumerate(target_devices) if d == device]
        terms = []
        if roles:  # one model per device, shared by its target threads, each running a forward
            terms += [Term("target weights", target.parameters() * element,
                           knob="devices.drafters (drafters on other GPUs)"),
                      Term("target forward", int(tokens * TARGET_TOKEN.of(_widths(config, target))) * element,
                           count=len(roles), knob="data.token_budget")]
        if evaluator and device == target_devices[0]:
            roles.append("eval")
            terms += evaluator
        drafters = [f"drafter-{i}" for i, d in enumerate(drafter_devices) if d == device]
        if drafters:
            terms += [dataclasses.replace(term, count=len(drafters)) for term in per_drafter]
            if device not in target_devices:
                terms.append(Term("target embedding + LM head copy",
                                  2 * target.vocab_size * target.hidden_size * element,
                                  knob="devices.drafters (on the target's GPU they share its own)"))
        roles += drafters
        overhead = (Term("CUDA context", CUDA_CONTEXT_BYTES),
                    Term(f"allocator slack ({FRAGMENTATION:.0%})", int(sum(t.bytes for t in terms) * FRAGMENTATION)))
        plans.append(DevicePlan(device, tuple(roles), tuple(terms), overhead))
    return MemoryPlan(tuple(plans), worst, params, target.parameters())


# job: regenerate (model/batched_decode.py): beside its KV cache, a step's choice holds a
# few fp32 copies of every row's logits, and a prefill chunk of PREFILL_TOKENS tokens its
# activations (about PREFILL_WIDTHS hidden-sized and 3 MLP-sized tensors at once).
SAMPLING_PASSES = 4
PREFILL_TOKENS = 8192
PREFILL_WIDTHS = 8


def regenerate_terms(target: TargetShape, element: int, rows: int, positions: int, knob: str) -> list[Term]:
    """What job: regenerate's decoder holds beside the target's weights on each device: a
    KV cache of `rows` rows of `positions` positions, the step's logits, a prefill chunk."""
    return [Term(f"KV cache: {rows} rows x {positions} positions",
                 rows * positions * target.num_layers * 2 * target.kv_width * element, knob=knob),
            Term("logits and sampling (fp32)", rows * SAMPLING_PASSES * target.vocab_size * FP32,
                 knob="regenerate.batch_size"),
            Term(f"prefill of {PREFILL_TOKENS} tokens",
                 PREFILL_TOKENS * (PREFILL_WIDTHS * target.hidden_size + 3 * target.intermediate_size) * element)]


def _regenerate_plan(config: JobConfig, target: TargetShape) -> MemoryPlan:
    """One target and its decoder per device. The prompts' own positions are not known
    before the job reads them (on the host): the cache is counted for the answers' alone,
    and the job checks again, with them, before it allocates (jobs/regenerate.py)."""
    assert config.regenerate is not None
    if config.devices.cpu_only:
        raise ValueError("the config runs on the CPU only: it uses no GPU memory")
    settings, element = config.regenerate, _target_bytes(config)
    knob = f"regenerate.batch_size ({settings.batch_size}), regenerate.max_new_tokens ({settings.max_new_tokens})"
    plans = []
    for index, device in enumerate(dict.fromkeys(_device(d) for d in config.devices.target)):
        terms = [Term("target weights", target.parameters() * element),
                 *regenerate_terms(target, element, settings.batch_size, settings.max_new_tokens,
                                   knob + " (+ the longest prompt, checked by the job)")]
        overhead = (Term("CUDA context", CUDA_CONTEXT_BYTES),
                    Term(f"allocator slack ({FRAGMENTATION:.0%})", int(sum(t.bytes for t in terms) * FRAGMENTATION)))
        plans.append(DevicePlan(device, (f"target-{index}",), tuple(terms), overhead))
    return MemoryPlan(tuple(plans), None, 0, target.parameters())


def _drafter_terms(config: JobConfig, target: TargetShape, params: int, worst: Shape, tokens: int,
                   replicas: int) -> list[Term]:
    """What one drafter replica keeps on its device; `replicas` in the whole run."""
    assert config.data is not None
    data, drafter, compile_mode = config.data, config.drafter, config.compile
    weights = params * FP32
    terms = [Term("drafter weights (fp32)", weights, knob="devices.drafters, drafter.num_layers")]
    if compile_mode == "cudagraphs":  # the graph's own gradients, and the copies it hands out
        terms.append(Term("gradients (2 x fp32: the graph's, handed out)", 2 * weights, knob="compile"))
    else:
        terms.append(Term("gradients (fp32)", weights, knob="devices.drafters"))
    if compile_mode != "off":  # the device and graph forms of training/optimizer_step.py
        terms.append(Term("optimizer's gradient copy (fp32)", weights, knob="compile"))
    terms.append(Term("AdamW moments (2 x fp32)", 2 * weights, knob="devices.drafters, drafter.num_layers"))
    if replicas > 1:
        terms.append(Term("gradient exchange (flat buffer + averaged copy)", 2 * weights, knob="devices.drafters"))
    knob = (f"data.token_budget ({data.token_budget}), data.block_token_budget ({data.block_token_budget or 'null'}), "
            f"drafter.num_anchors ({drafter.num_anchors})")
    if compile_mode == "off":
        knob += ", compile (compiled steps keep fewer)"
    name = f"CUDA graph pool, reserved: {worst}" if compile_mode == "cudagraphs" else f"activations: {worst}"
    terms.append(Term(name, int(_activation_bytes(config, target, worst)), knob=knob))
    positions = worst.rows * worst.blocks * (drafter.block_size - 1)  # the block positions with a loss
    chunk = min(loss_chunk_rows(target.vocab_size), positions) * target.vocab_size * FP32
    terms.append(Term("LM-head loss chunk", int(chunk * LOSS_CHUNK_PEAK)))
    queued = config.pipeline.queue_size + FEATURE_BATCHES_BEYOND_QUEUE if config.pipeline.mode == "threaded" else 1
    features = tokens * _widths(config, target).features * _target_bytes(config)
    terms.append(Term(f"target features queued ({queued} batches)", queued * features,
                      knob=f"pipeline.queue_size ({config.pipeline.queue_size}), data.token_budget"))
    return terms


def _evaluator_terms(config: JobConfig, target: TargetShape, params: int, element: int) -> list[Term]:
    """speculative.evaluate on the first target device: a drafter copy in fp32, the LM head
    cast to fp32 once, and one prompt's decode: the prefill's logits and forward, the
    target's static KV cache of every layer, the drafter's context and its keys and values
    per layer (model/fast_decode.py). Eval prompts are not
    cut; the plan takes one as long as data.max_length."""
    assert config.data is not None
    prompt = config.data.max_length
    positions = prompt + config.eval.max_new_tokens + config.drafter.block_size
    widths = _widths(config, target)
    kv_cache = target.num_layers * 2 * target.kv_width * element * positions
    prefill = prompt * (target.vocab_size * element + int(TARGET_TOKEN.of(widths)) * element)
    context = positions * int(EVAL_CONTEXT.of(widths) * element + EVAL_CONTEXT_FP32.of(widths) * FP32)
    drafter_cache = config.drafter.num_layers * 2 * target.kv_width * FP32 * positions  # its context's keys, values
    off = "eval.num_prompts (0: no evaluation)"
    terms = [Term("evaluator drafter (fp32)", params * FP32, knob=off)]
    if element != FP32:  # an fp32 head is the target's own tensor
        terms.append(Term("evaluator LM head (fp32 copy)", target.vocab_size * target.hidden_size * FP32, knob=off))
    terms.append(Term("evaluator decode (prefill, KV caches)", kv_cache + prefill + context + drafter_cache,
                      knob=f"eval.max_new_tokens ({config.eval.max_new_tokens}), {off}"))
    return terms
