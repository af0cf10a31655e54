"""End-to-end runs of `python -m dflash_train` as the agent launches it: a subprocess with
cwd = the run dir, stdout+stderr appended to train.log, the agent's environment. Real torch
on CPU with a tiny random target built at test time (shared through the cache).

The `gpu` test runs `compile: cudagraphs` with two drafters on one GPU: only the device
proves a run whose train steps and optimizer replay captured graphs (accumulating, the
replicas bit-identical) and whose checkpoints then load both ways with the eager CPU run;
test_cudagraphs.py and test_optimizer_step.py say what the CPU checks of those graphs."""
from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import time
from pathlib import Path

import dflash_contract.events
import pytest
from dflash_train.config import load_job_config, resolved_yaml
from support.train_configs import TINY_CPU
from support.trainer import FORK_SERVER, ForkedRun, Launched, end, start_trainer

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} \[[\w-]+\] ")
# The first frame of a stack in a faulthandler dump (most recent call first: its last line),
# written whole
FIRST_FRAME = re.compile(r'^  File (?:".*", line \d+ in (?:_bootstrap|_run_module_as_main)'
                         rf'|"{re.escape(str(FORK_SERVER))}", line \d+ in <module>)\n', re.MULTILINE)

# Small enough to start fast; every fault test shares its cache entry.
SMALL = """
target: {tiny: {}}
data:
  synthetic: {num_train: 64, num_eval: 2}
  max_length: 128
  token_budget: 512
  pad_multiple: 16
drafter: {num_layers: 1, block_size: 4, num_anchors: 8, num_target_features: 2}
devices: {target: [cpu], drafters: [cpu, cpu]}
runtime: {heartbeat_s: 0.5, torch_threads: 1}
"""


@pytest.fixture
def launch(workspace, tmp_path):
    started: list[Launched] = []

    def start(config_text: str, run_dir: Path | None = None, run_id: str = "run-1",
              env: dict[str, str] | None = None) -> Launched:
        started.append(start_trainer(workspace, run_dir or tmp_path / run_id, config_text, run_id, env))
        return started[-1]

    yield start
    for launched in started:  # only the processes this test started
        end(launched)


def step_losses(run: Launched) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in run.events("step")}


@pytest.mark.xdist_group("tiny-cpu-run")  # with test_speculative: the run is made once
@pytest.mark.timeout(480)
@pytest.mark.slow(seconds=34, why="the shipped tiny config run to its end in a new interpreter (make demo), made in "
                                  "the setup of the first test of its group to run")
