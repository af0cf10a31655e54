"""compile: cudagraphs — the CPU-checkable parts everywhere, real graphs where CUDA is.

CPU CI proves: the module imports on CPU-only torch, the config refuses cudagraphs on a
CPU run and with more shape buckets than are captured, the strategy per torch version
and placement, the buckets that cover the data (every batch data/batches.py packs fits one),
that the trainer's compile plan holds those buckets, the placement and compile_shapes,
that padding a batch into a bucket leaves loss and gradients unchanged (checked with the
real DFlash objective), and that compile_shapes: dynamic compiles one train step for
every bucket with eager's losses while static compiles each bucket. The `gpu` tests capture graphs in several drafter
threads on one GPU, and in one drafter per GPU on two, and compare every loss with eager
and with the same graphs replayed in one thread; and, for both attention backends (sdpa's
dense mask and FlexAttention's BlockMask, the production path) and both capture
strategies, that a replayed step builds its block mask from each batch's own anchors;
and that the dynamic whole_step compiles once for four buckets and captures each.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from dflash_schema import SchemaError
from dflash_train.compiling import cudagraphs, precompiled, step_build
from dflash_train.compiling.policy import (DYNAMIC_SHAPE_VARIANTS, CompilePlan, build_train_step,
                                         configure_compiler, example_inputs, plan_compile)
from dflash_train.compiling.step_build import (CompilerWork, compile_for_shapes, inputs_of_shape, random_inputs,
                                              shape_of, warm_up)
from dflash_train.config import DataConfig, DrafterConfig, load_job_config
from dflash_train.data.batches import BatchPlan, BatchShape, Sample, collate
from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config
from dflash_train.model import objective as objective_module
from dflash_train.model.objective import DraftObjective, DrafterInputs, block_labels, position_weights
from dflash_train.devices import Fence, thread_stream
from dflash_train.training.distributed import Layout
from dflash_train.faults import FaultInjector
from dflash_train.training.gradients import GradientExchange, Posted, step_facts
from dflash_train.runlog import ErrorLog, ThreadNames
from dflash_train.threads import JobThread, Rendezvous, StopLatch
from dflash_train.training.step import at_rendezvous, training_step

pytestmark = pytest.mark.timeout(60)

VOCAB, HIDDEN, FEATURE_LAYERS, BLOCK = 96, 32, 2, 4


def tiny_objective(device: str, seed: int = 0, use_flex: bool = False, head_dim: int = 8) -> DraftObjective:
    """A 1-layer DFlash drafter with random weights; embedding and head as the target's.
    Inductor's FlexAttention kernels on CUDA need head_dim >= 16."""
    target = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=512)
    spec = DrafterConfig(num_layers=1, block_size=BLOCK, num_anchors=8)
    drafter = DFlashDrafter(drafter_hf_config(target, spec, (1, 3), mask_token_id=VOCAB - 1))
    generator = torch.Generator().manual_seed(seed)
    drafter.reset_parameters(generator)
    embed = torch.randn(VOCAB, HIDDEN, generator=generator)
    head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.1
    return DraftObjective(drafter.to(device), embed.to(device), head.to(device), use_flex=use_flex)


def _write_config(tmp_path, compile_mode: str, drafters: str, data: str = "pad_multiple: 1024", extra: str = ""):
    """A config file; by default its data make 3 padded lengths (1024, 2048, 3072)."""
    path = tmp_path / "train.yaml"
    path.write_text(textwrap.dedent(f"""\
        target: {{tiny: {{}}}}
        data: {{synthetic: {{}}, {data}}}
        devices: {{target: [{drafters.split(',')[0]}], drafters: [{drafters}]}}
        compile: {compile_mode}
        """) + extra)
    return path


def test_config_refuses_cudagraphs_on_a_cpu_run(tmp_path):
    with pytest.raises(SchemaError) as info:
        load_job_config(_write_config(tmp_path, "cudagraphs", "cpu, cpu"))
    message = str(info.value)
    assert str(tmp_path / "train.yaml") in message
    assert "cudagraphs needs CUDA devices" in message and "use compile: off or default" in message


def test_config_accepts_cudagraphs_with_cuda_drafters(tmp_path):
    config = load_job_config(_write_config(tmp_path, "cudagraphs", "cuda:0, cuda:0"))
    assert config.compile == "cudagraphs" and config.devices.drafters == ("cuda:0", "cuda:0")


@pytest.mark.parametrize("version, shared, expected", [
    ((2, 11), True, "whole_step"),
    ((2, 11), False, "whole_step"),
    ((2, 12), False, "whole_step"),
    ((2, 13), True, "whole_step"),  # one GPU: the drafters would share upstream's graphed backward
    ((2, 13), False, "upstream"),
    ((2, 14), False, "upstream"),
])
def test_auto_strategy_per_torch_version_and_placement(version, shared, expected):
    assert cudagraphs.resolve_strategy("auto", drafters_share_a_device=shared, version=version) == expected


