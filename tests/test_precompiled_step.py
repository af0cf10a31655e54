"""compile: default's train step from its saved graphs (compiling/precompiled.py): a run
saves them in the compile cache, the next run of the workspace loads them and traces
nothing, with the same losses; a file cut short is moved aside, said in the log, and the
step traced again. In process: one set of graphs serves replicas of other weights with
their own gradients, and a shape no graph's guards pass is a StrayCompile naming it.
Real torch.compile (Inductor) on CPU, real trainer subprocesses with the tiny target."""
from __future__ import annotations

import re

import pytest
import torch

from dflash_train.compiling import precompiled
from dflash_train.compiling.policy import CompilePlan, build_train_step, configure_compiler, example_inputs
from dflash_train.compiling.precompiled import PRECOMPILED_DIR, unsupported_reason
from dflash_train.compiling.step_build import StrayCompile, inputs_of_shape
from dflash_train.data.batches import BatchShape
from support.trainer import end, start_trainer

from test_head_loss import objective
from test_trainer_runs import SMALL

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(unsupported_reason() is not None, reason=str(unsupported_reason()))]

CONFIG = SMALL + """
optim: {max_steps: 3}
eval: {num_prompts: 0}
checkpoint: {every: 0}
compile: default
"""
BUILT = re.compile(r"drafter 0: train step built \(default, dynamic shapes\) in [\d.]+ s, "
                   r"(?:(\d+) graph\(s\) loaded precompiled, )?(\d+) graph\(s\) compiled")


def run_to_end(workspace, tmp_path, run_id: str) -> tuple[str, dict[int, float], dict]:
    """The run's log, its losses by step, and drafter 0's `build train step` done event."""
    launched = start_trainer(workspace, tmp_path / run_id, CONFIG, run_id)
    try:
        assert launched.wait(600) == 0, launched.log()[-3000:]
        (build,) = [e for e in launched.events("startup")
                    if e["phase"] == "build train step" and e["state"] == "done" and e["drafter"] == 0]
        return launched.log(), {e["step"]: e["loss"] for e in launched.events("step")}, build
    finally:
        end(launched)


def built(log: str) -> tuple[int, int]:
    """(graphs loaded, graphs compiled) of drafter 0's build."""
    loaded, compiled = BUILT.search(log).groups()
    return int(loaded or 0), int(compiled)


@pytest.mark.slow(seconds=150, why="three trainer runs of compile: default on CPU: a cold compile, a warm start, "
                                   "a start from a truncated file")