def test_tiny_cpu_config_end_to_end(tiny_cpu_run, workspace):
    run = tiny_cpu_run
    assert run.proc.returncode == 0, run.log()[-3000:]
    # train.log: every line carries time and thread name
    lines = run.log().splitlines()
    assert lines and all(LOG_LINE.match(line) for line in lines), [l for l in lines if not LOG_LINE.match(l)][:5]
    assert {"[drafter-0]", "[drafter-1]", "[coordinator]", "[eval]"} <= {line.split()[1] for line in lines}
    # events.jsonl: the contract's types and fields
    events = run.events()
    assert all({"ts", "type", "thread"} <= set(e) for e in events)
    assert [e["phase"] for e in run.events("phase")] == ["startup", "train", "eval", "shutdown"]
    assert sorted(e["thread"] for e in run.events("ready")) == ["drafter-0", "drafter-1"]
    steps = run.events("step")
    assert [e["step"] for e in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 50
    first = steps[0]
    assert len(first["acc"]) == 7 and first["tokens_per_s"] > 0 and first["samples_per_s"] > 0 and first["lr"] > 0
    assert set(first["queue_depths"]) == {"target-0", "drafter-0", "drafter-1"}
    # no memory counter on CPU: one null per drafter
    assert first["peak_memory_bytes"] == [None, None] and first["total_steps"] == len(steps)
    assert all(e["grad_norm"] > 0 for e in steps)
    assert {"drafter-0", "drafter-1", "target-0", "prefetch"} <= {t for e in steps for t in e["wait_s"]}
    assert sum(e["loss"] for e in steps[-10:]) < sum(e["loss"] for e in steps[:10])
    assert len(run.events("heartbeat")) >= 3
    assert events[-1]["type"] == "done" and events[-1]["exit_code"] == 0 and events[-1]["threads_alive"] == []
    assert (run.run_dir / "errors.jsonl").read_text() == ""
    assert (run.run_dir / "faulthandler.log").exists()
    # data-parallel replicas end bit-identical, checked by the trainer itself
    [replicas] = run.events("replicas")
    assert replicas["step"] == len(steps) and len(replicas["sha256"]) == 2
    assert len(set(replicas["sha256"])) == 1 and replicas["sha256"][0] in run.log()
    # a checkpoint, complete, behind an atomically replaced `latest`
    latest = run.run_dir / "checkpoints" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == f"step_{len(steps):06d}"
    assert {p.name for p in latest.resolve().iterdir()} == {"model.safetensors", "optimizer.pt", "state.json",
                                                              "config.yaml", "SHA256SUMS"}
    # the config it ran, resolved (the agent was given the file as written here)
    assert (latest / "config.yaml").read_text() == resolved_yaml(load_job_config(TINY_CPU))
    checkpoints = run.events("checkpoint")
    assert checkpoints[-1]["step"] == len(steps) and checkpoints[-1]["thread"] == "checkpoint-writer"
    # training is held only for the copy off the device; the write is timed apart
    assert all(e["held_s"] >= 0 and e["write_s"] > 0 and e["waited_s"] >= 0 for e in checkpoints)
    # the acceptance-length gain, both numbers reported
    evals = run.events("eval")
    assert [e["step"] for e in evals] == [0, 48, 96]  # at the start, every 48 steps, at the end
    untrained, trained = evals[0], evals[-1]
    assert untrained["baseline"] and untrained["step"] == 0 and trained["final"]
    assert trained["baseline_acceptance_length"] == untrained["acceptance_length"]
    assert trained["acceptance_length"] >= untrained["acceptance_length"] + 0.8, evals
    assert f"acceptance length {trained['acceptance_length']:.3f}" in run.log()
    # the export loads back and drafts losslessly against the target
    check_export(run.run_dir / "export", workspace)


@pytest.mark.xdist_group("tiny-cpu-run")
@pytest.mark.timeout(480)
@pytest.mark.slow(seconds=1, why="reads the shipped tiny config's run (made once for its group, by its first test)")
def test_every_event_of_a_trained_run_fits_the_event_schema(tiny_cpu_run):
    """The trainer checks each event as it emits it, so a field renamed at the emitter or
    in the schema alone fails this run; what reads the renamed name (dflash_contract.events's
    names) fails in its own tests."""
    assert tiny_cpu_run.proc.returncode == 0, tiny_cpu_run.log()[-3000:]
    events = tiny_cpu_run.events()
    for event in events:
        dflash_contract.events.check(event)
    assert {"phase", "startup", "ready", "heartbeat", "step", "eval", "checkpoint", "export", "replicas",
            "done"} <= {e["type"] for e in events}
    assert {"import", "find sources", "build data", "load target", "drafter weights", "plan shapes",
            "set up evaluator", "set up", "build train step"} <= {
        e["phase"] for e in tiny_cpu_run.events("startup")}


def check_export(export: Path, workspace: Path) -> None:
    """The export loads back as a drafter that drafts losslessly against the target."""
    import torch

    from dflash_train.model.drafter import load_drafter
    from dflash_train.model.speculative import speculative_decode
    from dflash_train.model.target import FeatureTap, load_target
    from dflash_train.data.tiny import ensure_tiny_assets

    config = json.loads((export / "config.json").read_text())
    drafter = load_drafter(export).eval()
    train = load_job_config(TINY_CPU)  # its cache entry exists: this finds it, builds nothing
    assets = ensure_tiny_assets(train.target.tiny, train.data.synthetic, workspace / "cache")
    target = load_target(str(assets.target_dir), "float32", "cpu")
    tap = FeatureTap(target, tuple(config["dflash_config"]["target_layer_ids"]))
    prompt = [2, 6] + [10 + i for i in range(12)] + [3, 2, 7]
    decoded = speculative_decode(drafter, tap, target.get_input_embeddings().weight,
                                 target.get_output_embeddings().weight, prompt, 24, set())
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert decoded.tokens == greedy and max(decoded.accepted) > 1, (decoded.tokens, greedy, decoded.accepted)


@pytest.mark.timeout(120)
def test_raise_at_startup_is_reported_whole_and_fast(launch):
    run = launch(SMALL + "faults: [{thread: drafter-1, at: startup, kind: raise, depth: 40}]\n")
    assert run.wait(100) == 1  # the failure ends the run: nothing waits for the failed drafter
    errors = run.errors()
    assert [e["thread"] for e in errors] == ["drafter-1", "coordinator"]
    root, coordinator = errors
    assert root["phase"] == "startup" and root["step"] is None and root["exc_type"] == "InjectedFault"
    assert root["run_id"] == "run-1" and root["release_id"] == "rel-test" and isinstance(root["thread_ident"], int)
    deep = [f for f in root["frames"] if f["func"] in ("_descend_even", "_descend_odd")]
    assert len(deep) == 40  # every frame of the root cause, none collapsed
    assert root["traceback"].count("_descend_") >= 80  # each frame: the line and its code
    assert "InjectedRootCause: injected root cause in drafter-1 at startup" in root["traceback"]
    assert "The above exception was the direct cause" in root["traceback"]
    assert "drafter-1" in coordinator["message"] and coordinator["exc_type"] == "DrafterStartupError"
    assert "InjectedRootCause" in coordinator["traceback"] and "wait_until_ready" in coordinator["traceback"]
    assert coordinator["frames"] == root["frames"]  # the coordinator's record points at the same root cause
    done = run.events("done")[-1]
    assert done["exit_code"] == 1 and done["threads_alive"] == []
    assert not run.events("step")


@pytest.mark.timeout(120)
def test_raise_while_training_stops_the_run_at_that_step(launch):
    run = launch(SMALL + "faults: [{thread: target-0, at: 'step:3', kind: raise, depth: 5}]\n")
    assert run.wait(100) == 1
    root, coordinator = run.errors()
    assert (root["thread"], root["phase"], root["step"]) == ("target-0", "train", 3)
    assert coordinator["thread"] == "coordinator" and coordinator["exc_type"] == "ThreadFailed"
    assert coordinator["message"].startswith("target-0 failed: InjectedFault")
    assert coordinator["frames"] == root["frames"]
    assert run.events("done")[-1]["threads_alive"] == []
    # The target failed before producing step 3's features, so no drafter step 3 can have
    # completed. The target may run ahead of the drafters by a queue's length, so on a slow
    # machine not even step 1 may have completed: none at all is a valid outcome.
    assert all(e["step"] < 3 for e in run.events("step"))


@pytest.mark.timeout(120)
def test_hang_stops_heartbeats_and_sigusr1_dumps_every_thread(launch):
    # No evaluation thread here: its progress would (rightly) keep heartbeats going a while.
    run = launch(SMALL + "eval: {num_prompts: 0}\nfaults: [{thread: drafter-1, at: 'step:3', kind: hang}]\n")
    run.wait_for("the hang", lambda: "injecting fault: hang" in run.log(), 90)
    # The rest of the pipeline fills its queues, then blocks: from then on no heartbeat may
    # come for five heartbeat periods (2.5 s). A pipeline that kept beating never gets there.
    quiet = {"since": time.monotonic(), "beats": len(run.events("heartbeat"))}

    def heartbeats_stopped() -> bool:
        beats = len(run.events("heartbeat"))
        if beats != quiet["beats"]:
            quiet.update(since=time.monotonic(), beats=beats)
        return time.monotonic() - quiet["since"] >= 2.5

    run.wait_for("five heartbeat periods without a heartbeat", heartbeats_stopped, 60)
    assert max(e["step"] for e in run.events("step")) == 2
    run.proc.send_signal(signal.SIGUSR1)
    dump = run.run_dir / "faulthandler.log"

    def whole_stacks_dumped() -> int:
        """The threads in the dump, or 0 while faulthandler is still writing one: each stack
        ends at its first frame, a thread's _bootstrap or the main thread's entry (the fork
        server's module, or runpy's for a new interpreter)."""
        text = dump.read_text()
        headers = text.count("Thread 0x") + text.count("Current thread 0x")
        return headers if len(FIRST_FRAME.findall(text)) == headers else 0

    # coordinator, prefetch, target, 2 drafters
    run.wait_for("every thread's stack", lambda: "_hang" in dump.read_text() and whole_stacks_dumped() >= 5, 10)
    text = dump.read_text()
    assert "wait_until_ready" not in text and "_hang" in text and "exchange" in text  # drafter-0 waits for its peer
    # faulthandler names threads by ident only: threads.json holds every dumped one's name,
    # and the checkpoint writer's, which made the checkpoint buffers after step 1 and ended.
    names = {int(ident): name for ident, name in json.loads((run.run_dir / "threads.json").read_text()).items()}
    assert sorted(names.values()) == ["checkpoint-writer", "coordinator", "drafter-0", "drafter-1", "prefetch",
                                      "target-0"]
    dumped = {int(ident, 16) for ident in re.findall(r"[Tt]hread 0x([0-9a-f]+)", text)}
    assert dumped == {ident for ident, name in names.items() if name != "checkpoint-writer"}
    run.proc.send_signal(signal.SIGTERM)  # the stop does not wait for the hung drafter-1
    assert run.wait(60) == 143
    done = run.events("done")[-1]
    assert done["exit_code"] == 143 and done["threads_alive"] == ["drafter-1"]
    # The dump of the thread that outlived the stop starts with its own header line.
    after = dump.read_text()[len(text):]
    assert after.startswith("=== stacks of every thread: threads still running after the stop: drafter-1 at ")
    assert "_hang" in after
    assert run.errors() == []  # a stop is not a failure
    assert os.readlink(run.run_dir / "checkpoints" / "latest") == "step_000002"  # checkpoint on stop


@pytest.mark.timeout(120)
def test_abort_leaves_every_stack_in_faulthandler_log(launch):
    run = launch(SMALL + "faults: [{thread: target-0, at: 'step:2', kind: abort}]\n")
    assert run.wait(100) == -signal.SIGABRT
    text = (run.run_dir / "faulthandler.log").read_text()
    assert "Fatal Python error: Aborted" in text
    assert "_abort" in text
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 5


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["threaded", "sequential"])
@pytest.mark.slow(seconds=3, why="a trainer run on CPU per case")
def test_a_checkpoint_that_cannot_be_written_fails_the_run(launch, mode):
    # `checkpoints` is a file: the background writer's mkdir fails, as a full or read-only disk would.
    run = launch(SMALL + f"pipeline: {{mode: {mode}}}\noptim: {{max_steps: 6}}\ncheckpoint: {{every: 2}}\n"
                 "eval: {num_prompts: 0}\n")
    (run.run_dir / "checkpoints").write_text("not a folder\n")
    assert run.wait(150) == 1, run.log()[-3000:]
    first = run.errors()[0]
    assert first["thread"] == "checkpoint-writer" and first["phase"] == "checkpoint" and first["step"] == 2
    assert first["exc_type"] == "FileExistsError"
    assert run.events("checkpoint") == [] and run.events("done")[-1]["exit_code"] == 1


