"""Grouped-query attention of a few new positions over per-row KV caches, split over the keys.

A decode step's attention reads a small cache through few queries: the evaluator's verify
step has 16 positions of one row, each KV head shared by G query heads. Spread over one
program per KV head it is latency, not bandwidth: a handful of programs walk the keys
one tile after another. `SplitAttention` cuts each row's keys into chunks of `split`
positions, one program per (row, KV head, chunk) attending with all G x Q query rows that
share the head (so every key and value is read once), and the chunks are merged by their
log-sum-exp: by a second kernel, or, folded, by whichever chunk's program of a (row, KV
head) ends last, which a counter per (row, KV head) tells it: one launch instead of two.
The merge is folded where a (row, KV head) has no more query rows than one merge program
takes (the target alone's step: G x 1); with more (the verify step's G x 16) the one
program that ends last would merge them serially, slower than the second kernel's
programs side by side (bench/RESULTS-h200.md).

Chunks past the row's furthest query position end at once: keys past it are never read,
so the cache may hold anything there; keys up to it are masked per query (key j seen from
position p when j <= p) and must be finite, as every position a decode step reaches was
written for the sequence being decoded.

On CUDA only (Triton); the layout is the decode's: q (B, H, Q, D) with its last dim dense,
keys and values (B, KVH, C, D), positions (B, Q) on the device (read inside the kernels,
so a CUDA graph replays the step for any positions). The output is (B, H, Q, D) as a view
of a (B, Q, H, D) tensor: the layout the output projection reads without a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per tile of a chunk
MERGE_M = 16  # query rows per program of the merge
LOG2E = 1.4426950408889634


def _rows_block(rows: int) -> int:
    """The query tile's height: a power of two, at least the 16 rows a tensor-core dot needs."""
    return max(16, triton.next_power_of_2(rows))