def test_upstream_strategy_refused_before_torch_2_13():
    with pytest.raises(cudagraphs.CudaGraphsUnavailable, match=r"needs torch >= 2\.13.*this is torch 2\.12"):
        cudagraphs.resolve_strategy("upstream", drafters_share_a_device=False, version=(2, 12))
    assert cudagraphs.resolve_strategy("whole_step", drafters_share_a_device=False,
                                       version=(2, 14)) == "whole_step"


def test_torch_version_parses_local_suffixes():
    assert step_build.torch_version("2.11.0+cu130") == (2, 11)
    assert step_build.torch_version("2.14.1") == (2, 14)


def _data(**kw) -> DataConfig:
    return DataConfig(synthetic=None, train="train.jsonl", **kw)


def test_buckets_cover_every_length_the_packer_can_make():
    one = cudagraphs.bucket_shapes(_data(max_length=3072, token_budget=3072, pad_multiple=3072),
                                   DrafterConfig(num_anchors=512))
    assert one == (BatchShape(rows=1, length=3072, blocks=512),)
    three = cudagraphs.bucket_shapes(_data(max_length=3000, token_budget=16384, pad_multiple=1024),
                                     DrafterConfig(num_anchors=512))
    assert three == (BatchShape(16, 1024, 512), BatchShape(8, 2048, 512),
                     BatchShape(5, 3072, 512))
    short = cudagraphs.bucket_shapes(_data(max_length=128, token_budget=1024, pad_multiple=64),
                                     DrafterConfig(num_anchors=512))
    assert [s.blocks for s in short] == [64, 128]  # no more blocks than a row has anchors


def test_too_many_buckets_is_refused_with_the_setting_to_change():
    with pytest.raises(cudagraphs.CudaGraphsUnavailable, match=r"makes 48 .*pad_multiple to at least 768"):
        cudagraphs.bucket_shapes(_data(max_length=3072, token_budget=16384, pad_multiple=64), DrafterConfig())


def test_config_refuses_more_buckets_than_captured_naming_file_and_keys(tmp_path):
    with pytest.raises(SchemaError) as info:
        load_job_config(_write_config(tmp_path, "cudagraphs", "cuda:0, cuda:0",
                                        data="max_length: 3072, pad_multiple: 64"))
    message = str(info.value)
    assert str(tmp_path / "train.yaml") in message
    assert "data.max_length 3072 with data.pad_multiple 64 makes 48 (at most 4)" in message
    suggested = int(message.split("pad_multiple to at least ")[1].split()[0])
    assert suggested == 768
    # The suggested setting is enough, and one less is not.
    config = load_job_config(_write_config(tmp_path, "cudagraphs", "cuda:0", data=f"pad_multiple: {suggested}"))
    assert len(config.data.padded_lengths()) == 4
    with pytest.raises(SchemaError, match="makes 5"):
        load_job_config(_write_config(tmp_path, "cudagraphs", "cuda:0", data=f"pad_multiple: {suggested - 1}"))
    # Only cudagraphs captures per length: the other modes take any padding.
    assert load_job_config(_write_config(tmp_path, "default", "cuda:0", data="pad_multiple: 64")).compile == "default"


def test_every_batch_the_packer_makes_fits_a_bucket():
    data = DataConfig(synthetic=None, train="train.jsonl", max_length=300, token_budget=1000, pad_multiple=100)
    drafter = DrafterConfig(block_size=4, num_anchors=40)
    buckets = cudagraphs.bucket_shapes(data, drafter)
    generator = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(120):
        length = int(torch.randint(3, data.max_length + 1, (1,), generator=generator))
        turn_ids = torch.zeros(length, dtype=torch.int32)  # a prompt, then one answer of 2 tokens or more
        turn_ids[:int(torch.randint(0, length - 1, (1,), generator=generator))] = -1
        samples.append(Sample(torch.randint(0, 50, (length,), generator=generator, dtype=torch.int32), turn_ids))
    plan = BatchPlan(samples, data, replicas=1, epochs=2, max_steps=None, seed=0)
    shapes = set()
    for step in range(1, plan.total_steps + 1):
        batch = collate(samples, plan.entry(step, 0), step, 0, data, drafter, pad_id=0, seed=0)
        inputs = DrafterInputs(batch.input_ids, torch.empty(0), batch.anchors, batch.anchor_valid,
                               batch.labels, batch.weights)
        assert any(bucket.holds(inputs) for bucket in buckets), (tuple(batch.input_ids.shape), batch.anchors.shape)
        shapes.add((*batch.input_ids.shape, batch.anchors.shape[1]))
    assert {length for _, length, _ in shapes} == {100, 200, 300}  # every bucket is needed
    assert len(shapes) > len(buckets)  # and batches of other shapes are padded into them