def test_exit_fault_sets_the_exit_code(launch):
    run = launch(SMALL + "faults: [{thread: prefetch, at: 'step:2', kind: exit, code: 7}]\n")
    assert run.wait(100) == 7
    assert "injecting fault: exit in prefetch at step 2" in run.log()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["threaded", "sequential"])
@pytest.mark.slow(seconds=4, why="a trainer run on CPU per case, its first step made 3 s long")
def test_the_baseline_evaluation_starts_once_the_first_step_is_taken(launch, mode):
    """Beside the first step the baseline would share its GPU: in either pipeline mode the
    lead asks for it after that step (of the starting weights all the same). The first
    step is made 3 s long, after an event that comes before the step starts (drafter-0's
    ready event; in a sequential run, which has none, the train phase's); an evaluation
    asked for before the step would start before that event or within the step."""
    run = launch(SMALL + f"pipeline: {{mode: {mode}}}\noptim: {{max_steps: 2}}\n"
                 "faults: [{thread: drafter-0, at: 'step:1', kind: busy, seconds: 3}]\n", run_id=mode)
    assert run.wait(100) == 0, run.log()[-3000:]
    if mode == "threaded":
        (before_step,) = [e for e in run.events("ready") if e["replica"] == 0]
    else:
        (before_step,) = [e for e in run.events("phase") if e["phase"] == "train"]
    baseline = run.events("eval")[0]
    assert baseline["baseline"] and baseline["step"] == 0
    # Its start (the event is written after the `seconds` it took) is past the 3 s step.
    assert baseline["ts"] - baseline["seconds"] >= before_step["ts"] + 3.0, (baseline, before_step)
    assert run.events("eval")[-1]["baseline_acceptance_length"] == baseline["acceptance_length"]


