"""fast_layers.split_linear, a layer's output products at the 16-position steps as batched
products over K's parts (CUDA: fp32 parts), against F.linear in fp32; and step_linear's
rule: split on CUDA at 2 to SPLIT_K_ROWS positions, for the roles SPLIT_K names."""
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