@pytest.mark.parametrize("drafters, shared", [
    ("cuda:0, cuda", True),  # "cuda" is cuda:0
    ("cuda:0, cuda:1", False),
    ("cuda:1", False),
])
def test_cudagraphs_plan_holds_the_config_buckets_placement_and_shapes(tmp_path, drafters, shared):
    config = load_job_config(_write_config(tmp_path, "cudagraphs", drafters))
    plan = plan_compile(config)
    assert plan.buckets == cudagraphs.bucket_shapes(config.data, config.drafter)
    assert [b.length for b in plan.buckets] == [1024, 2048, 3072]
    assert plan.drafters_share_a_device is shared and plan.num_drafters == len(config.devices.drafters)
    assert plan.shapes_per_drafter == 3 and plan.shapes == "static"  # the default, for now
    dynamic = load_job_config(_write_config(tmp_path, "cudagraphs", drafters, extra="compile_shapes: dynamic\n"))
    assert plan_compile(dynamic).shapes == "dynamic"


@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_compile_shapes_is_refused_without_cudagraphs(tmp_path, shapes):
    with pytest.raises(SchemaError, match="compile_shapes applies to compile: cudagraphs.*compile: default is always"):
        load_job_config(_write_config(tmp_path, "default", "cpu", extra=f"compile_shapes: {shapes}\n"))
    assert plan_compile(load_job_config(_write_config(tmp_path, "default", "cpu"))).shapes == "dynamic"


def test_build_train_step_reaches_the_graph_builder_for_a_cudagraphs_plan(tmp_path):
    plan = plan_compile(load_job_config(_write_config(tmp_path, "cudagraphs", "cuda:0, cuda:0")))
    objective = tiny_objective("cpu")
    example = example_inputs(objective, 32, FEATURE_LAYERS * HIDDEN, "cpu")
    with pytest.raises(cudagraphs.CudaGraphsUnavailable, match="needs a CUDA device; the drafter is on cpu"):
        build_train_step(plan, objective, example)
    # A bare mode has no buckets: capturing the warm-up example alone would fail the first batch.
    with pytest.raises(ValueError, match="needs the shape buckets"):
        build_train_step("cudagraphs", objective, example)


def test_plans_without_graphs_build_a_working_step(tmp_path):
    path = _write_config(tmp_path, "off", "cpu, cpu")
    plan = plan_compile(load_job_config(path))
    assert plan == CompilePlan("off", num_drafters=2, buckets=(), drafters_share_a_device=True, shapes="dynamic")
    assert plan.shapes_per_drafter == DYNAMIC_SHAPE_VARIANTS
    objective = tiny_objective("cpu")
    step = build_train_step(plan, objective, example_inputs(objective, 16, FEATURE_LAYERS * HIDDEN, "cpu"))
    inputs = example_inputs(objective, 24, FEATURE_LAYERS * HIDDEN, "cpu")
    stats = step(inputs)
    expected = _loss_and_grads(objective, inputs)
    assert float(stats.loss) == pytest.approx(float(expected[0]), rel=1e-6)


@pytest.fixture
def compiler_settings():
    """configure_compiler changes process-wide settings: put them back for the other tests,
    by assignment (pytest's monkeypatch undo leaves torch's config module broken)."""
    import torch._dynamo
    import torch._inductor.config

    triton_options = torch._inductor.config.triton
    saved = (torch._dynamo.config.recompile_limit, triton_options.coalesce_tiling_analysis,
             getattr(triton_options, "mix_order_reduction", None))
    yield triton_options
    torch._dynamo.config.recompile_limit, triton_options.coalesce_tiling_analysis = saved[:2]
    if saved[2] is not None:
        triton_options.mix_order_reduction = saved[2]


def test_recompile_limit_covers_every_drafter_and_bucket(tmp_path, compiler_settings):
    drafters = ", ".join(f"cuda:{i}" for i in range(8))
    plan = plan_compile(load_job_config(_write_config(tmp_path, "cudagraphs", drafters, data="pad_multiple: 768")))
    configure_compiler(plan.mode, plan.num_drafters, plan.shapes_per_drafter, plan.dynamic_shapes)
    # 8 GPUs x 4 buckets: each is a cache entry of DraftObjective.forward at worst.
    assert torch._dynamo.config.recompile_limit >= 8 * 4
    configure_compiler("default", 1, dynamic_shapes=plan_compile(load_job_config(
        _write_config(tmp_path, "default", "cpu"))).dynamic_shapes)
    assert torch._dynamo.config.recompile_limit == 8
    if hasattr(compiler_settings, "mix_order_reduction"):  # symbolic sizes turn off what breaks on them
        assert compiler_settings.mix_order_reduction is False


