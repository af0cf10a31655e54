"""model/decode_attention.SplitAttention against SDPA with an explicit mask (fast_layers.attend
in fp32): the decode steps' attention on CUDA, at the evaluator's and regenerate's step
shapes and at the tiny targets' head dims, with chunks empty, partly seen and past every
query, and replayed from a CUDA graph after the positions moved (the decode's use)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _case(rows, queries, heads, kv_heads, dim, capacity, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)  # noqa: E731
    keys, values = make(rows, kv_heads, capacity, dim), make(rows, kv_heads, capacity, dim)
    q = make(rows, queries, heads, dim).transpose(1, 2)  # (B, H, Q, D), as project_and_store returns it
    return q, keys, values


def _reference(q, keys, values, positions, scale):
    from dflash_train.model.fast_layers import attend

    seen = torch.arange(keys.shape[2], device="cuda") <= positions.unsqueeze(-1)  # (B, Q, C)
    return attend(q.float(), keys.float(), values.float(), seen, scale)


def _error(out, reference):
    return float((out.float() - reference).norm() / reference.norm())


@pytest.mark.parametrize("rows,queries,heads,kv_heads,dim,capacity,split", [
    (1, 16, 32, 8, 128, 640, None),  # the evaluator's verify step at the 8B shape
    (1, 1, 32, 8, 128, 640, None),  # its target alone
    (64, 1, 32, 8, 128, 1152, None),  # regenerate's step
    (1, 16, 32, 8, 128, 640, 64),
    (3, 1, 4, 2, 16, 256, 64),  # the tiny targets' heads
    (2, 4, 6, 2, 24, 192, 128),  # a head dim that is no power of two
    (2, 3, 4, 4, 8, 128, 128),  # no grouping; a head dim under the dot's 16
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fold", [False, True], ids=["merge-kernel", "merge-folded"])
def test_split_attention_is_masked_attention(rows, queries, heads, kv_heads, dim, capacity, split, dtype, fold):
    from dflash_train.model.decode_attention import SplitAttention

    q, keys, values = _case(rows, queries, heads, kv_heads, dim, capacity, dtype)
    # row 0 at the cache's start (chunks past it empty), the last near its end, any others between
    firsts = torch.linspace(0, capacity - queries, rows, device="cuda").long()
    positions = firsts.unsqueeze(1) + torch.arange(queries, device="cuda")
    attention = SplitAttention(rows, queries, capacity, torch.device("cuda"), heads, kv_heads, dim, split, fold)
    assert attention.chunks > 1 or split is None or split >= capacity
    attention.set(positions)
    reference = _reference(q, keys, values, positions, 0.2)
    for _ in range(3):  # a folded merge's counters are ready for the next launch
        out = attention(q, keys, values, 0.2)
        assert out.shape == (rows, heads, queries, dim) and out.dtype == dtype
        assert _error(out, reference) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert not attention.ended.any()


@pytest.mark.parametrize("fold", [False, True], ids=["merge-kernel", "merge-folded"])
def test_split_attention_replayed_from_a_cuda_graph_follows_the_positions(fold):
    """The step sets the positions inside the graph from a buffer the decode moves: each
    replay attends up to the new positions, and stale keys past them change nothing."""
    from dflash_train.model.decode_attention import SplitAttention
    from dflash_train.model.decode_graphs import graphed

    q, keys, values = _case(1, 16, 32, 8, 128, 640, torch.bfloat16)
    attention = SplitAttention(1, 16, 640, torch.device("cuda"), 32, 8, 128, fold=fold)
    at = torch.zeros(1, 16, dtype=torch.long, device="cuda")
    out = torch.empty(1, 32, 16, 128, dtype=torch.bfloat16, device="cuda")

    def step():
        attention.set(at)
        out.copy_(attention(q, keys, values, 0.1))

    replay = graphed(step, torch.device("cuda"))
    for first in (0, 100, 333, 624):
        at.copy_(first + torch.arange(16, device="cuda").unsqueeze(0))
        replay()
        expected = _reference(q, keys, values, at, 0.1)
        assert _error(out, expected) < 1e-2, first
        keys[:, :, first + 16:] = float("nan")  # past every query: never read
        replay()
        assert _error(out, expected) < 1e-2, first
        keys.normal_()


@pytest.mark.parametrize("rows,queries,folds", [
    (1, 1, True),  # the target alone: G x 1 = 4 query rows a KV head, one merge program's worth
    (1, 16, False),  # the verify and draft steps: 64 rows, which the merge kernel spreads over programs
    (64, 1, False),  # regenerate's step: one chunk, nothing to merge
])
def test_split_attention_folds_its_merge_only_where_one_program_merges_a_kv_head(rows, queries, folds):
    from dflash_train.model.decode_attention import SplitAttention

    attention = SplitAttention(rows, queries, 640 if rows == 1 else 1152, torch.device("cuda"), 32, 8, 128)
    assert attention.fold is folds
    assert attention.chunks > 1 or rows == 64
