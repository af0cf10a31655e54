"""job: regenerate: the config it takes, the answers it writes, and resuming them after a stop.

The runs are real `python -m dflash_train` subprocesses on the tiny CPU target (launched as
in test_trainer_runs.py); their answers are compared with `generate` called here on the
same target, built the way the trainer builds it. The batched decode's CUDA graphs are
checked on the CPU as far as its bookkeeping goes (support/graphs.py); that a replayed
step is the eager one, only the `cuda:0` case of the greedy answers proves."""
from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import pytest
import torch

import dflash_contract.events
import dflash_schema
from dflash_cli.commands.launch import host_paths
from dflash_train.config import load_job_config
from test_trainer_runs import launch  # noqa: F401 - `launch` is a fixture

REPO = Path(__file__).resolve().parents[1]
TINY_PROMPTS = REPO / "configs" / "data" / "tiny-prompts.jsonl"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def regen_config(prompts: Path, output: Path, batch_size: int, extra: str = "", device: str = "cpu") -> str:
    return (f"job: regenerate\ntarget: {{tiny: {{}}, dtype: float32}}\ndevices: {{target: [{device}]}}\n"
            f"regenerate: {{prompts: {json.dumps(str(prompts))}, output: {json.dumps(str(output))}, "
            f"max_new_tokens: 40, batch_size: {batch_size}}}\n"
            f"runtime: {{heartbeat_s: 0.5, torch_threads: 1}}\n{extra}")


# ---- the config -----------------------------------------------------------------------------

def test_regenerate_config_loads_and_names_its_threads_and_host_paths(tmp_path):
    config = load_job_config(write_config(tmp_path, """
        job: regenerate
        target: {path: Qwen/Qwen3-8B}
        regenerate:
          prompts: /data/prompts.jsonl
          output: ~/out/answers.jsonl
          enable_thinking: false
          sampling: {temperature: 0.6, top_p: 0.95, top_k: 20, seed: 3}
        devices: {target: [cuda:0, cuda:1]}
        """))
    assert config.job == "regenerate" and config.data is None
    assert config.regenerate.sampling.top_k == 20 and config.regenerate.enable_thinking is False
    assert config.thread_names() == ("coordinator", "target-0", "target-1")
    assert config.resources() == ("gpu0", "gpu1")  # the drafters default to the target devices
    assert host_paths(config) == [("model", "target.path", "Qwen/Qwen3-8B"),
                                  ("file", "regenerate.prompts", "/data/prompts.jsonl")]


@pytest.mark.parametrize("text, problem", [
    ("job: regenerate\ntarget: {tiny: {}}\n", "regenerate: missing required key for job: regenerate"),
    ("target: {tiny: {}}\n", "data: missing required key for job: train"),
    ("job: serve\ntarget: {tiny: {}}\n", "job: expected one of 'train' | 'regenerate' | 'evaluate', got 'serve'"),
    ("target: {tiny: {}}\ndata: {synthetic: {}}\nregenerate: {prompts: p, output: /o}\n",
     "job: train does not read regenerate"),
    ("job: regenerate\ntarget: {tiny: {}}\nregenerate: {prompts: p, output: /o}\noptim: {lr: 0.1}\n"
     "drafter: {num_layers: 2}\n", "job: regenerate does not read drafter, optim: remove them"),
    ("job: regenerate\ntarget: {tiny: {}}\nregenerate: {prompts: p, output: /o}\n"
     "devices: {target: [cpu], drafters: [cpu, cpu]}\n", "job: regenerate does not read devices.drafters"),
    ("job: regenerate\ntarget: {tiny: {}}\nregenerate: {prompts: p, output: ../out.jsonl}\n",
     "regenerate: output must be a file path inside the workspace (relative), absolute or ~/..., got '../out.jsonl'"),
    ("job: regenerate\ntarget: {tiny: {}}\nregenerate: {prompts: p, output: /o, sampling: {temperature: 0}}\n",
     "regenerate.sampling: temperature must be positive"),
    ("job: regenerate\ntarget: {tiny: {}}\nregenerate: {prompts: p, output: /o}\n"
     "devices: {target: [cuda, 'cuda:0']}\n", "devices.target: job: regenerate runs one model per device"),
    ("job: regenerate\ntarget: {tiny: {}}\nregenerate: {prompts: p, output: /o}\n"
     "faults: [{thread: drafter-0, at: startup, kind: raise}]\n",
     "unknown thread 'drafter-0' (threads of this config: coordinator, target-0)"),
])
def test_config_refuses_what_the_job_does_not_read_or_lacks(tmp_path, text, problem):
    path = write_config(tmp_path, text)
    with pytest.raises(dflash_schema.SchemaError) as caught:
        load_job_config(path)
    assert problem in str(caught.value) and str(path) in str(caught.value)