def _loss_and_grads(objective: DraftObjective, inputs: DrafterInputs):
    objective.drafter.zero_grad(set_to_none=True)
    loss, correct, counted = objective(inputs)
    loss.backward()
    return loss.detach(), correct, counted, [p.grad.clone() for p in objective.drafter.parameters()]


def test_padding_into_a_bucket_leaves_loss_and_gradients_unchanged():
    objective = tiny_objective("cpu")
    real = example_inputs(objective, 24, FEATURE_LAYERS * HIDDEN, "cpu")  # 2 rows, 24 tokens, 8 blocks
    shape = BatchShape(rows=3, length=40, blocks=16)
    bucket = cudagraphs._Bucket(shape, inputs_of_shape(objective, shape, real, seed=5))
    assert shape.holds(real) and not BatchShape(1, 16, 16).holds(real)
    bucket.load(real)
    assert bucket.static.input_ids.shape == (3, 40) and bucket.static.anchors.shape == (3, 16)
    expected, got = _loss_and_grads(objective, real), _loss_and_grads(objective, bucket.static)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])
    for g, e in zip(got[3], expected[3]):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_bucket_load_overwrites_every_padded_slot_of_the_previous_batch():
    objective = tiny_objective("cpu")
    big = example_inputs(objective, 40, FEATURE_LAYERS * HIDDEN, "cpu")
    small = example_inputs(objective, 16, FEATURE_LAYERS * HIDDEN, "cpu")
    shape = BatchShape(rows=2, length=40, blocks=8)
    bucket = cudagraphs._Bucket(shape, inputs_of_shape(objective, shape, big, seed=1))
    bucket.load(big)
    bucket.load(small)
    blocks = small.anchors.shape[1]
    assert torch.equal(bucket.static.input_ids[:, 16:], torch.zeros(2, 24, dtype=torch.long))
    assert not bucket.static.anchor_valid[:, blocks:].any()
    assert float(bucket.static.weights[:, blocks:].abs().sum()) == 0.0
    assert torch.equal(bucket.static.features[:, :16], small.features)


# ------------------------------------------------------------------ CPU: one compile for every bucket

# Four buckets (16x16, 8x32, 5x48, 4x64, 8 blocks each); at these sizes Inductor's CPU code
# generation makes the same size-dependent choices for all four (at larger ones it picks a
# reduction's accumulator by size, which would give a bucket a graph of its own).
FOUR_BUCKETS = DataConfig(synthetic=None, train="train.jsonl", max_length=64, token_budget=256, pad_multiple=16)


def _bucket_inputs(objective: DraftObjective, data: DataConfig) -> list[DrafterInputs]:
    """Random inputs of every bucket `data` makes, largest first as the graph builder warms them up."""
    buckets = cudagraphs.bucket_shapes(data, DrafterConfig(block_size=BLOCK, num_anchors=8))
    like = example_inputs(objective, 16, FEATURE_LAYERS * HIDDEN, "cpu")
    ordered = sorted(buckets, key=lambda shape: (shape.tokens, shape), reverse=True)
    return [inputs_of_shape(objective, shape, like, seed=i) for i, shape in enumerate(ordered)]


def _warm_up_compiled(shapes: str, data: DataConfig, backward: bool, **options):
    """What the whole_step strategy runs before capturing, on CPU: the objective compiled
    (torch.compile `options`) for every bucket, one warm-up step per bucket (forward only
    unless `backward`). -> (graphs compiled per bucket, compiled losses, eager losses)."""
    torch._dynamo.reset()  # no cache entry of an earlier test's compile may serve this one
    objective = tiny_objective("cpu")
    inputs = _bucket_inputs(objective, data)
    compiled = compile_for_shapes(objective, inputs, shapes, fullgraph=True, **options)
    losses = []

    def step(batch: DrafterInputs) -> None:
        with torch.set_grad_enabled(backward):
            loss, _, _ = compiled(batch)
        if backward:
            loss.backward()
        losses.append(float(loss.detach()))

    graphs = [count for _, count in warm_up(step, inputs, steps=1)]
    with torch.no_grad():
        eager = [float(objective(batch)[0]) for batch in inputs]
    return graphs, losses, eager