@pytest.mark.timeout(180)
def test_resume_continues_step_count_and_loss_curve(launch, tmp_path):
    base = SMALL + "optim: {max_steps: 8}\ncheckpoint: {every: 3}\neval: {num_prompts: 0}\n"
    run_dir = tmp_path / "resumed"
    # Crashed (SIGKILL) after completing step 4; the newest checkpoint is step 3. Drafter-0
    # hangs before step 5 until then: a crash does not wait for the background write of
    # step 3's checkpoint, so the test waits for it, or the crash could come first.
    first = launch(base + "faults: [{thread: drafter-0, at: 'step:5', kind: hang}]\n", run_dir)
    first.wait_for("step 4 and step 3's checkpoint", lambda: "injecting fault: hang" in first.log()
                   and any(e["step"] == 4 for e in first.events("step"))
                   and any(e["step"] == 3 for e in first.events("checkpoint")), 90)
    first.proc.kill()
    assert first.wait(100) == -signal.SIGKILL
    first_losses = step_losses(first)
    assert sorted(first_losses) == [1, 2, 3, 4]
    assert os.readlink(run_dir / "checkpoints" / "latest") == "step_000003"
    first_events = len(first.events())

    second = launch(base.replace("checkpoint: {every: 3}", "checkpoint: {every: 3, resume: latest}"), run_dir)
    assert second.wait(100) == 0
    resumed = [e for e in second.events()[first_events:] if e["type"] == "step"]  # appended to the same file
    assert [e["step"] for e in resumed] == [4, 5, 6, 7, 8]
    # step 4 again, from the checkpoint: same data, anchors, weights and optimizer state -> same loss
    assert resumed[0]["loss"] == pytest.approx(first_losses[4], rel=1e-5, abs=1e-6)
    state = json.loads((run_dir / "checkpoints" / "latest" / "state.json").read_text())
    assert state["step"] == 8 and len(state["losses"]) == 8
    assert state["losses"][:3] == pytest.approx([first_losses[s] for s in (1, 2, 3)], rel=1e-6)
    assert "resuming from" in second.log() and "at step 3" in second.log()
    # the data cursor is checked: other batching would silently train on other batches
    third = launch(base.replace("checkpoint: {every: 3}", "checkpoint: {every: 3, resume: latest}")
                   .replace("token_budget: 512", "token_budget: 256").replace("max_steps: 8", "max_steps: 9"), run_dir)
    assert third.wait(100) == 1
    assert "data cursor" in third.errors()[0]["message"]


FOUR_STEPS = SMALL + "optim: {max_steps: 4}\neval: {num_prompts: 0}\n"