def test_example_config_answers_the_committed_synthetic_prompts(workspace):
    """configs/data/tiny-prompts.jsonl holds the user turns of the synthetic data the tiny path
    builds for the regeneration job's target, so regen-tiny-cpu.yaml works as shipped."""
    from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets

    config = load_job_config(REPO / "configs" / "train" / "regen-tiny-cpu.yaml")
    assert (REPO / config.regenerate.prompts) == TINY_PROMPTS and config.job == "regenerate"
    assets = ensure_tiny_assets(config.target.tiny, TARGET_DATA, workspace / "cache")
    synthetic = [json.loads(line)["messages"][:1] for line in assets.train_path.read_text().splitlines()]
    assert [json.loads(line)["messages"] for line in TINY_PROMPTS.read_text().splitlines()] == synthetic


def test_a_relative_output_is_the_workspaces(monkeypatch, tmp_path):
    """regen-tiny-cpu.yaml's output is relative: it lands in the host's workspace (where a
    relaunch finds it), not in the read-only release nor the user's home."""
    from dflash_train.config import workspace_path

    config = load_job_config(REPO / "configs" / "train" / "regen-tiny-cpu.yaml")
    monkeypatch.setenv("DFLASH_WORKSPACE", str(tmp_path / "ws"))
    assert workspace_path(config.regenerate.output) == tmp_path / "ws" / "data" / "tiny-regenerated.jsonl"
    assert workspace_path("/abs/out.jsonl") == Path("/abs/out.jsonl")
    assert workspace_path("~/out.jsonl") == Path.home() / "out.jsonl"


# ---- reading prompts and resuming output (no model) ---------------------------------------

