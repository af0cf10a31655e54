"""The DFlash training objective: anchors, blocks, the block mask and the weighted loss.

Per sequence, anchors are sampled among response tokens. Each anchor starts a block
`[anchor token, MASK x (block_size-1)]` at positions `anchor + k`; block position k
predicts the token at `anchor + k` (the anchor itself carries no loss) with weight
exp(-(k-1)/gamma), but only while `anchor + k` is in the anchor's own assistant turn:
inference drafts a block after a token of one answer, never across the next user turn
into another answer. A block sees the target features strictly before its anchor and
its own block (bidirectionally), never other blocks.

Turns are given per token as `turn_ids`: the index of the assistant turn the token
belongs to (and is learnt in), NO_TURN (-1) for every other token (prompt, user turns,
template text after a truncated answer, padding). Each turn is one contiguous run of
tokens with an id of its own, so "every token from the anchor to anchor + k is in the
anchor's turn" is the same as "anchor + k has the anchor's turn id".
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import NO_TURN
from .drafter import DFlashDrafter
from .head_loss import chunk_rows, head_cross_entropy


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(block_size-1,) loss weight of block positions k = 1..block_size-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A per-(epoch, sample) seed: anchors are reshuffled every epoch, yet a resumed run
    draws exactly the anchors the uninterrupted run would have."""
    return ((seed * 1_000_003 + epoch) * 1_000_033 + sample_index) % (2**63 - 1)


def anchor_candidates(turn_ids: torch.Tensor) -> torch.Tensor:
    """Positions (n,) that may anchor a block in one unpadded sequence; turn_ids (L,).

    An anchor is a token of an assistant turn with at least one position before it (the
    context) and the next token in the same turn (something to predict): the last token
    of a turn, truncated or not, would anchor a block with nothing to learn."""
    same_turn_next = (turn_ids[1:-1] != NO_TURN) & (turn_ids[1:-1] == turn_ids[2:])
    return torch.nonzero(same_turn_next).flatten() + 1


def sample_anchors(turn_ids: torch.Tensor, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted anchor positions (n,), at most `num_anchors` of the candidates, drawn at random."""
    candidates = anchor_candidates(turn_ids)
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return torch.sort(candidates).values


def block_labels(input_ids: torch.Tensor, turn_ids: torch.Tensor, anchors: torch.Tensor,
                 anchor_valid: torch.Tensor, weights_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and loss weights of every block position k >= 1.

    input_ids, turn_ids (B, S); anchors, anchor_valid (B, N); weights_k (bs-1,)
    -> labels (B, N, bs-1) long, weights (B, N, bs-1) float: 0 where nothing to learn,
    i.e. past the sequence, for an unused block, and wherever `anchor + k` is not in
    the anchor's assistant turn (see the module docstring)."""
    seq_len = input_ids.shape[1]
    offsets = torch.arange(1, weights_k.numel() + 1)
    positions = anchors.unsqueeze(-1) + offsets  # (B, N, bs-1)
    inside = positions < seq_len
    flat = positions.clamp(max=seq_len - 1).flatten(1)  # (B, N*(bs-1))
    labels = input_ids.gather(1, flat).view_as(positions)
    anchor_turn = turn_ids.gather(1, anchors).unsqueeze(-1)  # (B, N, 1)
    same_turn = (turn_ids.gather(1, flat).view_as(positions) == anchor_turn) & (anchor_turn != NO_TURN)
    learnable = same_turn & inside & anchor_valid.unsqueeze(-1)
    return labels, learnable.float() * weights_k


def dense_block_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int,
                     block_size: int) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, N*bs, S + N*bs), True = may attend.

    An unused block (anchor_valid False) sees only itself: a fully masked row would
    make SDPA return NaN, and such blocks carry zero loss weight anyway."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    q_block = torch.arange(q_len, device=anchors.device) // block_size  # (Q,)
    anchor_of_q = anchors[:, q_block]  # (B, Q)
    context = torch.arange(context_len, device=anchors.device).view(1, 1, -1) < anchor_of_q.unsqueeze(-1)
    context = context & anchor_valid[:, q_block].unsqueeze(-1)  # (B, Q, S)
    same_block = (q_block.view(-1, 1) == q_block.view(1, -1)).expand(batch, q_len, q_len)
    return torch.cat([context, same_block], dim=-1).unsqueeze(1)


