"""The recipe end to end on the tiny CPU path, as a user runs it with the CLI on the
`local` host: the target answers the prompts (job: regenerate), a drafter trains on those
answers, the standalone evaluation measures its export, and `pull` brings it home."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from dflash_run import dflash
from support.train_configs import small_config

HOST = "local"


def launch_and_follow(hosts: Path, logs: Path, config: Path) -> str:
    done = dflash("--logs-dir", str(logs), "launch", HOST, "--config", str(config), "--follow", hosts=hosts,
                  timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_measured(evaluation: dict, prompts: int, max_new_tokens: int, block_size: int) -> None:
    """eval.json's figures are those of a decode that ran: every prompt decoded in verify
    steps that each gained 1 (the bonus alone) to block_size tokens, and the figures
    derived from the counts; the speed-up (evaluate.speedup, on by default) measured."""
    steps, gained, per_prompt = evaluation["verify_steps"], evaluation["new_tokens"], evaluation["per_prompt"]
    # a prompt answered by the prefill's end token alone has no verify step, hence no mean
    assert evaluation["prompts"] == prompts and 1 <= len(per_prompt) <= prompts
    # the prefill gives each prompt's first token, verify steps the rest (a last block may overshoot)
    assert len(per_prompt) <= steps <= gained <= min(steps * block_size, prompts * (max_new_tokens - 2 + block_size))
    assert evaluation["acceptance_length"] == round(gained / steps, 4)
    assert all(1.0 <= x <= block_size for x in per_prompt)
    assert evaluation["mean_per_prompt"] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-3)
    assert evaluation["tokens_per_s"] > 0 and evaluation["target_tokens_per_s"] > 0
    assert evaluation["speedup"] == pytest.approx(evaluation["tokens_per_s"] / evaluation["target_tokens_per_s"],
                                                  rel=0.01, abs=0.01)


@pytest.mark.timeout(900)
@pytest.mark.slow(seconds=57, why="the whole recipe on CPU: regenerate, train, evaluate, pull")
def test_prompts_to_a_regenerated_trained_evaluated_and_pulled_drafter(make_inventory, tmp_path):
    hosts, logs = make_inventory(tmp_path), tmp_path / "logs"
    workspace = Path(yaml.safe_load(hosts.read_text())["hosts"][HOST]["workspace"])
    answers = tmp_path / "data" / "answers.jsonl"

    # 1. regenerate: the tiny target answers the synthetic prompts, greedily
    regen = tmp_path / "regen.yaml"
    regen.write_text(yaml.safe_dump({
        "job": "regenerate", "target": {"tiny": {}}, "devices": {"target": ["cpu"]},
        "regenerate": {"prompts": "configs/data/tiny-prompts.jsonl", "output": str(answers),
                       "max_new_tokens": 24, "batch_size": 16}}))
    launch_and_follow(hosts, logs, regen)
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(64))
    assert all(row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["content"] for row in rows)

    # 2. train on the regenerated answers (the same tiny target feeds the drafter)
    train = small_config(tmp_path / "train.yaml", data={"train": str(answers)})
    config = yaml.safe_load(train.read_text())
    del config["data"]["synthetic"]
    train.write_text(yaml.safe_dump(config))
    run_id = launch_and_follow(hosts, logs, train)
    run_dir = workspace / "runs" / run_id
    steps = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in steps if e["type"] == "step"][-1] == config["optim"]["max_steps"]
    export = run_dir / "export"
    assert json.loads((export / "config.json").read_text())["auto_map"]

    # 3. evaluate the export on its own, as any drafter folder
    evaluate = tmp_path / "evaluate.yaml"
    evaluate.write_text(yaml.safe_dump({
        "job": "evaluate", "target": {"tiny": {}}, "devices": {"target": ["cpu"]},
        "data": {"synthetic": {"num_train": 64, "num_eval": 2}},
        "evaluate": {"drafter": str(export), "max_new_tokens": 16, "num_prompts": 2}}))
    evaluation = json.loads((workspace / "runs" / launch_and_follow(hosts, logs, evaluate) / "eval.json").read_text())
    assert_measured(evaluation, prompts=2, max_new_tokens=16,
                    block_size=json.loads((export / "config.json").read_text())["dflash_config"]["block_size"])

    # 4. pull the drafter home, every file verified
    pulled = dflash("--logs-dir", str(logs), "pull", run_id, "--host", HOST, hosts=hosts)
    assert pulled.returncode == 0, pulled.stderr
    home = logs / HOST / run_id / "export"
    assert {p.name: sha256(p) for p in home.iterdir()} == {p.name: sha256(p) for p in export.iterdir()}
