"""`dflash launch`'s fit check end to end: the real CLI against container 204 of the fake
node, whose PATH has a fake nvidia-smi reporting four H200s and whose Hugging Face cache
holds Qwen3-8B's config.json. A run that cannot fit is refused before anything reaches
the host; --dry-run prints the estimate and starts nothing; a run that fits starts; the
shipped one-GPU config of each target family fits an H200, its target's shape being what
bench/fit_h200.py builds at random weights. The estimate's own terms are tested in
test_memory_plan.py."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from dflash_agent import gpus
from dflash_run import dflash_in_process
from support import container_workspace
from support.inventory import HOST_ENV, container_host
from test_memory_plan import CONFIGS, H200_MIB, QWEN3_8B, one_gpu_config, write_model_folder

from dflash_train.config import load_job_config
from dflash_train.memory.plan import GIB, TargetShape, estimate, usable_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fit_h200  # noqa: E402
from gpu_trainer import TARGETS  # noqa: E402  the random-weight stand-ins bench/fit_h200.py builds

pytestmark = pytest.mark.timeout(300)
SNAPSHOT = "b968826d9c46dd6066d109eabc6255188de91218"  # a commit id, as the hub names snapshots


def cache_hub_model(hf_home: Path, repo_id: str, fields: dict) -> Path:
    """`repo_id`'s config.json in a Hugging Face cache, laid out as huggingface_hub does."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    write_model_folder(repo / "snapshots" / SNAPSHOT, fields)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return repo / "snapshots" / SNAPSHOT / "config.json"


class GpuHost:
    """Host `gpu` (container 204) in this test's inventory, its HF_HOME holding Qwen3-8B,
    and a file of chats it sees (`data()`: the configs' data paths set to it)."""

    def __init__(self, make_inventory, ssh_node, fake_pve, vmid: int, tmp_path: Path):
        self.chats = tmp_path / "chats.jsonl"
        self.chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        self.hf_home = tmp_path / "hf home"
        cache_hub_model(self.hf_home, "Qwen/Qwen3-8B", QWEN3_8B)
        entry = container_host(tmp_path, ssh_node, fake_pve, vmid)
        entry["env"] = {**HOST_ENV, "HF_HOME": str(self.hf_home)}
        self.hosts = make_inventory(tmp_path, gpu=entry)
        self.logs = tmp_path / "logs"
        self.workspace = fake_pve.on_node(vmid, container_workspace(fake_pve, tmp_path))  # as the node sees it

    def dflash(self, *args: str):
        return dflash_in_process("--logs-dir", str(self.logs), *args, hosts=self.hosts)

    def data(self) -> list[str]:
        """The shipped configs name the data where a GPU host would hold it; a launch checks it is there."""
        return ["--set", f"data.train={self.chats}", "--set", f"data.eval={self.chats}"]


@pytest.fixture
def gpu_host(make_inventory, ssh_node, fake_pve, gpu_container, tmp_path) -> GpuHost:
    return GpuHost(make_inventory, ssh_node, fake_pve, gpu_container, tmp_path)


def qwen3_8b_plan(config: Path):
    return estimate(load_job_config(config), TargetShape.from_config_json(QWEN3_8B))