@pytest.fixture(scope="module")
def threaded_losses(workspace, tmp_path_factory) -> dict[int, float]:
    """The losses of FOUR_STEPS run by the threaded pipeline: what every other way of
    running the same work must reproduce (one run shared by the tests below)."""
    run = start_trainer(workspace, tmp_path_factory.mktemp("pipelines") / "threaded", FOUR_STEPS, "threaded")
    try:
        assert run.wait(100) == 0, run.log()[-3000:]
    finally:
        end(run)
    return step_losses(run)


@pytest.mark.xdist_group("threaded-losses")  # one worker: the shared run is made once
@pytest.mark.timeout(300)
def test_the_sequential_pipeline_does_the_threaded_ones_work(launch, threaded_losses):
    sequential = launch(FOUR_STEPS + "pipeline: {mode: sequential}\n", run_id="sequential")
    assert sequential.wait(100) == 0, sequential.log()[-3000:]
    assert step_losses(sequential) == pytest.approx(threaded_losses, rel=1e-5)
    assert [e["phase"] for e in sequential.events("phase")][:2] == ["startup", "train"]


@pytest.mark.xdist_group("threaded-losses")  # one worker: the shared run is made once
@pytest.mark.timeout(300)
def test_two_target_threads_on_one_device_do_the_same_work(launch, threaded_losses):
    # two target threads (one per drafter) on one device share its model and tap
    two_targets = launch(FOUR_STEPS.replace("target: [cpu]", "target: [cpu, cpu]"), run_id="two-targets")
    assert two_targets.wait(100) == 0, two_targets.log()[-3000:]
    assert "target-1" in two_targets.events("step")[0]["queue_depths"]
    assert step_losses(two_targets) == pytest.approx(threaded_losses, rel=1e-5)


@pytest.mark.xdist_group("threaded-losses")  # one worker: the shared run is made once
@pytest.mark.timeout(600)  # compiling is the slow part, slower still on a loaded machine
@pytest.mark.slow(seconds=40, why="compile: default of a tiny drafter on CPU: one Inductor compile")
def test_compiled_drafters_do_the_same_work(launch, threaded_losses):
    # torch.compile (no CUDA graphs) in two drafter threads of the same architecture
    compiled = launch(FOUR_STEPS + "compile: default\n", run_id="compiled")
    assert compiled.wait(450) == 0, compiled.log()[-3000:]
    assert [e["compile"] for e in compiled.events("ready")] == ["default", "default"]
    assert step_losses(compiled) == pytest.approx(threaded_losses, rel=1e-3)


def varied_text(path: Path, rows: int, seed: int) -> Path:
    """Text rows of the tiny target's words, 6 to 120 tokens long: packed to a token budget of
    max_length they make micro-batches of 1 to 8 rows and of several lengths and block counts."""
    generator = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            words = generator.choice([6, 10, 14, 20, 28, 40, 60, 90, 120])
            f.write(json.dumps({"text": " ".join(f"w{generator.randrange(200)}" for _ in range(words))}) + "\n")
    return path


@pytest.mark.timeout(900)
@pytest.mark.slow(seconds=90, why="compile: default of a tiny drafter on CPU: a compile per shape class")
def test_compile_default_in_four_drafter_threads_compiles_nothing_once_they_are_ready(launch, tmp_path):
    data = varied_text(tmp_path / "varied.jsonl", 96, seed=0)
    run = launch(f"""
target: {{tiny: {{}}}}
data: {{train: {data}, max_length: 128, token_budget: 128, pad_multiple: 16}}
drafter: {{num_layers: 1, block_size: 4, num_anchors: 16, num_target_features: 2}}
devices: {{target: [cpu], drafters: [cpu, cpu, cpu, cpu]}}
runtime: {{heartbeat_s: 0.5, torch_threads: 1}}
optim: {{max_steps: 8}}
eval: {{num_prompts: 0}}
compile: default
""", env={"TORCH_LOGS": "recompiles"})
    assert run.wait(850) == 0, run.log()[-3000:]
    lines = run.log().splitlines()
    ready = [i for i, line in enumerate(lines) if re.search(r"drafter \d ready on cpu", line)]
    compiles = [i for i, line in enumerate(lines) if "Recompiling function" in line]
    assert len(ready) == 4
    # graphs traced (Recompiling: the shape classes after the first) or loaded precompiled, all during the build
    assert not compiles or max(compiles) < min(ready), "\n".join(lines[i] for i in compiles)
    loaded, compiled = (int(n or 0) for n in re.search(
        r"drafter 0: train step built \(default, dynamic shapes\) in [\d.]+ s, (?:(\d+) graph\(s\) loaded "
        r"precompiled, )?(\d+) graph\(s\) compiled", run.log()).groups())
    assert loaded + compiled > 1  # rows of 1 are a graph of their own
    assert all("0 graph(s) compiled" in line for line in lines if re.search(r"drafter [1-3]: train step built", line))
    shapes = int(re.search(r"(\d+) micro-batch shape\(s\) to train on", run.log()).group(1))
    trained = {(e["micro_batches"], e["samples"]) for e in run.events("step")}
    assert shapes > 4 and len(trained) > 1  # mixed rows and lengths, not one shape
    assert all("other shape(s) of the data run them" in line for line in lines if "train step built" in line)


