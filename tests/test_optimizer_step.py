"""The optimizer step's three forms (training/optimizer_step.py) on CPU: the device form (fused,
capturable AdamW, learning rate and clipping on the device) is the graph form minus the
capture, so the CPU runs all of it but `torch.cuda.graph`; the GPU test replays the graph."""
from __future__ import annotations

import pytest
import torch

from dflash_train.checkpoint.folders import SnapshotBuffers, _map_tensors
from dflash_train.config import OptimConfig
from dflash_train.training.optimizer_step import OptimizerStep

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_ratio=0.25, grad_clip=0.5)


def cpu_copy(state: dict) -> dict:
    """A state_dict copied to the CPU as take_snapshot copies one (into fresh buffers;
    from CUDA asynchronously: the caller synchronizes)."""
    return _map_tensors(state, "", SnapshotBuffers().copy)


def params_of(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in ((7, 5), (5,), (3,))]


def gradients(step: int, params, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator).to(p.device) * scale for p in params]


def take(optimizer: OptimizerStep, steps, params, scale: float = 1.0) -> list[float]:
    lrs = []
    for step in steps:
        grads = gradients(step, params, scale)
        lrs.append(optimizer.apply(grads, torch.nn.utils.get_total_norm(grads)))
    return lrs


def test_the_device_form_clips_and_steps_as_the_eager_form():
    eager_params, device_params = params_of(), params_of()
    eager = OptimizerStep(eager_params, OPTIM, total_steps=8, form="eager")
    on_device = OptimizerStep(device_params, OPTIM, total_steps=8, form="device")
    assert on_device.optimizer.param_groups[0]["fused"] and on_device.optimizer.param_groups[0]["capturable"]
    on_device.prepare()
    # norms of ~3 against a clip of 0.5: every step is clipped
    lrs = take(eager, range(6), eager_params), take(on_device, range(6), device_params)
    assert lrs[0] == lrs[1] and lrs[0][0] < lrs[0][1]  # the same schedule, warming up
    for a, b in zip(eager_params, device_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert eager_params[0].detach().ne(params_of()[0]).all()  # it did train
    # the learning rate went through the device tensor, the groups keep a float
    assert isinstance(on_device.optimizer.param_groups[0]["lr"], float)
    assert float(on_device.lr) == pytest.approx(lrs[1][-1])


@pytest.mark.parametrize("trained_steps", [0, 3])
def test_prepare_makes_the_state_without_changing_weights_or_moments(trained_steps):
    params = params_of()
    optimizer = OptimizerStep(params, OPTIM, total_steps=8, form="device")
    take(optimizer, range(trained_steps), params)
    weights = [p.detach().clone() for p in params]
    state = cpu_copy(optimizer.optimizer.state_dict())
    optimizer.prepare()
    assert all(torch.equal(a, b) for a, b in zip(params, weights))
    after = optimizer.optimizer.state_dict()["state"]
    assert len(after) == len(params)
    for index, moments in after.items():
        expected = state["state"].get(index) or {key: torch.zeros_like(value) for key, value in moments.items()}
        assert all(torch.equal(value, expected[key]) for key, value in moments.items()), index
    # and it trains on from there as one that was never prepared
    twin_params = params_of()
    twin = OptimizerStep(twin_params, OPTIM, total_steps=8, form="device")
    take(twin, range(trained_steps), twin_params)
    take(optimizer, range(trained_steps, 6), params)
    take(twin, range(trained_steps, 6), twin_params)
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))


@pytest.mark.parametrize("writer, reader", [("device", "eager"), ("eager", "device")])
def test_a_checkpointed_state_loads_into_the_other_form_and_trains_on_alike(writer, reader):
    params = params_of()
    written = OptimizerStep(params, OPTIM, total_steps=8, form=writer)
    written.prepare()
    take(written, range(3), params)
    saved = cpu_copy({"optimizer": written.optimizer.state_dict(), "scheduler": written.scheduler.state_dict()})
    assert all(t.device.type == "cpu" for m in saved["optimizer"]["state"].values() for t in m.values())

    loaded_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = OptimizerStep(loaded_params, OPTIM, total_steps=8, form=reader)
    loaded.load_state_dict(saved["optimizer"], saved["scheduler"])
    loaded.prepare()
    group = loaded.optimizer.param_groups[0]
    # the reader's own implementation, the writer's hyperparameters and schedule position
    assert (bool(group["fused"]), group["capturable"]) == ((True, True) if reader == "device" else (False, False))
    assert group["lr"] == written.optimizer.param_groups[0]["lr"] and loaded.scheduler.last_epoch == 3
    assert float(loaded.optimizer.state[loaded_params[0]]["step"]) == 3.0
    # the moments are the reader's own copies: the writer's next steps do not move them
    take(written, range(3, 6), params)
    take(loaded, range(3, 6), loaded_params)
    for a, b in zip(params, loaded_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(300)
def test_the_captured_optimizer_replays_as_the_device_form_to_the_bit():
    graphed_params, device_params = params_of(device="cuda"), params_of(device="cuda")
    graphed = OptimizerStep(graphed_params, OPTIM, total_steps=8, form="graph")
    on_device = OptimizerStep(device_params, OPTIM, total_steps=8, form="device")
    with torch.cuda.device(0):
        graphed.prepare()
    on_device.prepare()
    assert graphed._graph is not None
    lrs = take(graphed, range(6), graphed_params), take(on_device, range(6), device_params)
    assert lrs[0] == lrs[1]
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(graphed_params, device_params))
    # a checkpoint of the graphed optimizer loads on the CPU into the eager form
    saved = cpu_copy(graphed.optimizer.state_dict())
    torch.cuda.synchronize()
    eager = OptimizerStep(params_of(), OPTIM, total_steps=8, form="eager")
    eager.load_state_dict(saved, graphed.scheduler.state_dict())
    assert float(eager.optimizer.state[eager.params[0]]["step"]) == 6.0
