"""dflash setup: a container with only the system Python gets the trainer's interpreter
(a virtualenv under its workspace), `hosts --check` says when a host is ready, and a
failed install leaves the environment in use as it was."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dflash_cli import requirements
from dflash_cli.commands.setup import failed_package
from dflash_cli.host_scripts import host_setup
from dflash_contract.replies import HostProbe
from dflash_run import REPO, dflash, popen_dflash
from support import container_workspace
from support.inventory import default_hosts
from support.pve import BARE_CONTAINER
from support.train_configs import small_config


def test_the_train_extra_is_the_requirements_file():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    listed = requirements.load(REPO).by_name.values()
    assert sorted(map(str, map(Requirement, extra))) == sorted(map(str, listed))


@pytest.mark.parametrize("driver, index", [
    ("580.159.04", "cu130"), ("580.82.07", "cu130"), ("575.51.03", "cu129"), ("570.124.06", "cu128"), ("565.57.01", "cu126"),
    ("550.54.15", "cu124"), ("535.104.05", "cu121"), ("525.60.13", "cu118")])
def test_the_cuda_driver_picks_the_newest_pytorch_build_it_runs(driver, index):
    assert host_setup.index_for_driver(driver) == f"https://download.pytorch.org/whl/{index}"


def test_a_driver_older_than_every_build_is_refused_with_what_to_do():
    with pytest.raises(host_setup.SetupFailed, match=r"NVIDIA driver 470\.82\.01 is older .* pass --index-url"):
        host_setup.index_for_driver("470.82.01")


@pytest.mark.parametrize("line, package", [
    ("ERROR: No matching distribution found for torch==0.0.1", "torch==0.0.1"),
    ("ERROR: Could not find a version that satisfies the requirement tokenizers>=99 (from versions: 0.1)",
     "tokenizers>=99"),
    ("ERROR: Failed building wheel for safetensors", "safetensors"),
])
def test_the_package_pip_failed_on_is_named(line, package):
    assert failed_package(["Collecting x", line, "[notice] something else"]) == package


IMPORTS = {"torch": "2.13.0+cu128", "transformers": "5.0.0", "cuda_devices": 2}
GPU = {"index": 0, "name": "NVIDIA H200", "memory_used_mib": 0, "memory_total_mib": 143771, "utilization_pct": 0,
       "temperature_c": 31, "power_w": 75.12}


def host_facts(imports: dict) -> HostProbe:
    """What the probe of a host with two GPUs answers, its imports `imports`."""
    return HostProbe.from_json({
        "python": "3.12.3", "python_executable": "/ws/env/bin/python", "platform": "Linux", "hostname": "ct200",
        "packages": {"torch": "2.13.0+cu128", "transformers": "5.0.0"}, "gpus": [GPU, dict(GPU, index=1)],
        "current_release": None, "imports": imports})


@pytest.mark.parametrize("imports, problem", [
    ({}, None),
    ({"cuda_devices": 0}, "torch sees 0 of the 2 GPUs nvidia-smi lists (a CPU build of torch, or one too new "
                          "for the driver)"),
    ({"torch": "2.5.1"}, "torch 2.5.1 is not torch<=2.14.1,>=2.6"),
    ({"transformers": "4.40.0"}, "transformers 4.40.0 is not transformers>=4.56"),
])
def test_ready_means_supported_versions_that_see_every_gpu(imports, problem):
    problems = requirements.readiness_problems(host_facts({**IMPORTS, **imports}), requirements.load(REPO))
    assert problems == ([problem] if problem else [])


def test_a_torch_outside_the_supported_range_is_refused_before_any_host_is_touched():
    done = dflash("setup", "local", "--torch", "2.5.1")
    assert done.returncode == 2
    assert f"--torch 2.5.1: the trainer supports torch<=2.14.1,>=2.6 ({REPO}/remote/requirements.txt)" in done.stderr
    assert done.stdout == ""


def bare_inventory(make_inventory, ssh_node, fake_pve, tmp_path: Path, bare_python: str) -> Path:
    """ct203 (the bare container, no `python` named) and ct203-named (the same container
    and workspace, with the bare interpreter named as its python)."""
    entry = dict(default_hosts(tmp_path, ssh_node, fake_pve)["ct200"], container=BARE_CONTAINER)
    del entry["python"]
    return make_inventory(tmp_path, local=None, node=None, ct200=None, ct201=None, ct999=None, down=None,
                          ct203=entry, **{"ct203-named": dict(entry, python=bare_python)})


def check(hosts: Path) -> dict[str, dict]:
    done = dflash("hosts", "--check", "--json", hosts=hosts)
    return {e["host"]: e for e in map(json.loads, done.stdout.splitlines())}


def result_row(stderr: str, host: str) -> list[str]:
    (row,) = [line for line in stderr.splitlines() if line.startswith(f"│ {host} ")]
    return [cell.strip() for cell in row.strip("│").split("│")]


@pytest.mark.timeout(1800)
@pytest.mark.slow(seconds=133,
                  why="installs torch and transformers into a fresh virtualenv in a bare container, then trains")
def test_a_bare_container_is_set_up_then_ready_then_trains_and_a_failed_install_keeps_its_env(
        make_inventory, ssh_node, fake_pve, bare_container, bare_python, tmp_path):
    hosts = bare_inventory(make_inventory, ssh_node, fake_pve, tmp_path, bare_python)
    workspace = container_workspace(fake_pve, tmp_path)  # as the container sees it
    on_node = fake_pve.on_node(bare_container, workspace)
    before = check(hosts)["ct203"]
    assert before["python_executable"] == str(Path(bare_python).parent / "python3")
    assert before["status"].startswith(f"needs setup: {Path(bare_python).parent / 'python3'} cannot import torch")
    assert before["status"].endswith("; run: dflash setup ct203")

    # The tests' choice: torch 2.13.0 from the indexes pip is configured with (its CPU
    # wheel is on local disk), not https://download.pytorch.org/whl/cpu.
    started = time.monotonic()
    done = dflash("setup", "ct203", "--torch", "2.13.0", "--index-url", "pip", hosts=hosts, timeout=1500)
    print(f"setup of a bare container: {time.monotonic() - started:.0f} s", file=sys.stderr)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    host, status, env = line.split("\t")
    assert (host, status) == ("ct203", "installed")
    assert Path(env).parent == workspace / "envs"
    assert "ct203: Successfully installed" in done.stderr  # pip's own lines, as they came
    assert os.readlink(on_node / "env") == f"envs/{Path(env).name}"

    ready = check(hosts)
    assert ready["ct203"]["status"] == "ok"
    assert ready["ct203"]["python_executable"] == str(workspace / "env" / "bin" / "python")
    assert ready["ct203"]["imports"]["torch"].startswith("2.13.0")
    # A python the inventory names stays the host's interpreter.
    assert ready["ct203-named"]["python_executable"] == bare_python
    assert ready["ct203-named"]["status"].startswith("needs setup: ")

    launched = dflash("launch", "ct203", "--config", str(small_config(tmp_path / "c.yaml")), "--follow",
                      hosts=hosts, timeout=600)
    assert launched.returncode == 0, launched.stderr
    (run_id,) = launched.stdout.splitlines()[:1]
    assert (on_node / "runs" / run_id / "exit.json").is_file()

    stamp = on_node / "env" / host_setup.STAMP
    installed = stamp.stat().st_ino
    again = dflash("setup", "ct203", "--torch", "2.13.0", "--index-url", "pip", hosts=hosts)
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"ct203\tunchanged\t{env}\n"
    assert result_row(again.stderr, "ct203")[4] == "1"  # round trips
    assert stamp.stat().st_ino == installed
    assert "Collecting" not in again.stderr  # pip never ran

    failed = dflash("setup", "ct203", "--torch", "2.13.99", "--index-url", "pip", hosts=hosts, timeout=600)
    assert failed.returncode == 2, failed.stderr
    assert (f"\nerror: host ct203: setup failed: pip could not install torch==2.13.99; "
            f"the environment in use stays {env}\n") in failed.stderr
    assert failed.stdout == ""
    assert os.readlink(on_node / "env") == f"envs/{Path(env).name}"
    assert stamp.stat().st_ino == installed
    assert os.listdir(on_node / "envs") == [Path(env).name]  # the failed build is gone
    assert check(hosts)["ct203"]["status"] == "ok"


@pytest.mark.slow(seconds=5, why="starts pip installing torch on a host, then interrupts it")
def test_ctrl_c_ends_the_install_on_the_host_and_leaves_no_environment(make_inventory, bare_python, tmp_path):
    workspace = tmp_path / "local ws"
    hosts = make_inventory(tmp_path, node=None, ct200=None, ct201=None, ct999=None, down=None,
                           local={"python": bare_python})
    setup = popen_dflash("setup", "local", "--torch", "2.13.0", "--index-url", "pip", hosts=hosts)
    for line in setup.stderr:  # pip has started: the environment is being built
        if line.startswith(b"local: "):
            break
    setup.send_signal(signal.SIGINT)
    stdout, stderr = setup.communicate(timeout=120)
    assert setup.returncode == 130, stderr
    assert b"error: host local: setup interrupted; the environment in use stays as it was" in stderr
    assert stdout == b""
    assert not (workspace / "env").exists()
    assert list((workspace / "envs").iterdir()) == []  # the unfinished one was removed
    assert processes_naming(workspace) == []  # pip went with it


def processes_naming(path: Path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.fsencode(path) in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return found
