"""Nothing compiles once a drafter is ready: the shapes a run's data makes (read from the
batch plan and the token store, not from an example), the bound on drafter block tokens
that keeps short rows from multiplying a micro-batch's size, the build of `compile:
default` over every one of those shapes, and the refusal (StrayCompile, naming the shape
and the guard) of a step that would compile afterwards. On CPU, real torch.compile."""
from __future__ import annotations

import json
import random
import sys
import threading

import pytest
import torch

from dflash_schema import SchemaError
from dflash_train.compiling import cudagraphs, policy
from dflash_train.compiling.policy import (CompilePlan, build_train_step, configure_compiler, example_inputs,
                                         specialization_classes)
from dflash_train.config import (NO_TURN, DataConfig, DrafterConfig, TinyTargetSpec, load_job_config, padded_length,
                                 rows_per_micro_batch)
from dflash_train.data.batches import (BatchPlan, BatchShape, Sample, StoredSamples, anchor_counts, collate,
                                       load_samples, micro_batch_shapes)
from dflash_train.model.objective import anchor_candidates
from dflash_train.data.tiny import _build_tokenizer
from dflash_train.compiling.step_build import StrayCompile, graphs_compiled, inputs_of_shape, shape_of

from test_head_loss import objective

pytestmark = pytest.mark.timeout(300)


def random_samples(count: int, seed: int) -> list[Sample]:
    """Samples of 3 to 90 tokens, each a prompt (no turn) then one or two assistant turns."""
    generator = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt, answers = generator.randrange(1, 20), [generator.randrange(2, 40) for _ in range(generator.randrange(1, 3))]
        turns = [NO_TURN] * prompt + [t for i, n in enumerate(answers) for t in [i] * n]
        samples.append(Sample(torch.randint(0, 50, (len(turns),), dtype=torch.int32),
                              torch.tensor(turns, dtype=torch.int32)))
    return samples


def test_anchor_counts_from_a_store_are_those_of_each_sample(tmp_path):
    path = tmp_path / "chat.jsonl"
    generator = random.Random(0)
    with open(path, "w") as f:
        for _ in range(40):
            messages = [{"role": "user", "content": " ".join(f"w{generator.randrange(200)}" for _ in range(generator.randrange(1, 30)))},
                        {"role": "assistant", "content": " ".join(f"w{generator.randrange(200)}" for _ in range(generator.randrange(1, 30)))}]
            f.write(json.dumps({"messages": messages}) + "\n")
    tokenizer = _build_tokenizer(TinyTargetSpec())
    stored = load_samples(path, tokenizer, 48, tmp_path / "cache", workers=1)
    assert isinstance(stored, StoredSamples)
    one_by_one = [anchor_candidates(stored[i].turn_ids).numel() for i in range(len(stored))]
    assert anchor_counts(stored).tolist() == one_by_one
    assert len(set(one_by_one)) > 5  # the lengths vary: a constant count could hide an offset error


def test_the_shapes_of_a_plan_are_the_shapes_collate_makes():
    samples = random_samples(200, seed=1)
    data = DataConfig(synthetic={}, max_length=96, token_budget=96, pad_multiple=16)  # rows of 1 to 6
    drafter = DrafterConfig(num_layers=1, block_size=4, num_anchors=24)
    plan = BatchPlan(samples, data, replicas=2, epochs=2, max_steps=None, seed=0, drafter=drafter)
    shapes = micro_batch_shapes(plan, iter(plan.entries), anchor_counts(samples), data, drafter)
    collated = {BatchShape(b.input_ids.shape[0], b.input_ids.shape[1], b.anchors.shape[1])
                for b in (collate(samples, entry, 1, 0, data, drafter, 0, 0) for entry in plan.entries)}
    assert set(shapes) == collated
    assert list(shapes) == sorted(shapes, key=lambda s: (s.tokens, s), reverse=True)
    assert {s.rows for s in shapes} >= {1, 2, 3}  # mixed row counts
    assert len({s.blocks for s in shapes}) > 1