@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=78, why="compiles a train step with Inductor on CPU")
def test_dynamic_shapes_compile_one_train_step_for_every_bucket_with_eager_losses():
    graphs, compiled, eager = _warm_up_compiled("dynamic", FOUR_BUCKETS, backward=True)
    assert graphs == [1, 0, 0, 0]  # the first bucket's compile serves the other three
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert len(set(eager)) == 4  # four different batches, not one loss four times


@pytest.mark.timeout(600)
def test_static_shapes_compile_every_bucket_on_its_own():
    # Whether a shape gets a graph of its own is Dynamo's decision (dynamic=False), made
    # before any backend runs: the eager backend shows it without Inductor's CPU compile.
    graphs, compiled, eager = _warm_up_compiled("static", FOUR_BUCKETS, backward=False, backend="eager")
    assert graphs == [1, 1, 1, 1]
    assert compiled == pytest.approx(eager, rel=1e-4)


# ------------------------------------------------------------------ CPU: the objective from saved graphs

@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=45, why="an Inductor compile of the step ahead of time on CPU, then a load of what it saved")
@pytest.mark.skipif(precompiled.unsupported_reason() is not None, reason=str(precompiled.unsupported_reason()))
def test_the_whole_step_objective_is_compiled_once_saved_and_loaded_by_the_next_process(tmp_path, monkeypatch,
                                                                                      compiler_settings):
    """What whole_step captures, from the compile cache's saved graphs (precompiled.py),
    with dynamic shapes: the first build compiles one graph for the four buckets and saves
    it; a new process's build loads it, traces nothing, and gives eager's losses."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(precompiled, "_SHARED", {})
    monkeypatch.setattr(precompiled, "FAILED", [])
    configure_compiler("cudagraphs", 1, 4, dynamic_shapes=True)
    objective = tiny_objective("cpu")
    statics = [cudagraphs._Bucket(shape_of(inputs), inputs) for inputs in _bucket_inputs(objective, FOUR_BUCKETS)]
    with torch.no_grad():
        eager = [float(objective(bucket.static)[0]) for bucket in statics]
    call, made, loaded = cudagraphs._precompiled_objective(objective, statics, "dynamic", tmp_path / "key")
    assert loaded == 0 and [graphs for _, graphs in made.values()] == [1, 0, 0, 0]
    (saved,) = (tmp_path / "key" / precompiled.PRECOMPILED_DIR).glob("*.aot")
    assert [float(call(bucket.static)[0]) for bucket in statics] == pytest.approx(eager, rel=1e-4)

    monkeypatch.setattr(precompiled, "_SHARED", {})  # as a new process finds it: only the file
    before = CompilerWork.snapshot()
    call, made, loaded = cudagraphs._precompiled_objective(objective, statics, "dynamic", tmp_path / "key")
    assert loaded == 1 and [graphs for _, graphs in made.values()] == [0, 0, 0, 0]
    assert [float(call(bucket.static)[0]) for bucket in statics] == pytest.approx(eager, rel=1e-4)
    assert CompilerWork.since(before).trace_s == 0  # nothing traced
    assert precompiled.FAILED == [] and saved.stat().st_size > 0


# ------------------------------------------------------------------ GPU: real graphs


def _batches(seed: int, steps: int, objective: DraftObjective, device: str) -> list[DrafterInputs]:
    """Fresh data every step, other data for every seed; varying lengths (16..40) so both
    buckets and the padding are exercised."""
    return [random_inputs(2, 16 + 8 * (step % 4), 8, block_size=BLOCK, vocab=VOCAB,
                          num_features=FEATURE_LAYERS * HIDDEN, features_dtype=objective.embed_weight.dtype,
                          device=device, seed=seed * 1000 + step)
            for step in range(steps)]


class _Drafter:
    """A data-parallel drafter as training_step steps it: replica.Replica, minus the
    checks and the scheduler (plain AdamW), with the losses it posted."""

    accumulate = 1

    def __init__(self, index: int, device: str, replicas: int):
        self.index = self.global_index = index
        self.layout = Layout(local_replicas=replicas)
        self.device = device
        self.objective = tiny_objective(device, seed=0)
        self.params = list(self.objective.drafter.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=3e-3)
        self.train_step = None  # built in the thread that steps it
        self.losses: list[float] = []

    def run_step(self, inputs: DrafterInputs, poison: bool, summed):  # one micro-batch a step
        return self.train_step(inputs)

    def post(self, stats) -> Posted:
        grads = [p.grad for p in self.params]
        self.losses.append(float(stats.loss))
        return Posted(grads, step_facts(stats, grads[0].dtype), Fence(self.device), self.device)

    def apply(self, mine, step: int) -> None:
        mine.fence.wait(self.device, mine.flat)
        for param, grad in zip(self.params, mine.grads):
            param.grad = grad
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _train(devices: list[str], steps: int, mode: str, threaded: bool, folder: Path) -> list[list[float]]:
    """One data-parallel drafter per entry of `devices`, stepped by the trainer's
    training_step (gradients averaged by its GradientExchange every step); in JobThreads
    of their own meeting at a threads.Rendezvous (threaded), or all at once here.
    `folder` takes the stop latch's files."""
    replicas = len(devices)
    drafters = [_Drafter(r, devices[r], replicas) for r in range(replicas)]
    data = [_batches(100 + r, steps, drafters[r].objective, devices[r]) for r in range(replicas)]
    buckets = [BatchShape(2, 24, 8), BatchShape(2, 40, 8)]
    exchange = GradientExchange(Layout(local_replicas=replicas), None)
    no_faults = FaultInjector(())

    def build(r: int):
        example = example_inputs(drafters[r].objective, 24, FEATURE_LAYERS * HIDDEN, devices[r])
        if mode == "eager":
            return build_train_step("off", drafters[r].objective, example)
        return cudagraphs.build_cudagraph_train_step(drafters[r].objective, example, buckets, strategy="whole_step")

    if not threaded:
        for r in range(replicas):
            drafters[r].train_step = build(r)
        for step in range(steps):
            training_step(drafters, [[data[r][step]] for r in range(replicas)], exchange.average, no_faults,
                          step + 1, peers=None)
        return [d.losses for d in drafters]

    latch = StopLatch(ErrorLog(folder / "errors.jsonl"), ThreadNames(folder / "threads.json"))
    rendezvous = Rendezvous(replicas, latch)

    def body(r: int):
        def drafter(worker: JobThread) -> None:
            with thread_stream(devices[r]):  # each drafter on a stream of its own, on its GPU
                drafters[r].train_step = build(r)
                worker.mark_ready()
                for step in range(steps):  # a faster replica may replay its next step while others apply
                    training_step([drafters[r]], [[data[r][step]]], at_rendezvous(rendezvous, r, exchange.average),
                                  no_faults, step + 1, peers=None)
        return drafter

    workers = [JobThread(f"drafter-{r}", latch, body(r)) for r in range(replicas)]
    for worker in workers:  # the coordinator's ready barrier
        worker.start()
        worker.wait_until_ready(600)
    for worker in workers:
        worker.join()
    if latch.failure is not None:
        raise latch.failure[1]
    return [d.losses for d in drafters]


