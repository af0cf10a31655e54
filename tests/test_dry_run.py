"""`dflash launch --dry-run` makes every check the launch makes before it starts anything,
in one round trip per host, and says each one's verdict: a dry run per refusal, each
against the real CLI and a real host (container 204 of the fake node, whose fake
nvidia-smi reports four H200s; ct200, which has no GPU), and the launch itself refusing
the same before anything is deployed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import container_workspace
from support.inventory import workspace_on_node
from test_fit_check import GpuHost
from test_bad_input import fabricate_run
from test_memory_plan import CONFIGS, write_model_folder

pytestmark = pytest.mark.timeout(300)
CHATS = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


class Hosts(GpuHost):
    """test_fit_check's host `gpu` (container 204, HF_HOME holding Qwen3-8B's config.json,
    its workspace `workspace`), and ct200 (no GPU), with training data and prompts in files
    both see."""

    def __init__(self, make_inventory, ssh_node, fake_pve, vmid: int, tmp_path: Path):
        super().__init__(make_inventory, ssh_node, fake_pve, vmid, tmp_path)
        self.chats.write_text(CHATS + "\n")  # a chat with the assistant's turn
        self.ct200_workspace = workspace_on_node(fake_pve, tmp_path)
        self.drafter = write_model_folder(tmp_path / "drafter", {"model_type": "qwen3"})

    def evaluate(self) -> list[str]:
        return ["--set", f"evaluate.drafter={self.drafter}", "--set", f"evaluate.prompts={self.chats}"]


@pytest.fixture
def hosts(make_inventory, ssh_node, fake_pve, gpu_container, tmp_path) -> Hosts:
    return Hosts(make_inventory, ssh_node, fake_pve, gpu_container, tmp_path)


def one_line(text: str) -> str:
    return " ".join(text.split())


def verdicts(stderr: str, host: str) -> dict[str, str]:
    """`HOST: CHECK: VERDICT` lines by check."""
    found = {}
    for line in stderr.splitlines():
        if line.startswith(f"{host}: ") and (": ok" in line or ": REFUSED: " in line):
            check, _, verdict = line[len(host) + 2:].partition(": REFUSED: " if ": REFUSED: " in line else ": ok")
            found[check] = verdict or "ok"
    return found


def test_a_dry_run_that_passes_says_each_checks_verdict(hosts):
    done = hosts.dflash("launch", "gpu", "--config", str(CONFIGS / "qwen3-8b.yaml"), "--dry-run", *hosts.data())
    assert done.returncode == 0, done.stderr
    said = verdicts(done.stderr, "gpu")
    assert said.pop("target.path Qwen/Qwen3-8B") == "ok"
    assert said.pop(f"data.train {hosts.chats}") == "ok"
    assert said.pop(f"data.eval {hosts.chats}") == "ok"
    assert said.pop("devices cuda:0") == "ok"
    (space,) = [check for check in said if check.startswith("free space in ")]
    (imports,) = [check for check in said if check.endswith(" imports torch, transformers")]
    assert said == {space: "ok", imports: "ok"}
    assert "gpu cuda:0: target-0, eval, drafter-0, drafter-1" in done.stderr  # the estimate's table
    assert not hosts.workspace.exists()


def test_evaluate_drafter_missing_is_refused_by_the_dry_run_and_the_launch(hosts, tmp_path):
    config = ["--config", str(CONFIGS / "evaluate-qwen3-8b.yaml"), "--set", f"evaluate.prompts={hosts.chats}",
              "--set", f"evaluate.drafter={tmp_path / 'no drafter'}"]
    dry = hosts.dflash("launch", "gpu", *config, "--dry-run")
    assert dry.returncode == 2, dry.stderr
    assert verdicts(dry.stderr, "gpu")[f"evaluate.drafter {tmp_path / 'no drafter'}"] == (
        f"evaluate.drafter: {tmp_path / 'no drafter'} does not exist (and '{tmp_path / 'no drafter'}' is not a "
        "Hugging Face hub id)")
    assert one_line(dry.stderr).endswith("(a dry run: nothing was deployed or started)")
    launched = hosts.dflash("launch", "gpu", *config)
    assert launched.returncode == 2, launched.stderr
    assert (f"gpu: evaluate.drafter: {tmp_path / 'no drafter'} does not exist" in one_line(launched.stderr))
    assert "(nothing was deployed or started)" in one_line(launched.stderr)
    assert not hosts.workspace.exists()


def test_evaluate_drafter_names_a_run_whose_export_the_cli_finds_on_the_host(hosts, fake_pve, tmp_path):
    assert hosts.dflash("deploy", "gpu").returncode == 0
    trained, unfinished = "tiny-cpu-20261204-150000-aaaa", "tiny-cpu-20261204-160000-bbbb"
    fabricate_run(hosts.workspace, trained, 0)
    fabricate_run(hosts.workspace, unfinished, 1)
    write_model_folder(hosts.workspace / "runs" / trained / "export", {"model_type": "qwen3"})
    on_host = container_workspace(fake_pve, tmp_path) / "runs" / trained / "export"  # as the container sees it
    status = hosts.dflash("status", trained, "--host", "gpu")
    assert f"export on gpu: {on_host} (evaluate.drafter: run:{trained}; " in one_line(status.stderr)
    assert json.loads(hosts.dflash("status", trained, "--host", "gpu", "--json").stdout)["export"] == str(on_host)

    config = ["--config", str(CONFIGS / "evaluate-qwen3-8b.yaml"), "--set", f"evaluate.prompts={hosts.chats}"]
    dry = hosts.dflash("launch", "gpu", *config, "--set", "evaluate.drafter=run:tiny-cpu-20261204-15", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"evaluate.drafter: the export of run {trained}, {on_host} on gpu" in dry.stderr
    assert verdicts(dry.stderr, "gpu")[f"evaluate.drafter {on_host}"] == "ok"
    refused = hosts.dflash("launch", "gpu", *config, "--set", f"evaluate.drafter=run:{unfinished}", "--dry-run")
    assert refused.returncode == 2
    assert (f"evaluate.drafter 'run:{unfinished}': run {unfinished} on gpu has no export yet (FAILED: a run "
            "exports when its training ends)") in one_line(refused.stderr)
    missed = hosts.dflash("launch", "gpu", *config, "--set", "evaluate.drafter=run:tiny-gpu", "--dry-run")
    assert missed.returncode == 2 and "evaluate.drafter 'run:tiny-gpu': no run 'tiny-gpu' on gpu" in missed.stderr


def test_training_data_missing_is_refused_by_the_dry_run(hosts):
    done = hosts.dflash("launch", "gpu", "--config", str(CONFIGS / "qwen3-8b.yaml"), "--dry-run")
    assert done.returncode == 2, done.stderr
    said = verdicts(done.stderr, "gpu")
    assert said["data.train /workspace/data/qwen3-8b-responses.jsonl"] == (
        "data.train: /workspace/data/qwen3-8b-responses.jsonl does not exist")
    assert said["target.path Qwen/Qwen3-8B"] == "ok"


def test_a_cuda_device_on_a_host_without_a_gpu_is_refused_before_anything_starts(hosts):
    args = ["--config", str(CONFIGS / "evaluate-qwen3-8b.yaml"), *hosts.evaluate(), "--set",
            f"target.path={hosts.drafter}"]
    dry = hosts.dflash("launch", "ct200", *args, "--dry-run")
    assert dry.returncode == 2, dry.stderr
    assert verdicts(dry.stderr, "ct200")["devices cuda:0"] == (
        "cuda:0 (target-0, drafter-0) is not there: the host has no GPU (nvidia-smi lists none)")
    launched = hosts.dflash("launch", "ct200", *args)
    assert launched.returncode == 2, launched.stderr
    assert ("ct200: cuda:0 (target-0, drafter-0) is not there: the host has no GPU (nvidia-smi lists none) "
            "(nothing was deployed or started)") in one_line(launched.stderr)
    assert not hosts.ct200_workspace.exists()
    assert hosts.dflash("launch", "gpu", *args, "--dry-run").returncode == 0  # the GPU host has it


def test_a_hub_id_the_hosts_cache_lacks_is_refused_naming_hf_home(hosts):
    done = hosts.dflash("launch", "gpu", "--config", str(CONFIGS / "qwen3-8b.yaml"), "--dry-run", *hosts.data(),
                        "--set", "target.path=Qwen/Qwen3-32B")
    assert done.returncode == 2, done.stderr
    assert verdicts(done.stderr, "gpu")["target.path Qwen/Qwen3-32B"] == (
        f"target.path: Qwen/Qwen3-32B is neither a folder on the host nor in its Hugging Face cache "
        f"{hosts.hf_home / 'hub'} (HF_HOME={hosts.hf_home}): download it there on the host (`hf download "
        "Qwen/Qwen3-32B`, with the host's HF_HOME), or name a model folder")


def test_a_target_folder_without_config_json_is_refused_by_the_dry_run(hosts, tmp_path):
    (tmp_path / "not a model").mkdir()
    done = hosts.dflash("launch", "gpu", "--config", str(CONFIGS / "qwen3-8b.yaml"), "--dry-run", *hosts.data(),
                        "--set", f"target.path={tmp_path / 'not a model'}")
    assert done.returncode == 2, done.stderr
    assert verdicts(done.stderr, "gpu")[f"target.path {tmp_path / 'not a model'}"] == (
        f"target.path: {tmp_path / 'not a model'} is not a Hugging Face model folder (no config.json)")


def test_a_relative_path_is_checked_in_the_tree_the_deploy_sends(hosts):
    base = ["launch", "gpu", "--config", str(CONFIGS / "qwen3-8b.yaml"), "--dry-run", "--set",
            f"data.train={hosts.chats}"]
    sent = hosts.dflash(*base, "--set", "data.eval=configs/data/tiny-prompts.jsonl")
    assert sent.returncode == 0, sent.stderr
    assert verdicts(sent.stderr, "gpu")["data.eval configs/data/tiny-prompts.jsonl (in this tree)"] == "ok"
    missing = hosts.dflash(*base, "--set", "data.eval=data/eval.jsonl")
    assert missing.returncode == 2, missing.stderr
    assert verdicts(missing.stderr, "gpu")["data.eval data/eval.jsonl"].startswith(
        "data.eval: data/eval.jsonl is not in the release: the deploy sends what git would commit of remote/ "
        "and configs/ of ")
