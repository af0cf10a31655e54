"""fast_layers.split_linear, a layer's output products at the 16-position steps as batched
products over K's parts (CUDA: fp32 parts), and model/skinny_products.py's Triton kernel
for them, against F.linear in fp32; and step_linear's rule: the kernel where
TRITON_PRODUCTS names the role and its tiles fit, else split where SPLIT_K names it, on
CUDA at 2 to SPLIT_K_ROWS positions only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape,outputs", [((1, 16, 4096), 4096), ((1, 16, 12288), 4096), ((2, 3, 256), 96)])
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_split_linear_is_linear(shape, outputs, splits, bias):
    from dflash_train.model.fast_layers import split_linear

    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(outputs, shape[-1], device="cuda", generator=generator) / shape[-1] ** 0.5).bfloat16()
    b = torch.randn(outputs, device="cuda", generator=generator).bfloat16() if bias else None
    out = split_linear(x, weight, b, splits)
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert out.shape == (*shape[:-1], outputs) and out.dtype == torch.bfloat16
    assert float((out.float() - reference).norm() / reference.norm()) < 4e-3  # bf16's rounding of the output
    compiled = torch.compile(split_linear, dynamic=False)(x, weight, b, splits)  # as the steps run it
    assert float((compiled.float() - reference).norm() / reference.norm()) < 4e-3


@pytest.mark.parametrize("rows,splits", [(1, False), (2, True), (16, True), (17, False), (64, False)])
@pytest.mark.parametrize("role", ["o", "no such role"])
def test_step_linear_splits_the_few_position_steps_on_cuda_only(rows, splits, role, monkeypatch):
    from dflash_train.model import fast_layers

    calls = []
    monkeypatch.setattr(fast_layers, "split_linear", lambda *args: calls.append(args) or F.linear(*args[:3]))
    monkeypatch.setattr(fast_layers, "SPLIT_K", {"o": 4})
    weight = torch.randn(64, 256, dtype=torch.bfloat16)
    for device in ("cpu", "cuda"):
        out = fast_layers.step_linear(role, torch.randn(1, rows, 256, dtype=torch.bfloat16, device=device),
                                      weight.to(device), None)
        assert out.shape == (1, rows, 64)
    assert len(calls) == (1 if splits and role == "o" else 0)
    assert not calls or calls[0][0].is_cuda and calls[0][3] == 4


def test_step_linear_leaves_the_split_to_cublas_on_a_torch_without_products_into_fp32(monkeypatch):
    """torch before 2.8 has no bmm into fp32 from bf16 (the project takes torch from 2.6)."""
    from dflash_train.model import fast_layers

    calls = []
    monkeypatch.setattr(fast_layers, "split_linear", lambda *args: calls.append(args) or F.linear(*args[:3]))
    monkeypatch.setattr(fast_layers, "BMM_INTO_FP32", False)
    x = torch.randn(1, 16, 256, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    assert torch.allclose(fast_layers.step_linear("o", x, weight, None), F.linear(x, weight))
    assert calls == []


@pytest.mark.parametrize("rows,shape", [(16, (6144, 4096)), (16, (4096, 12288)), (5, (256, 512))])
@pytest.mark.parametrize("tiles", [(1, 64, 128, 3, 4, False), (2, 64, 64, 4, 4, True), (4, 32, 128, 2, 8, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_linear_is_linear_eager_and_compiled(rows, shape, tiles, bias):
    from dflash_train.model.fast_layers import Tiles, triton_linear
    from dflash_train.model.skinny_products import fits, product_parts

    outputs, width = shape
    tiles = Tiles(*tiles)
    assert fits(rows, outputs, width, tiles.parts, tiles.block_n, tiles.block_k)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, rows, width, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(outputs, width, device="cuda", generator=generator) / width ** 0.5).bfloat16()
    b = torch.randn(outputs, device="cuda", generator=generator).bfloat16() if bias else None
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    parts = product_parts(x[0], weight, tiles.parts, tiles.block_n, tiles.block_k, tiles.stages, tiles.warps,
                          tiles.swap)
    assert parts.shape == (tiles.parts, rows, outputs) and parts.dtype == torch.float32
    exact = x[0].float() @ weight.float().T
    assert float((parts.sum(0) - exact).norm() / exact.norm()) < 1e-4  # fp32 sums of bf16 products
    torch._dynamo.reset()  # each case compiles anew: fullgraph fails past the recompile limit
    for run in (triton_linear, torch.compile(triton_linear, dynamic=False, fullgraph=True)):  # as the steps run it
        out = run(x, weight, b, tiles)
        assert out.shape == (1, rows, outputs) and out.dtype == torch.bfloat16
        assert float((out.float() - reference).norm() / reference.norm()) < 4e-3


@pytest.mark.parametrize("rows,kernel", [(1, False), (2, True), (16, True), (17, False)])
@pytest.mark.parametrize("role,width", [("gate_up", 256), ("o", 256), ("gate_up", 96)])
def test_triton_tiles_name_the_few_position_products_on_cuda_that_the_table_names_and_fit(rows, kernel, role, width,
                                                                                          monkeypatch):
    from dflash_train.model import fast_layers

    tiles = fast_layers.Tiles(2, 32, 64)
    monkeypatch.setattr(fast_layers, "TRITON_PRODUCTS", {"gate_up": tiles})
    weight = torch.randn(64, width, dtype=torch.bfloat16)
    fits = width % (2 * 64) == 0  # 2 parts of K, each whole 64-wide tiles
    x = torch.randn(1, rows, width, dtype=torch.bfloat16)
    assert fast_layers.triton_tiles(role, x, weight) is None
    expected = tiles if kernel and role == "gate_up" and fits else None
    assert fast_layers.triton_tiles(role, x.cuda(), weight.cuda()) == expected


def test_step_linear_takes_the_triton_kernel_in_compiled_steps_only(monkeypatch):
    """Compiled, the step's graph runs the kernel; eager, the split (SPLIT_K) or cuBLAS: no
    kernel is compiled when an eager step first runs."""
    from torch._inductor.utils import run_and_get_code

    from dflash_train.model import fast_layers

    monkeypatch.setattr(fast_layers, "TRITON_PRODUCTS", {"down": fast_layers.Tiles(2, 32, 64)})
    monkeypatch.setattr(fast_layers, "SPLIT_K", {"down": 2})
    splits = []
    real_split = fast_layers.split_linear
    monkeypatch.setattr(fast_layers, "split_linear", lambda *args: splits.append(args) or real_split(*args))
    x = torch.randn(1, 16, 256, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    eager = fast_layers.step_linear("down", x, weight, None)
    assert len(splits) == 1  # the split's result is what step_linear returned
    torch._dynamo.reset()
    step = torch.compile(lambda x, w: fast_layers.step_linear("down", x, w, None), dynamic=False, fullgraph=True)
    compiled, code = run_and_get_code(step, x, weight)
    assert "_product_parts" in "\n".join(code)
    assert float((compiled.float() - eager.float()).norm() / eager.float().norm()) < 4e-3