def test_a_block_token_budget_bounds_the_rows_of_short_sequences_and_the_buckets_follow():
    drafter = DrafterConfig(num_layers=1, block_size=16, num_anchors=512)
    data = DataConfig(synthetic={}, max_length=3072, token_budget=12288, pad_multiple=768, block_token_budget=32768)
    # a row of 768 tokens may bring 512 blocks of 16: 8192 block tokens, so 4 rows, not 16
    assert [rows_per_micro_batch(data, drafter, n) for n in (768, 1536, 2304, 3072)] == [4, 4, 4, 4]
    unbounded = DataConfig(synthetic={}, max_length=3072, token_budget=12288, pad_multiple=768)
    assert [rows_per_micro_batch(unbounded, drafter, n) for n in (768, 1536, 2304, 3072)] == [16, 8, 5, 4]
    assert [b.rows for b in cudagraphs.bucket_shapes(data, drafter)] == [4, 4, 4, 4]
    # the packer keeps to it: every micro-batch fits its length's rows
    samples = random_samples(300, seed=2)
    small = DataConfig(synthetic={}, max_length=96, token_budget=96, pad_multiple=16, block_token_budget=64)
    tiny_drafter = DrafterConfig(num_layers=1, block_size=4, num_anchors=8)
    plan = BatchPlan(samples, small, replicas=1, epochs=1, max_steps=None, seed=0, drafter=tiny_drafter)
    for entry in plan.entries:
        length = padded_length(max(len(samples[i].ids) for i in entry.samples), 16)
        assert len(entry.samples) <= rows_per_micro_batch(small, tiny_drafter, length)
    assert max(len(e.samples) for e in plan.entries) == 2  # 64 block tokens: two rows of 8 blocks of 4


@pytest.mark.parametrize("sections, refusal", [
    ("data: {synthetic: {}, max_length: 128, token_budget: 512, block_token_budget: 64}\n"
     "drafter: {block_size: 8, num_anchors: 32}\n",
     "block_token_budget .64. must hold one sequence of max_length: 256"),  # 32 blocks of 8
    ("data: {synthetic: {}, max_length: 128, token_budget: 512}\ndrafter: {attention: flex}\ncompile: off\n",
     "attention: flex needs compile: default or cudagraphs")])  # uncompiled flex compiles in the threads
def test_configs_that_cannot_hold_a_row_or_would_compile_in_threads_are_refused(tmp_path, sections, refusal):
    path = tmp_path / "train.yaml"
    path.write_text("target: {tiny: {}}\n" + sections)
    with pytest.raises(SchemaError, match=refusal):
        load_job_config(path)


def test_specialization_classes_keep_the_largest_shape_of_each():
    shapes = (BatchShape(4, 32, 8), BatchShape(1, 128, 16), BatchShape(2, 48, 8), BatchShape(1, 64, 8))
    assert specialization_classes(shapes) == (BatchShape(4, 32, 8), BatchShape(1, 128, 16))


@pytest.mark.slow(seconds=37, why="torch.compile of a tiny drafter on CPU (aot_eager), once per shape class")
def test_compile_default_is_built_for_every_data_shape_and_a_shape_it_was_not_built_for_is_refused():
    drafter_objective = objective(None)
    example = example_inputs(drafter_objective, 16, drafter_objective.drafter.fc.in_features, "cpu")
    data_shapes = (BatchShape(3, 40, 8), BatchShape(2, 32, 8), BatchShape(1, 40, 8), BatchShape(2, 24, 8))
    torch._dynamo.reset()  # what other tests of this process compiled is not this build's
    # aot_eager: Dynamo's guards and AOTAutograd's graphs, as under Inductor, without its codegen
    built = build_train_step(CompilePlan("default", data_shapes=data_shapes, backend="aot_eager"), drafter_objective,
                             example)
    warmed = {timing.shape for timing in built.report.buckets}
    assert warmed >= {BatchShape(3, 40, 8), BatchShape(1, 40, 8)}  # one per class, the largest
    assert built.report.checked + len(warmed) == len(data_shapes)
    compiled = graphs_compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):  # what compiling.policy.forbid_compiles sets
        for shape in data_shapes:  # every shape of the data trains without a compile
            built(inputs_of_shape(drafter_objective, shape, example, seed=7))
        stray = inputs_of_shape(drafter_objective, BatchShape(2, 24, 1), example, seed=8)  # one block: specialized
        with pytest.raises(StrayCompile) as refused:
            built(stray)
    assert graphs_compiled() == compiled
    message = str(refused.value)
    assert "MainThread: torch.compile would compile again after ready, for a micro-batch of 2 x 24 tokens " \
           "with 1 blocks" in message
    assert "size mismatch" in message  # the guard that failed, from Dynamo's own words
    assert shape_of(stray) == BatchShape(2, 24, 1)