# Decoder-only families transformers ships with hidden states, and what each needs beyond
# the common tiny shape (MoE: a few small experts).
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {}, "phi3": {}, "gemma2": {}, "gemma3_text": {"sliding_window": 16},
            "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
            "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                          "shared_expert_intermediate_size": 64},
            "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2}}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> tuple:
    """The tiny target's tokenizer, training conversations and prompts (made once)."""
    from dflash_train.config import SyntheticDataSpec, TinyTargetSpec
    from dflash_train.data.tiny import _build_tokenizer, ensure_tiny_assets

    assets = ensure_tiny_assets(TinyTargetSpec(), SyntheticDataSpec(num_train=64, num_eval=2),
                                tmp_path_factory.mktemp("tiny-data"))
    return _build_tokenizer(TinyTargetSpec()), assets


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.slow(seconds=3, why="a trainer run on CPU per family")
def test_a_target_of_each_family_trains_evaluates_and_exports(launch, tiny_data, tmp_path, family):
    # A random target of the family saved with save_pretrained, loaded by the trainer from its
    # folder: the drafter takes its shape, RoPE and features; evaluation picks its decode path.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer, assets = tiny_data
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False, **FAMILIES[family])
    torch.manual_seed(0)
    folder = tmp_path / "target"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run = launch(f"""
target: {{path: {folder}}}
data: {{train: {assets.train_path}, eval: {assets.eval_path}, max_length: 128, token_budget: 512, pad_multiple: 16}}
drafter: {{num_layers: 1, block_size: 4, num_anchors: 8, num_target_features: 2}}
devices: {{target: [cpu], drafters: [cpu, cpu]}}
runtime: {{heartbeat_s: 0.5, torch_threads: 1}}
optim: {{max_steps: 4}}
eval: {{num_prompts: 2, max_new_tokens: 8, at_start: false}}
""", run_id=family)
    assert run.wait(180) == 0, run.log()[-3000:]
    assert [e["step"] for e in run.events("step")][-1] == 4
    (final,) = run.events("eval")
    assert final["step"] == 4 and final["verify_steps"] > 0
    exported = json.loads((run.run_dir / "export" / "config.json").read_text())
    assert exported["num_target_layers"] == 6 and exported["hidden_size"] == 64


@pytest.mark.timeout(60)
def test_a_bad_config_is_a_recorded_failure(launch):
    run = launch(SMALL + "optim: {lr: -1}\n")
    assert run.wait(50) == 1
    (error,) = run.errors()
    assert error["exc_type"] == "SchemaError" and "optim" in error["message"] and "config.yaml" in error["message"]
    assert run.events("done")[-1]["exit_code"] == 1


@pytest.mark.timeout(60)
def test_runs_of_tests_with_their_own_logs_folders_are_forked_from_one_server(launch, tmp_path, monkeypatch):
    # Every test has its own DFLASH_LOGS (conftest): were it part of a trainer's
    # environment, each test's runs would start a new interpreter, seconds of imports each.
    first = launch(SMALL + "optim: {lr: -1}\n", run_id="first")
    monkeypatch.setenv("DFLASH_LOGS", str(tmp_path / "another test's logs"))
    second = launch(SMALL + "optim: {lr: -1}\n", run_id="second")
    assert (first.wait(50), second.wait(50)) == (1, 1)
    assert isinstance(first.proc, ForkedRun) and isinstance(second.proc, ForkedRun)
    assert first.proc.server is second.proc.server