def test_prompts_file_forms_and_bad_lines(tmp_path):
    from dflash_train.jobs.regenerate import RegenerateError, read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "w1 w2"}\n\n{"messages": [{"role": "user", "content": "w3"}, '
                    '{"role": "assistant", "content": "old"}]}\n')
    first, second = read_prompts(path)
    assert (first.index, first.line, first.messages) == (0, 1, ({"role": "user", "content": "w1 w2"},))
    assert (second.index, second.line, second.messages) == (1, 3, ({"role": "user", "content": "w3"},))
    path.write_text('{"text": "w1"}\n{"prompt": "w2"}\n')
    with pytest.raises(RegenerateError, match=rf"{path}:2: expected a 'text' string or a 'messages' list"):
        read_prompts(path)


def test_resume_drops_a_partial_last_line_and_refuses_a_foreign_output(tmp_path):
    from dflash_train.jobs.regenerate import Answer, RegenerateError, answered_indices, read_prompts

    prompts_path = tmp_path / "prompts.jsonl"
    prompts_path.write_text("".join(json.dumps({"text": f"w{i}"}) + "\n" for i in range(5)))
    prompts = read_prompts(prompts_path)
    output = tmp_path / "out.jsonl"
    whole = Answer(prompts[0], "w9", False, 2).line() + Answer(prompts[2], "w8", True, 40).line()
    output.write_text(whole + Answer(prompts[1], "w7", False, 2).line()[:25])  # killed mid-write
    assert answered_indices(output, prompts) == {0, 2}
    assert output.read_text() == whole
    output.write_text(Answer(prompts[3], "w1", False, 2).line().replace('"w3"', '"w4"'))
    with pytest.raises(RegenerateError, match=r"out.jsonl:1: answers prompt 3, but its turns differ from line 4"):
        answered_indices(output, prompts)


# ---- real runs on the tiny target ---------------------------------------------------------

def output_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def greedy_reference(workspace: Path, prompts: list[list[dict]], device: str) -> list[list[int]]:
    """The tiny target's greedy tokens for each prompt from `generate` called here: prompts of
    one token length share a call (no padding), so the reference owes nothing to left padding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.config import TinyTargetSpec
    from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets

    target = ensure_tiny_assets(TinyTargetSpec(), TARGET_DATA, workspace / "cache").target_dir
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval().to(device)
    encoded = [tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for messages in prompts]
    answers: list[list[int]] = [[] for _ in prompts]
    for length in {len(ids) for ids in encoded}:
        rows = [i for i, ids in enumerate(encoded) if len(ids) == length]
        ids = torch.tensor([encoded[i] for i in rows], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        for row, tokens in zip(rows, out[:, length:].tolist()):
            answers[row] = tokens
    return answers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.slow(seconds=8, why="a regeneration job on the tiny target")
def test_regeneration_reproduces_the_tiny_targets_greedy_answers(launch, workspace, tmp_path, device):
    synthetic = [json.loads(line) for line in TINY_PROMPTS.read_text().splitlines()]
    # 7 rows for 66 prompts: answers end at varied lengths, so rows are refilled mid-flight;
    # a "text" line is a user turn; a final assistant turn is answered anew.
    extra = [{"text": "w5 w6"}, {"messages": [{"role": "user", "content": "w7"},
                                              {"role": "assistant", "content": "w8 w9"}]}]
    rows = synthetic[:30] + extra + synthetic[30:]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "data" / "answers.jsonl"
    run = launch(regen_config(prompts, output, batch_size=7, device=device))
    assert run.wait(400) == 0, run.log()[-3000:]

    from transformers import AutoTokenizer

    from dflash_train.config import TinyTargetSpec
    from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets

    assets = ensure_tiny_assets(TinyTargetSpec(), TARGET_DATA, workspace / "cache")
    tokenizer = AutoTokenizer.from_pretrained(str(assets.target_dir))
    turns = [[{"role": "user", "content": r["text"]}] if "text" in r else r["messages"][:1] for r in rows]
    reference = greedy_reference(workspace, turns, device)
    answers = output_rows(output)
    assert [a["index"] for a in answers] == list(range(len(rows)))
    for answer, messages, tokens in zip(answers, turns, reference):
        assert answer["messages"][:-1] == messages
        assert answer["messages"][-1]["role"] == "assistant"
        ended = tokenizer.eos_token_id in tokens
        expected = tokens[:tokens.index(tokenizer.eos_token_id)] if ended else tokens
        got = tokenizer(answer["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        assert got == expected, answer["index"]
        assert answer["truncated"] is (not ended)
    assert {a["truncated"] for a in answers} == {True, False}  # both kinds of ending occur
    # The synthetic data's responses are the same greedy answers, made by the tiny build itself.
    built = [json.loads(line)["messages"][1]["content"] for line in assets.train_path.read_text().splitlines()]
    assert [a["messages"][-1]["content"] for a in answers[:30] + answers[32:]] == built
    # progress: events as answers are written (at most one a second, and the last), log lines watch shows
    progress = run.events("progress")
    answered = [p["answered"] for p in progress]
    assert answered == sorted(set(answered)) and answered[-1] == len(rows)
    last = progress[-1]
    assert last["total"] == len(rows) and last["eta_s"] == 0 and last["tokens_per_s"] > 0
    assert last["truncated"] == sum(a["truncated"] for a in answers)
    assert f"answered {len(rows)}/{len(rows)} prompts" in run.log()
    assert [e["phase"] for e in run.events("phase")] == ["startup", "regenerate", "shutdown"]
    for event in run.events():
        dflash_contract.events.check(event)
    assert (run.run_dir / "errors.jsonl").read_text() == ""
    # the output is a training file: the trainer's own reader takes every line
    from dflash_train.data.batches import load_samples

    assert len(load_samples(output, tokenizer, 128, run.run_dir / "cache")) == len(rows)


@pytest.mark.timeout(600)
@pytest.mark.slow(seconds=10, why="regeneration jobs stopped, failed and resumed, and one run whole")
def test_stopped_and_failed_jobs_resume_to_the_one_shot_output(launch, tmp_path):
    rows = [json.loads(line) for line in TINY_PROMPTS.read_text().splitlines()][:24]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_shot, resumed = tmp_path / "one-shot.jsonl", tmp_path / "resumed.jsonl"

    # 1. SIGTERM once answers are being written: no prompt is started, those being decoded are
    #    finished and written, so the output is every prompt up to some index.
    first = launch(regen_config(prompts, resumed, batch_size=2), run_id="stopped")
    first.wait_for("a written answer", lambda: resumed.exists() and resumed.read_text().count("\n") >= 2, 200)
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.wait(120) == 128 + signal.SIGTERM, first.log()[-3000:]
    stopped_at = output_rows(resumed)
    assert 2 <= len(stopped_at) < len(rows)
    assert [a["index"] for a in stopped_at] == list(range(len(stopped_at)))
    assert "received SIGTERM: stopping after the answers being decoded" in first.log()
    assert first.events("done")[-1]["exit_code"] == 143 and first.errors() == []

    # 2. A kill in the middle of a write leaves part of a line: the next launch drops it.
    partial = json.dumps({"index": len(stopped_at), "messages": [{"role": "user"}]})[:30]
    with open(resumed, "a") as f:
        f.write(partial)

    # 3. A worker fails at its 2nd decode step: recorded, exit 1, the output keeps whole answers only.
    failing = launch(regen_config(prompts, resumed, batch_size=2,
                                  extra="faults: [{thread: target-0, at: 'step:2', kind: raise}]\n"), run_id="failing")
    assert failing.wait(200) == 1, failing.log()[-3000:]
    root = failing.errors()[0]
    assert root["thread"] == "target-0" and root["phase"] == "regenerate" and root["step"] == 2
    assert root["exc_type"] == "InjectedFault"
    assert "dropping a partial last line (30 bytes)" in failing.log()
    after_failure = output_rows(resumed)
    assert len(stopped_at) <= len(after_failure) < len(rows)
    assert [a["index"] for a in after_failure] == list(range(len(after_failure)))

    # 4. The last launch answers the rest; the result equals an uninterrupted job's, byte for byte.
    last = launch(regen_config(prompts, resumed, batch_size=2), run_id="last")
    assert last.wait(200) == 0, last.log()[-3000:]
    assert f"{len(after_failure)} already answered" in last.log()
    whole = launch(regen_config(prompts, one_shot, batch_size=2), run_id="one-shot")
    assert whole.wait(200) == 0, whole.log()[-3000:]
    assert [a["index"] for a in output_rows(resumed)] == list(range(len(rows)))
    assert resumed.read_bytes() == one_shot.read_bytes()

    # 5. Nothing left: a launch answers nothing and succeeds.
    again = launch(regen_config(prompts, resumed, batch_size=2), run_id="again")
    assert again.wait(200) == 0, again.log()[-3000:]
    assert resumed.read_bytes() == one_shot.read_bytes()
    assert f"{len(rows)} already answered" in again.log()


@pytest.mark.timeout(200)
@pytest.mark.slow(seconds=1, why="a regeneration job that fails on its prompts")
def test_a_bad_prompts_file_fails_the_job_naming_the_line(launch, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "w1"}\n{"prompt": "w2"}\n')
    run = launch(regen_config(prompts, tmp_path / "out.jsonl", batch_size=2))
    assert run.wait(150) == 1
    [record] = run.errors()
    assert record["thread"] == "coordinator" and record["exc_type"] == "RegenerateError"
    assert f"{prompts}:2: expected a 'text' string or a 'messages' list" in record["message"]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow(seconds=2, why="batched decodes of the tiny target")
def test_sampling_is_seeded_per_prompt_and_the_template_gets_enable_thinking(workspace, tmp_path):
    """In-process, on the tiny target: a prompt's sampled answer depends on the seed and its
    index only, not on how many rows decode at once nor on which prompts share its steps
    (what makes a resumed or re-batched sampled job draw what an unbroken one would);
    enable_thinking reaches the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.config import SamplingConfig, TinyTargetSpec
    from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets
    from dflash_train.jobs.regenerate import end_ids, read_prompts, render
    from dflash_train.model.batched_decode import BatchedDecoder, Request

    target = ensure_tiny_assets(TinyTargetSpec(), TARGET_DATA, workspace / "cache").target_dir
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompts = read_prompts(TINY_PROMPTS)[:6]
    encoded = [tuple(tokenizer(render(tokenizer, p, None), add_special_tokens=False)["input_ids"]) for p in prompts]

    def answers(sampling: SamplingConfig | None, rows: int, which: list[int]) -> dict[int, list[int]]:
        decoder = BatchedDecoder(model, rows, max(map(len, encoded)) + 12, 12, end_ids(tokenizer, model), sampling)
        got: dict[int, list[int]] = {}
        decoder.run(iter([Request(i, encoded[i]) for i in which]),
                    lambda done: got.update((g.index, g.tokens) for g in done))
        return got

    hot = SamplingConfig(temperature=2.0, seed=7)
    everything = answers(hot, 4, list(range(6)))
    assert answers(hot, 1, [5, 2, 0]) == {i: everything[i] for i in (5, 2, 0)}  # resumed, re-batched
    assert everything != answers(SamplingConfig(2.0, seed=8), 4, list(range(6)))
    assert everything != answers(None, 4, list(range(6)))
    nucleus = SamplingConfig(temperature=0.8, top_p=0.5, top_k=5, seed=7)
    assert answers(nucleus, 3, list(range(6))) == answers(nucleus, 6, list(range(6)))

    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                               "{% if enable_thinking is defined and not enable_thinking %}w0 w0 {% endif %}")
    for thinking, rendered in ((None, "w1 "), (True, "w1 "), (False, "w1 w0 w0 ")):
        assert render(tokenizer, read_prompts(write_prompt(tmp_path, "w1"))[0], thinking) == rendered