def test_a_run_that_cannot_fit_is_refused_before_anything_reaches_the_host(gpu_host, tmp_path):
    config = one_gpu_config(tmp_path)
    done = gpu_host.dflash("launch", "gpu", "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (device,) = qwen3_8b_plan(config).devices
    largest = device.largest(1)[0]
    message = " ".join(done.stderr.split())  # as one line, whatever the terminal's width
    assert (f"gpu: cuda:0 (target-0, eval, drafter-0, drafter-1) needs an estimated {device.total / GIB:.1f} GiB, "
            f"more than the {usable_bytes(H200_MIB) / GIB:.1f} GiB usable of its NVIDIA H200 ({H200_MIB} MiB); "
            f"largest terms: {largest.name} x2 {largest.bytes / GIB:.1f} GiB, ") in message
    assert ("change data.token_budget (12288), data.block_token_budget (null), drafter.num_anchors (512); "
            "or put fewer drafters on cuda:0 (devices.drafters: 2 there) (nothing was deployed or started)") in message
    assert "--dry-run" in message
    assert not gpu_host.workspace.exists()  # no release, no run, not even the workspace


def test_dry_run_prints_every_device_against_its_gpu_and_starts_nothing(gpu_host, tmp_path):
    done = gpu_host.dflash("launch", "gpu", "--config", str(CONFIGS / "qwen3-8b-4gpu.yaml"), "--dry-run",
                           *gpu_host.data())
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    plan = qwen3_8b_plan(CONFIGS / "qwen3-8b-4gpu.yaml")
    assert f"largest micro-batch {plan.worst}" in done.stderr
    tables = re.split(r"^gpu (?=cuda:\d: )", done.stderr, flags=re.M)[1:]
    assert [table[:len("cuda:0")] for table in tables] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    for table, device in zip(tables, plan.devices):
        assert table.startswith(f"{device.device}: {', '.join(device.roles)}")
        for term in device.terms + device.overhead:
            assert re.search(rf"{re.escape(term.name)}\s*│\s*{term.count}\s*│\s*{term.bytes / GIB:.2f}", table), term
        assert re.search(rf"total\s*│\s*│\s*{device.total / GIB:.2f}\s*│ fits: {usable_bytes(H200_MIB) / GIB:.1f} GiB "
                         rf"usable of NVIDIA H200 "
                         rf"\({H200_MIB} MiB\)", table)
    assert not gpu_host.workspace.exists()

    refused = gpu_host.dflash("launch", "gpu", "--config", str(one_gpu_config(tmp_path)), "--dry-run",
                              *gpu_host.data())
    assert refused.returncode == 2
    assert f"DOES NOT FIT: {usable_bytes(H200_MIB) / GIB:.1f} GiB usable" in refused.stderr
    assert "(a dry run: nothing was deployed or started)" in " ".join(refused.stderr.split())
    assert not gpu_host.workspace.exists()


def test_memory_another_process_holds_is_not_the_runs_and_the_refusal_names_it(gpu_host, fake_pve):
    """The shipped one-GPU config fits an idle H200; with another process holding 16 GiB
    of it, it does not, and that process is named."""
    config = CONFIGS / "qwen3-8b.yaml"
    (device,) = qwen3_8b_plan(config).devices
    assert device.total <= usable_bytes(H200_MIB)  # alone, it fits
    fake_pve.hold_gpu_memory([(0, 4242, "/usr/bin/python3", 16384), (2, 77, "/opt/conda/bin/python", 2048)])
    try:
        dry = gpu_host.dflash("launch", "gpu", "--config", str(config), "--dry-run", *gpu_host.data())
        launched = gpu_host.dflash("launch", "gpu", "--config", str(config), *gpu_host.data())
        elsewhere = gpu_host.dflash("launch", "gpu", "--config", str(config), "--dry-run", *gpu_host.data(),
                                    "--set", "devices.target=[cuda:1]", "--set", "devices.drafters=[cuda:1, cuda:1]")
    finally:
        fake_pve.hold_gpu_memory([])
    available = usable_bytes(H200_MIB) - 16384 * 2**20
    said = (f"gpu: cuda:0 (target-0, eval, drafter-0, drafter-1) needs an estimated {device.total / GIB:.1f} GiB, "
            f"more than the {available / GIB:.1f} GiB usable of its NVIDIA H200 ({H200_MIB} MiB, 16.0 GiB of it "
            "held by other processes: pid 4242 /usr/bin/python3 16.0 GiB); largest terms: ")
    for done, consequence in ((dry, "a dry run: nothing was deployed or started"),
                              (launched, "nothing was deployed or started")):
        message = " ".join(done.stderr.split())
        assert done.returncode == 2, done.stderr
        assert said in message
        assert f"stop those processes, or put the run on a GPU they leave free ({consequence})" in message
    assert "DOES NOT FIT" in dry.stderr and launched.stdout == ""
    assert not gpu_host.workspace.exists()
    # What another GPU's processes hold is no concern of cuda:1's.
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert re.search(rf"fits: {usable_bytes(H200_MIB) / GIB:.1f} GiB usable of NVIDIA H200", elsewhere.stderr)
    assert "held by other processes" not in elsewhere.stderr


def test_a_device_the_host_lacks_is_refused(gpu_host):
    done = gpu_host.dflash("launch", "gpu", "--config", str(CONFIGS / "qwen3-8b-4gpu.yaml"),
                           "--set", "devices.drafters=[cuda:1, cuda:4]")
    assert done.returncode == 2
    assert ("gpu: cuda:4 (drafter-1) is not there: the host has 4 GPU(s): cuda:0, cuda:1, cuda:2, cuda:3 "
            "(nothing was deployed or started)") in " ".join(done.stderr.split())
    assert not gpu_host.workspace.exists()


@pytest.mark.slow(seconds=6, why="deploys over pct and starts the trainer, which is stopped at once")
def test_a_run_that_fits_passes_the_check_and_starts(gpu_host):
    done = gpu_host.dflash("launch", "gpu", "--config", str(CONFIGS / "tiny-gpu.yaml"))
    assert done.returncode == 0, done.stderr
    (run_id,) = done.stdout.splitlines()
    config = load_job_config(CONFIGS / "tiny-gpu.yaml")
    (device,) = estimate(config, TargetShape.from_tiny(config.target.tiny)).devices
    assert (f"gpu: GPU memory fits (estimated peak of usable): cuda:0 {device.total / GIB:.1f} GiB of "
            f"{usable_bytes(H200_MIB) / GIB:.1f} GiB") in done.stderr
    run_json = json.loads((gpu_host.workspace / "runs" / run_id / "run.json").read_text())
    assert run_json["resources"] == ["gpu0"]
    # The host has no GPU for the trainer to use: it is stopped before it finds out.
    stopped = gpu_host.dflash("stop", run_id, "--grace", "1")
    assert stopped.returncode == 0, stopped.stderr


def test_cpu_only_configs_have_no_gpu_check(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    done = dflash_in_process("launch", "local", "--config", str(CONFIGS / "tiny-cpu.yaml"), "--dry-run", hosts=hosts)
    assert done.returncode == 0, done.stderr
    assert "the config runs on the CPU only: no GPU memory check" in done.stderr
    assert not (tmp_path / "local ws").exists()


# --- the host's side: gpus.fit_facts ------------------------------------------------

def test_the_probe_finds_a_hub_id_in_the_cache_the_environment_names(tmp_path, monkeypatch):
    expected = cache_hub_model(tmp_path / "hf", "Qwen/Qwen3-8B", QWEN3_8B)
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert gpus.model_config("Qwen/Qwen3-8B") == (QWEN3_8B, str(expected))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # before HF_HOME
    fields, problem = gpus.model_config("Qwen/Qwen3-8B")
    assert fields is None and problem == f"Qwen/Qwen3-8B is not in the Hugging Face cache {tmp_path / 'elsewhere'}"


def test_the_probe_reads_a_model_folder_and_names_what_it_cannot(tmp_path):
    folder = write_model_folder(tmp_path / "model", QWEN3_8B)
    assert gpus.model_config(str(folder)) == (QWEN3_8B, str(folder / "config.json"))
    fields, problem = gpus.model_config(str(tmp_path / "missing"))
    assert fields is None and problem.startswith(f"cannot read {tmp_path / 'missing' / 'config.json'}: ")
    assert gpus.model_config("../up") == (None, "../up is neither a folder nor a Hugging Face hub id")


# -- the shipped configs of other families -----------------------------------------------------

# Each target's parameters, as its published checkpoint has them (the stand-in's config must be the model's).
PUBLISHED_PARAMETERS = {"meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248, "openai/gpt-oss-20b": 20_914_757_184,
                        "Qwen/Qwen3-30B-A3B": 30_532_122_624, "Qwen/Qwen3-8B": 8_190_735_360}
ONE_H200 = ["llama3.1-8b.yaml", "gpt-oss-20b.yaml", "qwen3-30b-a3b.yaml"]


def target_config_json(name: str, folder: Path) -> dict:
    """The config.json transformers writes for TARGETS[name]: the fields a model folder of it has."""
    from transformers import AutoConfig

    fields = dict(TARGETS[name])
    config = AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields, tie_word_embeddings=False)
    config.save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_the_bench_stand_ins_have_the_published_targets_shapes(name, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = target_config_json(name, tmp_path)
    with torch.device("meta"):  # the shapes alone, no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]
    assert model.config.model_type == fields["model_type"]


@pytest.mark.parametrize("config_name", ONE_H200)
def test_each_families_config_fits_its_h200_and_says_the_estimate_it_gets(gpu_host, tmp_path, config_name):
    path = CONFIGS / config_name
    config = load_job_config(path)  # the one strict loader
    assert config.target.path in TARGETS  # bench/fit_h200.py can run it at random weights
    fields = target_config_json(config.target.path, tmp_path / "stand-in")
    cache_hub_model(gpu_host.hf_home, config.target.path, fields)
    done = gpu_host.dflash("launch", "gpu", "--config", str(path), "--dry-run", *gpu_host.data())
    assert done.returncode == 0, done.stderr
    (device,) = estimate(config, TargetShape.from_config_json(fields)).devices
    usable = usable_bytes(H200_MIB)
    assert device.total <= usable
    assert re.search(rf"total\s*│\s*│\s*{device.total / GIB:.2f}\s*│ fits: {usable / GIB:.1f} GiB usable of NVIDIA "
                     rf"H200", done.stderr), done.stderr
    assert not gpu_host.workspace.exists()
    # The config's comment records what the check says.
    comment = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    assert f"{device.total / GIB:.1f} GiB of the H200's {usable / GIB:.1f} GiB usable" in comment


@pytest.mark.parametrize("config_name", ONE_H200 + ["qwen3-8b.yaml", "evaluate-qwen3-8b.yaml"])
def test_fit_h200_builds_and_runs_the_architecture_the_config_names(tmp_path, config_name):
    name = load_job_config(CONFIGS / config_name).target.path
    folder, architecture = fit_h200.target_folder(tmp_path, CONFIGS / config_name)
    assert folder == tmp_path / "targets" / name.replace("/", "--") and architecture is TARGETS[name]
    with pytest.raises(SystemExit, match="no target prepared for"):
        fit_h200.prepared(tmp_path, CONFIGS / config_name)
    with pytest.raises(SystemExit, match="target.path None has no architecture in gpu_trainer.TARGETS"):
        fit_h200.target_folder(tmp_path, CONFIGS / "tiny-cpu.yaml")


def test_a_regenerate_batch_size_the_gpu_cannot_hold_is_refused_before_launch_naming_the_cache(gpu_host):
    """job: regenerate is planned too: the target and a KV cache of batch_size rows for the
    answers' positions per device (the prompts' come on top, checked by the job)."""
    config = str(CONFIGS / "regen-qwen3-8b.yaml")
    prompts = ["--set", f"regenerate.prompts={gpu_host.chats}"]
    fits = gpu_host.dflash("launch", "gpu", "--config", config, "--dry-run", *prompts)
    assert fits.returncode == 0, fits.stderr
    assert "KV cache: 64 rows x 2048 positions" in fits.stderr and "fits:" in fits.stderr
    refused = gpu_host.dflash("launch", "gpu", "--config", config, "--dry-run", *prompts,
                              "--set", "regenerate.batch_size=1024")
    message = " ".join(refused.stderr.split())
    assert refused.returncode == 2, refused.stderr
    assert "gpu: cuda:0 (target-0) needs an estimated" in message and "KV cache: 1024 rows x 2048 positions" in message
    assert "change regenerate.batch_size (1024), regenerate.max_new_tokens (2048)" in message
    assert not gpu_host.workspace.exists()