def non_finite_tensors(checkpoint: Path) -> list[str]:
    """Names of the tensors in a checkpoint folder (weights and optimizer state) holding NaN or inf."""
    import torch
    from safetensors.torch import load_file

    found = [f"model.safetensors:{name}" for name, t in load_file(str(checkpoint / "model.safetensors")).items()
             if not t.isfinite().all()]
    extra = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    for index, moments in extra["optimizer"]["state"].items():
        found += [f"optimizer.pt:{index}.{key}" for key, t in moments.items()
                  if t.is_floating_point() and not t.isfinite().all()]
    return found


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, accumulate", [("threaded", 1), ("sequential", 1), ("threaded", 2)])
@pytest.mark.slow(seconds=1, why="a trainer run on CPU per case")
def test_nonfinite_fault_fails_the_run_at_that_step_and_writes_nothing_non_finite(launch, mode, accumulate):
    run = launch(SMALL + f"pipeline: {{mode: {mode}}}\noptim: {{max_steps: 6, accumulate: {accumulate}}}\n"
                 "checkpoint: {every: 2}\neval: {num_prompts: 0}\n"
                 "faults: [{thread: drafter-1, at: 'step:3', kind: nonfinite}]\n", run_id=mode)
    assert run.wait(180) == 1, run.log()[-3000:]
    assert "injecting fault: nonfinite in drafter-1 at step 3" in run.log()
    errors = run.errors()
    root = errors[0]
    # threaded: drafter-1 records it, drafter-0 (which saw the same values) stops without a record;
    # sequential: one thread does every part, the coordinator
    expected = ["drafter-1", "coordinator"] if mode == "threaded" else ["coordinator"]
    assert [e["thread"] for e in errors] == expected
    assert (root["phase"], root["step"], root["exc_type"]) == ("train", 3, "NonFiniteStep")
    detail = root["detail"]
    assert (detail["quantity"], detail["value"], detail["replica"]) == ("loss", "nan", 1)
    assert isinstance(detail["losses"][0], float) and detail["losses"][1] == "nan"
    assert detail["grad_norm"] == "nan" and 0 < len(detail["nonfinite_grads"]) <= detail["nonfinite_grad_count"]
    assert root["message"].startswith("step 3: the loss of drafter-1 is nan")
    assert f"non-finite gradients first in {', '.join(detail['nonfinite_grads'])}" in root["message"]
    assert errors[-1]["detail"] == detail  # the coordinator's record points at the same root cause
    # every replica stopped at step 3 without applying it: steps 1 and 2 reported, nothing after
    assert [e["step"] for e in run.events("step")] == [1, 2]
    done = run.events("done")[-1]
    assert done["exit_code"] == 1 and done["threads_alive"] == []
    assert not (run.run_dir / "export").exists()
    assert os.readlink(run.run_dir / "checkpoints" / "latest") == "step_000002"
    assert non_finite_tensors(run.run_dir / "checkpoints" / "step_000002") == []


@pytest.mark.timeout(200)
@pytest.mark.slow(seconds=1, why="a trainer run on CPU")
def test_a_huge_learning_rate_fails_the_run_instead_of_exporting_nan(launch):
    # Finite, so the loader takes it; the first update throws the weights far enough for a NaN loss.
    run = launch(SMALL + "optim: {lr: 1.0e+30, max_steps: 16}\ncheckpoint: {every: 1}\neval: {num_prompts: 0}\n")
    assert run.wait(180) == 1, run.log()[-3000:]
    root = run.errors()[0]
    assert root["exc_type"] == "NonFiniteStep" and root["detail"]["value"] in ("nan", "inf", "-inf")
    assert all(isinstance(e["loss"], float) and math.isfinite(e["loss"]) for e in run.events("step"))
    assert run.events("done")[-1]["exit_code"] == 1
    assert not (run.run_dir / "export").exists()
    checkpoints = sorted((run.run_dir / "checkpoints").glob("step_*"))
    assert checkpoints and all(non_finite_tensors(c) == [] for c in checkpoints)


# --- optim.accumulate: micro-batches per optimizer step ---------------------------------

ACCUMULATE = SMALL + "optim: {max_steps: 4, accumulate: 2}\ncheckpoint: {every: 2, keep: 3}\neval: {num_prompts: 0}\n"


def weights_sha256(checkpoint: Path) -> str:
    """The model.safetensors line of the checkpoint's SHA256SUMS."""
    sums = dict(reversed(line.split("  ")) for line in (checkpoint / "SHA256SUMS").read_text().splitlines())
    return sums["model.safetensors"]