@pytest.mark.slow(seconds=2, why="batched decodes of the tiny target")
def test_steps_captured_at_warm_up_leave_the_answers_unchanged(workspace, monkeypatch):
    """The batched decode's CUDA-graph bookkeeping, on the CPU (support/graphs.py): warm_up
    captures the step of every attention length, each run as a capture's warm-up runs it
    with no row live, and the decode after it captures nothing more and answers as a
    decoder without graphs does, greedy and sampled (the sampling noise counts each row's
    tokens, which a step of a free row must not move). That a replay is the eager step
    is the device's test (test_regeneration_reproduces_the_tiny_targets_greedy_answers on
    cuda)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_train.config import SamplingConfig, TinyTargetSpec
    from dflash_train.data.tiny import TARGET_DATA, ensure_tiny_assets
    from dflash_train.jobs.regenerate import end_ids, read_prompts, render
    from dflash_train.model import batched_decode
    from dflash_train.model.batched_decode import BatchedDecoder, Request

    from support.graphs import run_as_captured

    target = ensure_tiny_assets(TinyTargetSpec(), TARGET_DATA, workspace / "cache").target_dir
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    encoded = [tuple(tokenizer(render(tokenizer, p, None), add_special_tokens=False)["input_ids"])
               for p in read_prompts(TINY_PROMPTS)[:6]]

    def answers(sampling: SamplingConfig | None, graphs: bool) -> dict[int, list[int]]:
        # 3 rows for 6 prompts: rows free up and take the next prompt mid-decode
        decoder = BatchedDecoder(model, 3, max(map(len, encoded)) + 24, 24, end_ids(tokenizer, model), sampling,
                                 length_step=16)
        captured.clear()
        if graphs:
            decoder.cuda_graphs = True
            decoder.warm_up()
            assert len(captured) == len(decoder.lengths()) > 1
        got: dict[int, list[int]] = {}
        decoder.run(iter(Request(i, tokens) for i, tokens in enumerate(encoded)),
                    lambda done: got.update((g.index, g.tokens) for g in done))
        assert len(captured) == (len(decoder.lengths()) if graphs else 0)  # none after the warm-up
        return got

    captured = run_as_captured(monkeypatch, batched_decode)
    for sampling in (None, SamplingConfig(temperature=2.0, seed=7)):
        plain = answers(sampling, graphs=False)
        assert answers(sampling, graphs=True) == plain and len(plain) == 6


def write_prompt(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "one-prompt.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    return path


def test_launch_names_a_prompts_file_missing_on_the_host_before_anything_starts(make_inventory, fake_pve, tmp_path):
    from dflash_run import REPO, dflash
    from support import workspace_on_node
    from test_bad_input import nothing_started

    config = tmp_path / "regen.yaml"
    config.write_text("job: regenerate\ntarget: {tiny: {}}\n"
                      "regenerate: {prompts: data/prompts.jsonl, output: /tmp/answers.jsonl}\n")
    done = dflash("launch", "ct200", "--config", str(config), hosts=make_inventory(tmp_path))
    assert done.returncode == 2, done.stderr
    # Relative paths are the release's, this tree: checked here, before anything is deployed.
    assert not (workspace_on_node(fake_pve, tmp_path) / "releases").exists()
    assert (f"dflash: error: host ct200: regenerate.prompts: data/prompts.jsonl is not in the release: the deploy "
            f"sends what git would commit of remote/ and configs/ of {REPO}, which holds no such file or folder "
            "(nothing was deployed or started)") in " ".join(done.stderr.split())
    nothing_started(workspace_on_node(fake_pve, tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=10, why="the batched decoder's CPU check, a subprocess of its own")
def test_the_regeneration_bench_cpu_check_passes():
    """bench/regen_speed.py --cpu-check: the batched decoder's greedy answers equal each
    prompt's own `generate` with rows refilled mid-flight, and sampled answers do not
    depend on the number of rows; it exits non-zero otherwise."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "bench" / "regen_speed.py"), "--cpu-check"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO / "remote")}, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "17/17 answers equal generate's" in done.stdout