def test_a_warm_start_loads_the_saved_graphs_and_a_truncated_file_is_traced_again(tmp_path):
    workspace = tmp_path / "ws"
    cold_log, cold_losses, cold_build = run_to_end(workspace, tmp_path, "cold")
    saved = re.search(r"precompiled train step saved: (\S+\.aot) \((\d+) graph\(s\)", cold_log)
    assert saved, cold_log[-3000:]
    path, graphs = saved.group(1), int(saved.group(2))
    assert "/cache/compile/" in path and f"/{PRECOMPILED_DIR}/" in path
    assert built(cold_log) == (0, graphs) and graphs >= 1
    # The build's event says where its time went, by torch's own timers and cache counters.
    assert (cold_build["graphs_traced"], cold_build["graphs_loaded"]) == (graphs, 0)
    assert cold_build["trace_s"] > 0 and cold_build["inductor_s"] > 0
    assert cold_build["autograd_cache_misses"] + cold_build["inductor_cache_misses"] >= graphs
    assert cold_build["trace_s"] + cold_build["inductor_s"] <= cold_build["duration_s"]
    # ... and its own parts: the steps before any capture (none on a CPU) and the optimizer's set-up.
    assert cold_build["capture_s"] == 0 and cold_build["warmup_s"] > 0 and cold_build["optimizer_s"] >= 0
    assert cold_build["warmup_s"] + cold_build["optimizer_s"] <= cold_build["duration_s"]

    warm_log, warm_losses, warm_build = run_to_end(workspace, tmp_path, "warm")
    assert f"precompiled train step loaded: {path} ({graphs} graph(s))" in warm_log
    assert built(warm_log) == (graphs, 0)  # nothing traced
    assert (warm_build["graphs_traced"], warm_build["graphs_loaded"]) == (0, graphs)
    assert warm_build["trace_s"] == 0  # its seconds are Inductor's loads
    assert "precompiled train step saved" not in warm_log
    assert warm_losses == pytest.approx(cold_losses, rel=1e-5) and len(warm_losses) == 3

    data = open(path, "rb").read()
    with open(path, "wb") as f:  # cut short, as by a full disk
        f.write(data[: len(data) // 2])
    cut_log, cut_losses, cut_build = run_to_end(workspace, tmp_path, "cut")
    assert re.search(rf"precompiled train step {re.escape(path)} not loaded: ValueError: {len(data) // 2} bytes of "
                     rf"sha256 \w+, its manifest says {len(data)}; moved to \S+\.aot\.corrupt, Dynamo traces the step",
                     cut_log), cut_log[-3000:]
    assert built(cut_log) == (0, graphs)
    assert (cut_build["graphs_traced"], cut_build["graphs_loaded"]) == (graphs, 0) and cut_build["trace_s"] > 0
    assert open(path + ".corrupt", "rb").read() == data[: len(data) // 2]
    assert f"precompiled train step saved: {path} ({graphs} graph(s)" in cut_log
    assert cut_losses == pytest.approx(cold_losses, rel=1e-5)


def eager_loss_and_grads(model, inputs):
    model.drafter.zero_grad(set_to_none=True)
    loss, _, _ = model(inputs)
    loss.backward()
    grads = [p.grad.clone() for p in model.drafter.parameters()]
    model.drafter.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.slow(seconds=60, why="an Inductor compile of the step on CPU, then loads of what it saved")
def test_saved_graphs_serve_replicas_of_other_weights_and_refuse_a_stray_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(precompiled, "_SHARED", {})
    shapes = (BatchShape(2, 48, 8), BatchShape(2, 32, 6), BatchShape(1, 48, 8))
    plan = CompilePlan("default", data_shapes=shapes, precompiled=tmp_path / "key")
    configure_compiler("default", 2, plan.shapes_per_drafter, True)
    first = objective(None)
    example = example_inputs(first, 16, first.drafter.fc.in_features, "cpu")
    step = build_train_step(plan, first, example)
    assert step.report.graphs_compiled == 2 and step.report.checked == 1  # a graph for rows of 1
    (saved,) = (tmp_path / "key" / PRECOMPILED_DIR).glob("*.aot")

    monkeypatch.setattr(precompiled, "_SHARED", {})  # as a new process finds it: only the file
    other = objective(None)
    with torch.no_grad():
        for p in other.drafter.parameters():
            p.mul_(0.5).add_(0.01)
    replica = build_train_step(plan, other, example)
    assert (replica.report.graphs_loaded, replica.report.graphs_compiled) == (2, 0)
    for model, built_step in ((first, step), (other, replica)):
        for i, shape in enumerate(shapes):
            inputs = inputs_of_shape(model, shape, example, seed=10 + i)
            stats = built_step(inputs)
            grads = [p.grad.clone() for p in model.drafter.parameters()]
            loss, expected = eager_loss_and_grads(model, inputs)
            assert stats.loss.item() == pytest.approx(loss.item(), rel=1e-5)
            assert all(torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(grads, expected))
    assert saved.stat().st_size > 0

    stray = inputs_of_shape(other, BatchShape(2, 32, 1), example, seed=3)  # one block: no graph has it
    with pytest.raises(StrayCompile, match=r"for a micro-batch of 2 x 32 tokens with 1 blocks \(guard: .+\)"):
        replica(stray)
    doubles = inputs_of_shape(other, BatchShape(2, 48, 8), example, seed=3)
    doubles.features = doubles.features.double()
    with pytest.raises(StrayCompile, match=r"2 x 48 tokens with 8 blocks \(guard: .*features"):
        replica(doubles)


def doubled_leaf(x: torch.Tensor) -> torch.Tensor:
    """Guarded on `__import__('torch').utils._pytree.SUPPORTED_NODES`, as flex attention's mask."""
    return x * 2 if torch.utils._pytree.tree_is_leaf((x,)) is False else x


def test_a_graph_whose_guards_import_torch_is_saved_and_loaded_again(tmp_path, monkeypatch):
    """Flex attention's block mask asks pytree whether a value is a leaf, and Dynamo guards
    that on `__import__('torch').utils._pytree.SUPPORTED_NODES`: torch re-makes that source
    when it loads the guards, and the load must not need an ongoing trace (it did: every
    flex drafter's saved step failed to load). The same guard, in a graph small enough for
    the CPU, through the train step's save and open."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(torch._dynamo.config, "enable_aot_compile", True)  # as configure_compiler sets it
    x = torch.randn(4, 8)
    function = torch.compile(doubled_leaf, fullgraph=True).aot_compile(((x,), {}))
    precompiled.PrecompiledStep(tmp_path / "key" / PRECOMPILED_DIR / "leaf.aot", [function], precompiled.ABSENT).save()

    loaded = precompiled.open_precompiled(tmp_path / "key", "leaf")
    assert (loaded.status, len(loaded.functions)) == (precompiled.LOADED, 1)
    assert loaded.functions[0].guard_check(x) and torch.equal(loaded.functions[0](x), x * 2)