def by_hand(run_dir: Path, workspace: Path, steps: int, monkeypatch) -> dict:
    """The drafter after `steps` steps of the run's config computed here, step by step:
    each of the step's micro-batches (2 replicas x 2) on zero gradients, the mean of each
    replica's two, the mean of the replicas', then clipping and AdamW as the trainer does."""
    from dflash_train.config import load_job_config
    from dflash_train.runlog import ErrorLog, EventLog, ThreadNames
    from dflash_train.jobs.startup import prepare
    from dflash_train.threads import StopLatch

    import torch

    monkeypatch.setenv("DFLASH_WORKSPACE", str(workspace))
    config = load_job_config(run_dir / "config.yaml")
    here = run_dir.parent / "by-hand"
    here.mkdir()
    threads = torch.get_num_threads()
    try:
        session = prepare(config, here, EventLog(here / "events.jsonl"),
                          StopLatch(ErrorLog(here / "errors.jsonl"), ThreadNames(here / "threads.json")))
        run, replica = session.run, session.make_replica(0)
        params = list(replica.drafter.parameters())
        for step in range(1, steps + 1):
            replica_means = []
            for index in range(2):
                micro = []
                for m in range(2):
                    inputs = run.features(0, run.host_batch(step, index, m)).to_inputs("cpu")
                    replica.drafter.zero_grad(set_to_none=True)
                    replica.objective(inputs)[0].backward()
                    micro.append([p.grad for p in params])
                replica_means.append([(a + b) / 2 for a, b in zip(*micro)])
            mean = [(a + b) / 2 for a, b in zip(*replica_means)]
            for param, grad in zip(params, mean):
                param.grad = grad
            torch.nn.utils.clip_grads_with_norm_(params, config.optim.grad_clip, torch.nn.utils.get_total_norm(mean))
            replica.optimizer.step()
            replica.scheduler.step()
        return {name: t.detach().clone() for name, t in replica.drafter.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(400)
@pytest.mark.slow(seconds=6, why="three trainer runs on CPU")
def test_accumulated_steps_are_the_micro_batches_by_hand_resume_mid_step_count_and_refuse_another_accumulate(
        launch, workspace, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    full = launch(ACCUMULATE, run_id="full")
    assert full.wait(200) == 0, full.log()[-3000:]
    steps = full.events("step")
    assert [e["step"] for e in steps] == [1, 2, 3, 4] and steps[-1]["total_steps"] == 4
    # a step event counts the step's 2 replicas x 2 micro-batches
    assert all(e["micro_batches"] == 4 and e["samples"] > 4 for e in steps)
    assert json.loads((full.run_dir / "checkpoints" / "step_000002" / "state.json").read_text())["accumulate"] == 2

    expected = by_hand(full.run_dir, workspace, 2, monkeypatch)
    written = load_file(str(full.run_dir / "checkpoints" / "step_000002" / "model.safetensors"))
    assert sorted(written) == sorted(expected)
    assert [name for name in expected if not torch.equal(written[name], expected[name])] == []

    # stopped while hung before step 4 (its newest checkpoint is step 2: the hung lead
    # writes none on stop, and the exit waits for step 2's write), then a resume: the same
    # step 4, to the bit. A hang and a stop rather than a crash: a crash could come before
    # the background write of step 2 is complete.
    crashed = launch(ACCUMULATE + "faults: [{thread: drafter-0, at: 'step:4', kind: hang}]\n", run_id="crashed")
    crashed.wait_for("the hang", lambda: "injecting fault: hang" in crashed.log(), 150)
    crashed.proc.send_signal(signal.SIGTERM)
    assert crashed.wait(100) == 143
    assert [e["step"] for e in crashed.events("step")] == [1, 2, 3]
    assert os.readlink(crashed.run_dir / "checkpoints" / "latest") == "step_000002"
    resume = ACCUMULATE.replace("keep: 3}", "keep: 3, resume: latest}")
    resumed = launch(resume, crashed.run_dir)
    assert resumed.wait(200) == 0, resumed.log()[-3000:]
    assert [e["step"] for e in resumed.events("step")][-2:] == [3, 4]
    assert weights_sha256(crashed.run_dir / "checkpoints" / "step_000004") == weights_sha256(
        full.run_dir / "checkpoints" / "step_000004")

    # another accumulate would make other steps of the same data: refused, naming both
    refused = launch(resume.replace("accumulate: 2", "accumulate: 3"), crashed.run_dir)
    assert refused.wait(200) == 1
    message = refused.errors()[-1]["message"]
    assert "optim.accumulate 2" in message and "optim.accumulate 3" in message, message


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs CUDA")
@pytest.mark.timeout(1500)
def test_the_graphed_optimizer_accumulates_keeps_replicas_identical_and_its_checkpoints_load_both_ways(launch):
    # pad_multiple 64 in both: two graphed buckets, and the same packing (data cursor) on the CPU
    cpu = ACCUMULATE.replace("pad_multiple: 16", "pad_multiple: 64")
    gpu = (cpu.replace("devices: {target: [cpu], drafters: [cpu, cpu]}",
                       "devices: {target: [cuda:0], drafters: [cuda:0, cuda:0]}")
           .replace("num_target_features: 2}", "num_target_features: 2, attention: sdpa}") + "compile: cudagraphs\n")
    graphed = launch(gpu, run_id="graphed")
    assert graphed.wait(600) == 0, graphed.log()[-3000:]
    assert [e["step"] for e in graphed.events("step")] == [1, 2, 3, 4]
    assert all(math.isfinite(e["loss"]) and e["micro_batches"] == 4 for e in graphed.events("step"))
    (replicas,) = graphed.events("replicas")  # the run fails unless both replicas hold the same bits
    assert len(replicas["sha256"]) == 2 and len(set(replicas["sha256"])) == 1
    # the captured optimizer's checkpoint (step counts on the device) goes on on the CPU, eager
    resume = f"keep: 3, resume: {graphed.run_dir / 'checkpoints' / 'step_000004'}}}"
    eager = launch(cpu.replace("max_steps: 4", "max_steps: 6").replace("keep: 3}", resume), run_id="eager")
    assert eager.wait(300) == 0, eager.log()[-3000:]
    assert [e["step"] for e in eager.events("step")] == [5, 6]
    # and the eager one's goes on under the captured optimizer
    resume = f"keep: 3, resume: {eager.run_dir / 'checkpoints' / 'step_000006'}}}"
    back = launch(gpu.replace("max_steps: 4", "max_steps: 8").replace("keep: 3}", resume), run_id="back")
    assert back.wait(600) == 0, back.log()[-3000:]
    assert [e["step"] for e in back.events("step")] == [7, 8]
    assert all(math.isfinite(e["loss"]) for e in back.events("step"))