@pytest.mark.slow(seconds=40, why="torch.compile of a tiny drafter on CPU (aot_eager), once per shape class")
def test_compile_default_drafters_stepping_at_once_enter_the_compiled_forward_one_at_a_time():
    # torch 2.11's Dynamo walks a code object's cache entries live, and another thread's
    # hit reorders them: drafters that overlapped in the one compiled forward missed the
    # graphs they were built with (StrayCompile, "BACKEND_MATCH failure") within steps.
    # torch 2.13 did not miss so here, so there the overlap itself is what would fail.
    inside, most, count = [0], [0], threading.Lock()

    def counting(graph, example):  # aot_eager's graphs, counting the threads inside one
        from torch._dynamo.backends.registry import lookup_backend

        compiled = lookup_backend("aot_eager")(graph, example)

        def run(*args):
            with count:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            try:
                return compiled(*args)
            finally:
                with count:
                    inside[0] -= 1
        run._boxed_call = getattr(compiled, "_boxed_call", False)  # called as aot_eager's would be
        return run

    objectives = [objective(None) for _ in range(4)]
    example = example_inputs(objectives[0], 16, objectives[0].drafter.fc.in_features, "cpu")
    data_shapes = (BatchShape(2, 32, 8), BatchShape(1, 32, 8), BatchShape(2, 16, 8), BatchShape(1, 16, 8))
    torch._dynamo.reset()  # what other tests of this process compiled is not this build's
    plan = CompilePlan("default", num_drafters=4, data_shapes=data_shapes, backend=counting)
    with torch.fx.experimental._config.patch(use_duck_shape=False):  # as compiling.policy.configure_compiler sets
        steps = [build_train_step(plan, o, example) for o in objectives]
    batches = [[inputs_of_shape(o, shape, example, seed=i) for shape in data_shapes] for i, o in enumerate(objectives)]
    compiled, failures, most[0] = graphs_compiled(), [], 0

    def drafter(index: int) -> None:
        try:
            for step in range(48):  # 1-row and 2-row micro-batches in turn: each hit moves its graph to the front
                steps[index](batches[index][step % len(data_shapes)])
        except StrayCompile as exc:
            failures.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads trade the GIL often, inside Dynamo's guards too
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):  # what compiling.policy.forbid_compiles sets
            threads = [threading.Thread(target=drafter, args=(i,), name=f"drafter-{i}") for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[0]
    assert graphs_compiled() == compiled
    assert most[0] == 1


@pytest.mark.slow(seconds=75, why="an Inductor compile of the tiny step on CPU, then the step traced again from "
                                  "its caches")
def test_a_build_reports_its_tracing_and_what_the_compile_caches_answered(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(policy, "_SHARED_FORWARD", {})
    plan = CompilePlan("default", data_shapes=(BatchShape(2, 32, 6),))  # traced: nothing precompiled
    configure_compiler("default", 1, plan.shapes_per_drafter, True)
    model = objective(None)
    example = example_inputs(model, 16, model.drafter.fc.in_features, "cpu")
    cold = build_train_step(plan, model, example).report
    torch._dynamo.reset()  # as a new process of the same host finds it: nothing traced, the caches on disk
    monkeypatch.setattr(policy, "_SHARED_FORWARD", {})
    warm = build_train_step(plan, model, example).report
    assert cold.compiler.trace_s > 0 and cold.compiler.inductor_misses >= 1 and cold.compiler.inductor_hits == 0
    assert warm.compiler.trace_s > 0  # the trace is paid again
    assert warm.compiler.inductor_misses == warm.compiler.autograd_misses == 0  # nothing compiled again
    assert warm.compiler.inductor_hits + warm.compiler.autograd_hits >= 1
    assert warm.compiler.inductor_s < cold.compiler.inductor_s
    assert warm.event_detail()["graphs_traced"] == 1 and "tracing" in warm.describe()
