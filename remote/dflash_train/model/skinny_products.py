"""x @ wᵀ for a few rows of x, as fp32 parts over K: the verify and draft steps' products.

A step of a few positions (the verify and draft steps' 16 rows) multiplies each weight
matrix by a sliver of activations: the product reads the weight once and computes next to
nothing, so its time is the weight's bytes over the memory's bandwidth, if enough loads
are in flight. cuBLAS picks tiles made for tall products, and where few output tiles come
out it splits K and sums the parts in a kernel of its own. `product_parts` takes its tiles
from the caller (fast_layers.TRITON_PRODUCTS, measured per role by bench/skinny_products.py):
each program computes `block_n` outputs over one of `parts` shares of K, streaming the
weight in `block_k`-wide tiles through `stages` pipelined loads, and writes its fp32 part;
the caller sums the parts, which a compiled step does inside the kernel that consumes the
product (the residual add, the gate, the q/k norm), so no reduction kernel runs.

`swap` computes (w xᵀ)ᵀ instead: the weight's rows fill the tensor cores' tall side and the
few activation rows the short one, which a 16-row x cannot.

It is a torch.library.triton_op, so torch.compile traces it into the step's graph (and the
CUDA graph that captures it) as the Triton kernel it is. CUDA only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

ROWS_BLOCK = 16  # x's rows padded to the 16 a tensor-core dot needs


@triton.jit
def _product_parts(x_ptr, w_ptr, out_ptr, rows, part_k, stride_x, stride_w, stride_part, stride_row,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                   SWAP: tl.constexpr):
    tile, part = tl.program_id(0), tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = part * part_k + tl.arange(0, BLOCK_K)
    live = m[:, None] < rows
    x_tile = x_ptr + m[:, None] * stride_x + k[None, :]  # (BLOCK_M, BLOCK_K)
    w_tile = w_ptr + n[:, None] * stride_w + k[None, :]  # (BLOCK_N, BLOCK_K): the caller checks N and K fit
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in tl.range(0, part_k, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_tile, mask=live, other=0.0)
        w = tl.load(w_tile)
        if SWAP:
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w))
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    out = out_ptr + part * stride_part + m[:, None] * stride_row + n[None, :]
    tl.store(out, tl.trans(acc) if SWAP else acc, mask=live)


def fits(rows: int, outputs: int, width: int, parts: int, block_n: int, block_k: int) -> bool:
    """Whether tiles of block_n outputs by block_k cover (outputs, width) split in `parts`
    exactly (the kernel masks no weight load) for x of `rows` rows."""
    return (0 < rows <= ROWS_BLOCK and outputs % block_n == 0 and width % parts == 0
            and (width // parts) % block_k == 0)


@triton_op("dflash::product_parts", mutates_args={})
def product_parts(x: torch.Tensor, w: torch.Tensor, parts: int, block_n: int, block_k: int, stages: int,
                  warps: int, swap: bool) -> torch.Tensor:
    """x (M, K), w (N, K), both dense in K -> (parts, M, N) fp32 whose sum over dim 0 is
    x @ wᵀ; the shapes must fit the tiles (`fits`)."""
    x = x.contiguous()  # a view of the attention's output may not be
    rows, width = x.shape
    outputs = w.shape[0]
    out = torch.empty((parts, rows, outputs), dtype=torch.float32, device=x.device)
    wrap_triton(_product_parts)[(outputs // block_n, parts)](
        x, w, out, rows, width // parts, x.stride(0), w.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=ROWS_BLOCK, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, SWAP=swap, num_warps=warps)
    return out