@triton.jit
def _split_attention_chunks(q_ptr, k_ptr, v_ptr, pos_ptr, last_ptr, part_ptr, lse_ptr, out_ptr, ended_ptr,
                            sq_b, sq_h, sq_q, sk_b, sk_h, sk_c, sv_b, sv_h, sv_c, scale_log2,
                            KVH: tl.constexpr, G: tl.constexpr, Q: tl.constexpr, D: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, CHUNKS: tl.constexpr, FOLD: tl.constexpr):
    row_head = tl.program_id(0)  # b * KVH + kv head
    chunk = tl.program_id(1)
    b, kvh = row_head // KVH, row_head % KVH
    r = tl.arange(0, BLOCK_M)  # query row r: head kvh * G + r // Q, position index r % Q
    live = r < G * Q
    head, qi = kvh * G + r // Q, r % Q
    d = tl.arange(0, BLOCK_D)
    dim = d[None, :] < D
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_q + d[None, :],
                mask=live[:, None] & dim, other=0.0)
    position = tl.load(pos_ptr + b * Q + qi, mask=live, other=-1)  # (BLOCK_M,)
    begin = chunk * SPLIT
    end = tl.minimum(begin + SPLIT, tl.load(last_ptr + b) + 1)  # keys no query sees are not read
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < end
        k = tl.load(k_ptr + b * sk_b + kvh * sk_h + n[:, None] * sk_c + d[None, :], mask=inside[:, None] & dim,
                    other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # (BLOCK_M, BLOCK_N)
        scores = tl.where(inside[None, :] & (n[None, :] <= position[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(scores - shift[:, None])
        alpha = tl.exp2(m - shift)
        v = tl.load(v_ptr + b * sv_b + kvh * sv_h + n[:, None] * sv_c + d[None, :], mask=inside[:, None] & dim,
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    seen = l > 0
    result = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    if CHUNKS == 1:
        # (B, Q, H, D): the final output
        offsets = ((b * Q + qi) * (KVH * G) + head)[:, None] * D + d[None, :]
        tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=live[:, None] & dim)
    else:
        at = (row_head * CHUNKS + chunk) * BLOCK_M + r
        tl.store(part_ptr + at[:, None] * BLOCK_D + d[None, :], result)
        tl.store(lse_ptr + at, tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf")))
        if FOLD:
            # Every thread's stores done, then one count per program, released at the GPU's
            # scope: the program that counts last sees every chunk's stores (acquired).
            tl.debug_barrier()
            if tl.atomic_add(ended_ptr + row_head, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
                _merge_rows(part_ptr, lse_ptr, out_ptr, row_head, r, KVH, G, Q, D, BLOCK_D, BLOCK_M, CHUNKS, BLOCK_M)
                tl.store(ended_ptr + row_head, 0)  # for the next launch, or the graph's next replay


@triton.jit
def _merge_rows(part_ptr, lse_ptr, out_ptr, row_head, r, KVH: tl.constexpr, G: tl.constexpr, Q: tl.constexpr,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr,
                ROWS: tl.constexpr):
    """Query rows `r` (ROWS of them) of (row, KV head) `row_head`: its chunks' partial
    outputs merged by their log-sum-exp into the output. The loads bypass L1 (.cg): other
    programs wrote what they read."""
    b, kvh = row_head // KVH, row_head % KVH
    d = tl.arange(0, BLOCK_D)
    top = tl.full([ROWS], float("-inf"), tl.float32)
    for chunk in tl.static_range(CHUNKS):
        top = tl.maximum(top, tl.load(lse_ptr + (row_head * CHUNKS + chunk) * BLOCK_M + r, cache_modifier=".cg"))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for chunk in tl.static_range(CHUNKS):
        at = (row_head * CHUNKS + chunk) * BLOCK_M + r
        weight = tl.exp2(tl.load(lse_ptr + at, cache_modifier=".cg") - shift)
        acc += weight[:, None] * tl.load(part_ptr + at[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
        total += weight
    live = r < G * Q
    head, qi = kvh * G + r // Q, r % Q
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    offsets = ((b * Q + qi) * (KVH * G) + head)[:, None] * D + d[None, :]
    tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=live[:, None] & (d[None, :] < D))


@triton.jit
def _split_attention_merge(part_ptr, lse_ptr, out_ptr, KVH: tl.constexpr, G: tl.constexpr, Q: tl.constexpr,
                           D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr,
                           CHUNKS: tl.constexpr):
    r = tl.program_id(1) * MERGE_M + tl.arange(0, MERGE_M)  # this program's query rows
    _merge_rows(part_ptr, lse_ptr, out_ptr, tl.program_id(0), r, KVH, G, Q, D, BLOCK_D, BLOCK_M, CHUNKS, MERGE_M)


class SplitAttention:
    """For steps of `rows` rows of `queries` new positions over caches of `capacity`
    positions: `set(positions)` then `(q, keys, values, scale)`, as fast_layers.PositionMask.
    `split`: keys per chunk (a multiple of BLOCK_N), or None: chunks enough for a
    program per multiprocessor, but no shorter than two tiles (four for 64 query rows):
    shorter chunks measured no faster and give the merge more to read
    (bench/RESULTS-h200.md). `fold`: whether the last chunk's program merges, or a second
    kernel (None: the module docstring's rule)."""

    def __init__(self, rows: int, queries: int, capacity: int, device: torch.device, heads: int, kv_heads: int,
                 head_dim: int, split: int | None = None, fold: bool | None = None):
        self.positions = torch.zeros(rows, queries, dtype=torch.long, device=device)
        self.last = torch.zeros(rows, dtype=torch.long, device=device)  # each row's furthest query position
        self.kv_heads, self.group = kv_heads, heads // kv_heads
        self.block_m = _rows_block(self.group * queries)
        if split is None:
            programs = torch.cuda.get_device_properties(device).multi_processor_count
            chunks = max(1, programs // (rows * kv_heads))
            split = max(-(-capacity // chunks), BLOCK_N * max(2, self.block_m // 16))
        self.split = max(BLOCK_N, -(-split // BLOCK_N) * BLOCK_N)
        self.chunks = -(-capacity // self.split)
        self.block_d = max(16, triton.next_power_of_2(head_dim))  # the dot's K: a power of two, 16 at least
        self.part = torch.empty(rows * kv_heads * self.chunks * self.block_m, self.block_d, dtype=torch.float32,
                                device=device)
        self.lse = torch.empty(rows * kv_heads * self.chunks * self.block_m, dtype=torch.float32, device=device)
        self.fold = (self.block_m <= MERGE_M if fold is None else fold) and self.chunks > 1
        self.ended = torch.zeros(rows * kv_heads, dtype=torch.int32, device=device)  # chunks ended, when folded

    def set(self, positions: torch.Tensor) -> None:
        """positions (B, Q): where this step's queries are."""
        self.positions.copy_(positions)
        self.last.copy_(positions.max(dim=1).values)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        rows, heads, queries, dim = q.shape
        out = torch.empty(rows, queries, heads, dim, dtype=q.dtype, device=q.device)
        common = dict(KVH=self.kv_heads, G=self.group, Q=queries, D=dim, BLOCK_D=self.block_d, BLOCK_M=self.block_m)
        _split_attention_chunks[(rows * self.kv_heads, self.chunks)](
            q, keys, values, self.positions, self.last, self.part, self.lse, out, self.ended,
            q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), scale * LOG2E,
            BLOCK_N=BLOCK_N, SPLIT=self.split, CHUNKS=self.chunks, FOLD=self.fold, **common)
        if self.chunks > 1 and not self.fold:
            _split_attention_merge[(rows * self.kv_heads, self.block_m // MERGE_M)](
                self.part, self.lse, out, MERGE_M=MERGE_M, CHUNKS=self.chunks, **common)
        return out.transpose(1, 2)
