"""Cross-entropy through the frozen LM head, a chunk of positions at a time.

The drafter's loss reads the target's LM head at every block position: (B, N, bs-1)
positions x vocab logits. At the Qwen3-8B recipe shape (512 anchors, block 16, vocab
151,936) that is 4.7 GB of fp32 logits per sequence, and autograd keeps them, their
softmax and their gradient alive until the backward: the largest term of a drafter's
memory. The head is frozen, so the only gradient wanted is the one for the hidden
states, and it is known in the forward: for position i with logits z_i and label y_i,

    d loss_i / d h_i = (softmax(z_i) - onehot(y_i)) @ W          (W: the (V, H) head)

`head_cross_entropy` computes, chunk by chunk, each position's loss, whether its argmax
hits the label, and that gradient basis G_i; its backward is grad_loss_i * G_i. Only
one chunk's logits exist at a time (LOSS_CHUNK_BYTES of fp32 logits), plus G (M, H) in
the hidden states' dtype. It is an opaque custom op, so Inductor neither fuses the
chunks back into one (V-wide) buffer nor needs to trace the loop, and a CUDA graph
captures its kernels like any others. The matmuls run in the head's dtype, as the
materialized loss did (the hidden states are cast to it, never the head).
"""
from __future__ import annotations

import torch

# fp32 logits of one chunk: 1 GiB, 1,766 positions at Qwen3's vocabulary. The chunk's
# softmax, its cast to the head's dtype and its logits in that dtype come on top (about
# 2.5x this in all at the peak of a chunk).
LOSS_CHUNK_BYTES = 1 << 30


def chunk_rows(vocab: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    """Positions per chunk: as many as fit `chunk_bytes` of fp32 logits, at least one."""
    return max(1, chunk_bytes // (4 * vocab))


@torch.library.custom_op("dflash::head_cross_entropy", mutates_args=())
def head_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                       rows_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (M, H), head (V, H) frozen, labels (M,) long -> token_loss (M,) fp32,
    hit (M,) bool (argmax == label), basis (M, H) in hidden's dtype: d token_loss / d hidden."""
    token_loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    hit = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    basis = torch.empty_like(hidden)
    # The matmuls in the head's dtype, as the caller's autocast would not reach in here.
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], rows_per_chunk):
            end = min(start + rows_per_chunk, hidden.shape[0])
            target = labels[start:end]
            logits = (hidden[start:end].to(head.dtype) @ head.t()).float()  # (c, V)
            hit[start:end] = logits.argmax(-1) == target
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            token_loss[start:end] = lse - logits.gather(1, target.unsqueeze(1)).squeeze(1)
            probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the logits' buffer
            probs.scatter_add_(1, target.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
            basis[start:end] = (probs.to(head.dtype) @ head).to(hidden.dtype)
    return token_loss, hit, basis


@head_cross_entropy.register_fake
def _(hidden, head, labels, rows_per_chunk):
    rows = hidden.shape[0]
    return (hidden.new_empty(rows, dtype=torch.float32), hidden.new_empty(rows, dtype=torch.bool),
            torch.empty_like(hidden))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[2])


def _backward(ctx, grad_loss, grad_hit, grad_basis):
    (basis,) = ctx.saved_tensors
    return (grad_loss.unsqueeze(1) * basis).to(basis.dtype), None, None, None


head_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