def flex_block_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, context_len: int, block_size: int):
    """The same visibility as `dense_block_mask`, as a FlexAttention BlockMask (sparse)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_blocks = anchors.shape

    def visible(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        sees_context = (kv_idx < context_len) & (kv_idx < anchors[b, q_block]) & anchor_valid[b, q_block]
        sees_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == q_block)
        return sees_context | sees_block

    q_len = num_blocks * block_size
    return create_block_mask(visible, B=batch, H=None, Q_LEN=q_len, KV_LEN=context_len + q_len,
                             device=anchors.device)


@dataclasses.dataclass
class DrafterInputs:
    """One micro-batch on a drafter's device."""

    input_ids: torch.Tensor  # (B, S) long
    features: torch.Tensor  # (B, S, n*H) target layer outputs
    anchors: torch.Tensor  # (B, N) long
    anchor_valid: torch.Tensor  # (B, N) bool
    labels: torch.Tensor  # (B, N, bs-1) long
    weights: torch.Tensor  # (B, N, bs-1) float


class DraftObjective(nn.Module):
    """Forward + loss of one replica. The target's embedding and LM head are frozen
    tensors shared with the target (not parameters of this module)."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 use_flex: bool, loss_chunk_rows: int | None = None):
        super().__init__()
        self.drafter = drafter
        self.embed_weight = embed_weight  # (V, H)
        self.lm_head_weight = lm_head_weight  # (V, H)
        self.use_flex = use_flex
        # Block positions whose logits are computed at once (head_loss.LOSS_CHUNK_BYTES).
        self.loss_chunk_rows = loss_chunk_rows or chunk_rows(lm_head_weight.shape[0])

    def forward(self, inputs: DrafterInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> loss (), correct (bs-1,), counted (bs-1,): weighted CE and per-position hits."""
        hidden = self.block_hidden(inputs)  # (B, N, bs-1, H)
        # The logits (B, N, bs-1, V) never exist whole: head_loss.py, chunk by chunk.
        token_loss, hit, _ = head_cross_entropy(hidden.flatten(0, 2), self.lm_head_weight, inputs.labels.flatten(),
                                                self.loss_chunk_rows)
        weights = inputs.weights.flatten()
        loss = (token_loss * weights).sum() / weights.sum().clamp_min(1e-6)
        with torch.no_grad():
            counted = inputs.weights > 0
            correct = (hit.view_as(counted) & counted).sum(dim=(0, 1))
        return loss, correct, counted.sum(dim=(0, 1))

    def block_hidden(self, inputs: DrafterInputs) -> torch.Tensor:
        """The drafter's last hidden states at every block position k >= 1: (B, N, bs-1, H)."""
        block_size = self.drafter.block_size
        batch, seq_len = inputs.input_ids.shape
        num_blocks = inputs.anchors.shape[1]
        block_ids = torch.full((batch, num_blocks, block_size), self.drafter.mask_token_id,
                               dtype=torch.long, device=inputs.input_ids.device)
        block_ids[:, :, 0] = inputs.input_ids.gather(1, inputs.anchors)
        block_embeds = F.embedding(block_ids.view(batch, -1), self.embed_weight)  # (B, N*bs, H)
        offsets = torch.arange(block_size, device=inputs.anchors.device)
        block_positions = (inputs.anchors.unsqueeze(-1) + offsets).view(batch, -1)  # (B, N*bs)
        context_positions = torch.arange(seq_len, device=inputs.anchors.device).expand(batch, -1)
        make_mask = flex_block_mask if self.use_flex else dense_block_mask
        mask = make_mask(inputs.anchors, inputs.anchor_valid, seq_len, block_size)
        device_type = inputs.input_ids.device.type
        # fp32 master weights; bf16 compute on CUDA, plain fp32 on CPU.
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            hidden = self.drafter(block_embeds, inputs.features, context_positions, block_positions, mask)
        return hidden.view(batch, num_blocks, block_size, -1)[:, :, 1:]  # the anchor predicts nothing


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """LR multiplier: linear warm-up over `warmup_ratio` of the steps, then cosine to 0."""
    warmup = max(1, int(round(total_steps * warmup_ratio)))

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