def _check_against_eager(devices: list[str], folder: Path, steps: int = 24) -> None:
    eager = _train(devices, steps, "eager", threaded=False, folder=folder)
    alone = _train(devices, steps, "cudagraphs", threaded=False, folder=folder)
    threaded = _train(devices, steps, "cudagraphs", threaded=True, folder=folder)
    for r in range(len(devices)):
        # The same graphs replayed one after another: only reduction order may differ
        # (cuDNN's attention backward is not deterministic), never a buffer's contents.
        assert threaded[r] == pytest.approx(alone[r], rel=2e-3), f"drafter-{r}"
        # Against eager, Inductor's fused bf16 arithmetic differs too.
        assert threaded[r] == pytest.approx(eager[r], rel=2e-2), f"drafter-{r}"
    assert all(threaded[0] != threaded[r] for r in range(1, len(devices)))  # each saw its own data


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("replicas", [2, 3])
def test_graphed_drafters_in_threads_train_like_eager(replicas, tmp_path):
    _check_against_eager(["cuda:0"] * replicas, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(600)
def test_graphed_drafters_on_two_gpus_capture_and_average_across_devices(tmp_path):
    """One drafter per GPU: each captures on its own device (torch.cuda.graph's default
    capture stream lives on the first capture's device) and gradients cross devices."""
    _check_against_eager(["cuda:0", "cuda:1"], tmp_path)


def _same_tokens_other_anchors(base: DrafterInputs, seed: int, real_blocks: int) -> DrafterInputs:
    """`base`'s tokens and features with other anchors, `real_blocks` of them valid a row,
    and the labels and weights that go with them (one assistant turn throughout)."""
    generator = torch.Generator().manual_seed(seed)
    rows, length = base.input_ids.shape
    blocks = base.anchors.shape[1]
    anchors = torch.zeros((rows, blocks), dtype=torch.long)
    anchors[:, :real_blocks] = torch.stack([
        torch.sort(torch.randperm(length - 2, generator=generator)[:real_blocks]).values for _ in range(rows)]) + 1
    valid = torch.arange(blocks).expand(rows, -1) < real_blocks
    ids = base.input_ids.cpu()
    labels, weights = block_labels(ids, torch.zeros_like(ids), anchors, valid, position_weights(BLOCK, 7.0))
    device = base.input_ids.device
    return DrafterInputs(base.input_ids, base.features, anchors.to(device), valid.to(device), labels.to(device),
                         weights.to(device))


def _eager_loss_and_grads(objective: DraftObjective, inputs: DrafterInputs, mask_of: DrafterInputs | None = None):
    """Eager loss, counted positions and every gradient flattened into one vector; with the
    block mask of `mask_of`'s anchors instead of `inputs`' own when given (what a step
    that kept an earlier batch's mask would compute)."""
    patch = pytest.MonkeyPatch()
    if mask_of is not None:
        for name in ("dense_block_mask", "flex_block_mask"):
            make = getattr(objective_module, name)
            patch.setattr(objective_module, name, lambda anchors, valid, context_len, block_size, make=make:
                          make(mask_of.anchors, mask_of.anchor_valid, context_len, block_size))
    try:
        loss, _, counted, grads = _loss_and_grads(objective, inputs)
    finally:
        patch.undo()
    return loss, counted, torch.cat([g.flatten().float() for g in grads])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["whole_step", "upstream"])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_replayed_steps_mask_each_batch_by_its_own_anchors(attention, strategy):
    """One bucket, replayed on batches of the same tokens and features whose anchors (and
    number of valid anchors) differ: every replay's gradients and loss are eager's for that
    batch. A mask frozen at capture, or left from the previous batch, would be caught: the
    previous batch's mask moves the gradients far more than the tolerance (checked below
    for every batch, so the test cannot pass vacuously), which allows for Inductor's bf16
    kernels against eager's (measured on CPU at these shapes: the previous batch's mask
    moves the gradients by 0.22-0.43 relative, all-bf16 arithmetic by 0.006)."""
    if strategy == "upstream" and step_build.torch_version() < cudagraphs.UPSTREAM_THREAD_SAFE_TORCH:
        pytest.skip("the upstream strategy needs torch >= 2.13")
    device = "cuda:0"
    objective = tiny_objective(device, use_flex=attention == "flex", head_dim=16)
    base = random_inputs(2, 40, 8, block_size=BLOCK, vocab=VOCAB, num_features=FEATURE_LAYERS * HIDDEN,
                         features_dtype=objective.embed_weight.dtype, device=device, seed=7)
    batches = [_same_tokens_other_anchors(base, seed, real) for seed, real in ((1, 8), (2, 8), (3, 5), (4, 8))]
    step = cudagraphs.build_cudagraph_train_step(objective, base, [BatchShape(2, 40, 8)],
                                                 strategy=strategy)
    tolerance = 0.05
    for previous, batch in zip([base] + batches, batches):
        assert not torch.equal(previous.anchors, batch.anchors)
        objective.drafter.zero_grad(set_to_none=True)  # as the optimizer leaves them between steps
        stats = step(batch)
        graphed = torch.cat([p.grad.flatten().float() for p in objective.drafter.parameters()])
        loss, counted, eager = _eager_loss_and_grads(objective, batch)
        _, _, stale = _eager_loss_and_grads(objective, batch, mask_of=previous)
        assert _relative(stale, eager) > 2 * tolerance, "these batches cannot tell a stale block mask apart"
        assert _relative(graphed, eager) < tolerance, (_relative(graphed, eager), _relative(stale, eager))
        assert float(stats.loss) == pytest.approx(float(loss), rel=2e-2)
        assert torch.equal(stats.counted.cpu(), counted.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_dynamic_whole_step_compiles_once_and_captures_every_bucket(attention, compiler_settings):
    """compile_shapes: dynamic on a GPU: one compile serves the four buckets, each bucket
    gets a graph of its own, and every replay gives eager's loss for its batch."""
    torch._dynamo.reset()
    device = "cuda:0"
    objective = tiny_objective(device, use_flex=attention == "flex", head_dim=16)
    buckets = cudagraphs.bucket_shapes(FOUR_BUCKETS, DrafterConfig(block_size=BLOCK, num_anchors=8))
    configure_compiler("cudagraphs", 1, len(buckets), dynamic_shapes=True)  # as the trainer sets it up
    like = example_inputs(objective, 16, FEATURE_LAYERS * HIDDEN, device)
    step = cudagraphs.build_cudagraph_train_step(objective, like, buckets, shapes="dynamic", strategy="whole_step")
    assert step.report.shapes == "dynamic" and len(step.report.buckets) == 4
    assert step.report.graphs_compiled == 1, step.report.describe()
    assert all(b.capture_s > 0 for b in step.report.buckets)
    for i, shape in enumerate(buckets):
        batch = inputs_of_shape(objective, shape, like, seed=50 + i)
        graphed = float(step(batch).loss)
        eager = _eager_loss_and_grads(objective, batch)[0]
        assert graphed == pytest.approx(float(eager), rel=2e-2), shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
def test_graphed_micro_batches_add_up_and_a_step_starts_from_zero():
    """optim.accumulate under whole_step: the graph adds, the zeroing before a step's
    first micro-batch is outside it, and the sum is handed out after the last."""
    objective = tiny_objective("cuda:0")
    batches = _batches(7, 3, objective, "cuda:0")  # 16, 24 and 32 tokens: both buckets
    example = example_inputs(objective, 24, FEATURE_LAYERS * HIDDEN, "cuda:0")
    train_step = cudagraphs.build_cudagraph_train_step(
        objective, example, [BatchShape(2, 24, 8), BatchShape(2, 40, 8)], strategy="whole_step")
    params = list(objective.drafter.parameters())
    alone = []  # each micro-batch as a step of its own, by the same graphs
    for batch in batches:
        stats = train_step(batch)
        alone.append((float(stats.loss), [p.grad for p in params]))
    summed = None
    for micro, batch in enumerate(batches):
        stats = train_step(batch, first=micro == 0, last=micro == len(batches) - 1)
        summed = stats if summed is None else summed.plus(stats)
    got = [p.grad for p in params]
    expected = [sum(grads) for grads in zip(*(g for _, g in alone))]

    def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return float(torch.linalg.vector_norm(torch.cat([(x - y).flatten() for x, y in zip(a, b)]))
                     / torch.linalg.vector_norm(torch.cat([y.flatten() for y in b])))

    # the same kernels, added in place: only non-deterministic attention backward may differ
    assert relative_error(got, expected) < 1e-3
    # not the last micro-batch alone, nor a sum that kept the previous step's gradients
    assert relative_error(got, alone[-1][1]) > 0.1
    assert relative_error(got, [e + g for e, g in zip(expected, alone[-1][1])]) > 0.1
    assert float(summed.loss) == pytest.approx(sum(loss for loss, _ in alone), rel=1e-3)
    handed_out = [g.clone() for g in got]
    train_step(batches[0])  # the handed-out sums are copies the next step leaves alone
    assert all(torch.equal(a, b) for a, b in zip(got, handed_out))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(precompiled.unsupported_reason() is not None, reason=str(precompiled.unsupported_reason()))
@pytest.mark.timeout(600)
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("shapes", ["static", "dynamic"])
def test_a_whole_step_from_saved_graphs_traces_nothing_and_replays_eagers_losses(shapes, attention, tmp_path,
                                                                                 monkeypatch, compiler_settings):
    """compile: cudagraphs on a warm start: the first build compiles the step ahead of time
    and saves it in the key folder; the next process's build loads it, traces nothing,
    captures every bucket, and every replay gives eager's loss for its batch."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(precompiled, "_SHARED", {})
    monkeypatch.setattr(precompiled, "FAILED", [])
    torch._dynamo.reset()
    device = "cuda:0"
    buckets = cudagraphs.bucket_shapes(FOUR_BUCKETS, DrafterConfig(block_size=BLOCK, num_anchors=8))
    configure_compiler("cudagraphs", 1, len(buckets), dynamic_shapes=shapes == "dynamic")
    plan = CompilePlan("cudagraphs", buckets=buckets, shapes=shapes, precompiled=tmp_path / "key")
    first_objective = tiny_objective(device, use_flex=attention == "flex", head_dim=16)
    like = example_inputs(first_objective, 16, FEATURE_LAYERS * HIDDEN, device)
    first = build_train_step(plan, first_objective, like)
    assert first.report.graphs_loaded == 0 and first.report.graphs_compiled == (1 if shapes == "dynamic" else 4)
    assert list((tmp_path / "key" / precompiled.PRECOMPILED_DIR).glob("*.aot"))

    monkeypatch.setattr(precompiled, "_SHARED", {})  # as a new process finds it: only the file
    objective = tiny_objective(device, use_flex=attention == "flex", head_dim=16)
    step = build_train_step(plan, objective, like)
    assert (step.report.graphs_loaded, step.report.graphs_compiled) == (first.report.graphs_compiled, 0), \
        step.report.describe()
    assert step.report.compiler.trace_s == 0 and all(b.capture_s > 0 for b in step.report.buckets)
    for i, shape in enumerate(buckets):
        batch = inputs_of_shape(objective, shape, like, seed=50 + i)
        graphed = float(step(batch).loss)
        eager = _eager_loss_and_grads(objective, batch)[0]
        assert graphed == pytest.approx(float(eager), rel=2e-2), shape
    assert precompiled.FAILED == []


