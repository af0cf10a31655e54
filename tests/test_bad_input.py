"""Bad input is caught where it can first be seen: here before anything is sent, or by
the host in the launch itself (the agent's preflight) before anything starts; each
with a message naming what and where, and exit 2. Over sshd and the fake pct."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from dflash_agent import preflight
from dflash_files import procfs
from dflash_run import REPO, dflash_in_process
from support import container_workspace, workspace_on_node
from support.disk import fill, tmpfs
from support.train_configs import small_config

pytestmark = pytest.mark.timeout(300)
ISO_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00"


def nothing_started(workspace: Path) -> None:
    """No run directory and no lock file on the host."""
    runs = workspace / "runs"
    assert not runs.exists() or not list(runs.iterdir())
    locks = workspace / "locks"
    assert not locks.exists() or not list(locks.glob("*.json"))


# --- caught here, before anything is sent ----------------------------------------------

@pytest.mark.parametrize("name", ["-x", "--force", "n" * 250, ".hidden", "a/b", "tab\there", ""])
def test_a_bad_run_name_is_refused_before_anything_is_sent(make_inventory, fake_pve, tmp_path, name):
    done = dflash_in_process("launch", "ct200", "--config", str(small_config(tmp_path / "c.yaml")), "--name", name,
                  hosts=make_inventory(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert f"--name {name!r}: a run name has 1 to 179 characters" in done.stderr
    assert not workspace_on_node(fake_pve, tmp_path).exists()  # nothing deployed


def test_the_longest_name_makes_the_longest_run_id(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    done = dflash_in_process("launch", "node", "--config", str(small_config(tmp_path / "c.yaml")), "--name", "n" * 179,
                  hosts=hosts)
    assert done.returncode == 0, done.stderr
    (run_id,) = done.stdout.split()
    assert len(run_id) == 200
    assert dflash_in_process("stop", run_id, "--host", "node", hosts=hosts).returncode == 0


def test_a_train_file_missing_on_the_host_is_refused_before_anything_starts(make_inventory, fake_pve, tmp_path):
    config = small_config(tmp_path / "c.yaml")
    text = yaml.safe_load(config.read_text())
    text["data"] = {"train": "data/chats.jsonl", "max_length": 128, "token_budget": 1024}
    config.write_text(yaml.safe_dump(text))
    done = dflash_in_process("launch", "ct200", "--config", str(config), hosts=make_inventory(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "data.train" in done.stderr and "data/chats.jsonl" in done.stderr
    assert "AssertionError" not in done.stderr
    runs = workspace_on_node(fake_pve, tmp_path) / "runs"
    assert not runs.exists() or not any(runs.iterdir())



@pytest.mark.parametrize("content, problem", [
    ("", " is empty: it holds no conversation to train on"),
    ("\n  \n", " is empty: it holds no conversation to train on"),
    ('\n{"messages": [}\n', ":2: not JSON (Expecting value: line 1 column 15 (char 14))"),
    ('{"prompt": "hi"}\n', ":1: expected a 'text' or a 'messages' key"),
], ids=["empty", "blank lines", "not JSON", "no text or messages"])
def test_training_data_that_holds_nothing_to_train_on_is_refused_before_the_run_starts(make_inventory, fake_pve,
                                                                                        tmp_path, content, problem):
    data = container_workspace(fake_pve, tmp_path).parent / f"data {tmp_path.name}" / "train.jsonl"
    on_node = fake_pve.on_node(200, data)
    on_node.parent.mkdir(parents=True)
    on_node.write_text(content)
    config = small_config(tmp_path / "c.yaml", data={"synthetic": None, "train": str(data)})
    done = dflash_in_process("launch", "ct200", "--config", str(config), hosts=make_inventory(tmp_path))
    assert done.returncode == 2, done.stderr
    assert f"host ct200: data.train: {data}{problem}" in done.stderr.replace("\n", " ")
    assert done.stdout == ""
    nothing_started(workspace_on_node(fake_pve, tmp_path))

def test_a_host_named_twice_in_the_inventory_is_refused(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n"
                     "  gpu1: {transport: ssh, ssh: root@10.0.0.1, workspace: /w}\n"
                     "  gpu2: {transport: ssh, ssh: root@10.0.0.2, workspace: /w}\n"
                     "  gpu1: {transport: ssh, ssh: root@10.0.0.3, workspace: /w}\n")
    done = dflash_in_process("hosts", hosts=hosts)
    assert done.returncode == 2
    assert done.stderr == f"dflash: error: {hosts}: line 4: key 'gpu1' given twice (first at line 2)\n"


def test_fetch_traceback_into_a_missing_folder_is_refused_without_asking_the_host(make_inventory, tmp_path):
    # `down` cannot be reached: a refusal that asked it would say so, with exit 3.
    done = dflash_in_process("--logs-dir", str(tmp_path / "logs"), "fetch-traceback", "some-run", "--host", "down",
                  "-o", "/nonexistent/dir/tb.txt", hosts=make_inventory(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "/nonexistent/dir/tb.txt: the folder /nonexistent/dir does not exist" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_run_id_that_reads_as_an_option_is_refused(make_inventory, tmp_path):
    done = dflash_in_process("status", "--host", "node", "--", "--force", hosts=make_inventory(tmp_path))
    assert done.returncode == 2
    assert "'--force' is not a run id" in done.stderr


# --- caught by the host, in the launch, before anything starts --------------------------

def test_paths_missing_on_the_host_are_named_before_anything_starts(make_inventory, fake_pve, tmp_path):
    config = tmp_path / "real.yaml"
    config.write_text(yaml.safe_dump({"target": {"path": "/nonexistent/model"},
                                      "data": {"train": "/nonexistent/chats.jsonl", "eval": "data/eval.jsonl"}}))
    done = dflash_in_process("launch", "ct200", "--config", str(config), hosts=make_inventory(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    # Relative paths are the release's, this tree: checked here, before anything is deployed.
    assert not (workspace_on_node(fake_pve, tmp_path) / "releases").exists()
    (error,) = [line for line in " ".join(done.stderr.split()).split(" hint: ") if line.startswith("dflash: error:")]
    assert error == (
        "dflash: error: host ct200: target.path: /nonexistent/model does not exist "
        "(and '/nonexistent/model' is not a Hugging Face hub id); "
        "data.train: /nonexistent/chats.jsonl does not exist; "
        f"data.eval: data/eval.jsonl is not in the release: the deploy sends what git would commit of remote/ and "
        f"configs/ of {REPO}, which holds no such file or folder (nothing was deployed or started)")
    nothing_started(workspace_on_node(fake_pve, tmp_path))


@pytest.mark.slow(seconds=23, why="makes a bare virtualenv, then checks and launches against it over SSH")
def test_a_python_without_torch_is_not_ok_and_launches_nothing(make_inventory, bare_python, tmp_path):
    hosts = make_inventory(tmp_path, ct201=None, ct999=None, down=None, node={"python": bare_python})
    check = dflash_in_process("hosts", "--check", "node", hosts=hosts)
    assert check.returncode == 2, check.stderr
    (row,) = [line for line in check.stderr.splitlines() if line.startswith("│ node")]
    assert "needs setup: " in row
    as_json = dflash_in_process("hosts", "--check", "--json", "node", "ct200", hosts=hosts)
    assert as_json.returncode == 2
    entries = {e["host"]: e for e in map(json.loads, as_json.stdout.splitlines())}
    assert entries["node"]["missing_packages"] == ["torch", "transformers"]
    assert entries["node"]["python_executable"] == bare_python
    assert entries["node"]["status"] == (f"needs setup: {bare_python} cannot import torch, transformers: "
                                         "ModuleNotFoundError: No module named 'torch'; run: dflash setup node")
    assert entries["ct200"]["status"] == "ok"
    assert entries["ct200"]["missing_packages"] == []

    done = dflash_in_process("launch", "node", "--config", str(small_config(tmp_path / "c.yaml")), hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert (f"host node: the trainer's interpreter {bare_python} cannot import torch, transformers, "
            "which the trainer needs") in " ".join(done.stderr.split())
    nothing_started(tmp_path / "node ws")


def test_a_full_disk_is_named_with_its_host_and_path(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    config = small_config(tmp_path / "c.yaml")
    with tmpfs(tmp_path / "node ws", size_mib=16) as workspace:
        filler = fill(workspace)
        done = dflash_in_process("deploy", "node", hosts=hosts)
        assert done.returncode == 2, done.stderr
        assert (f"host node: no space left on device in {workspace}: deploy install failed; "
                "the previous release stays current") in " ".join(done.stderr.replace("│", " ").split())
        # The launch checks the room before its deploy: it refuses with nothing sent.
        done = dflash_in_process("launch", "node", "--config", str(config), hosts=hosts)
        assert done.returncode == 2, done.stderr
        assert (f"dflash: error: host node: only 0.0 MiB free on the filesystem of {workspace}; "
                f"a run needs at least {preflight.MIN_FREE_MIB} MiB (nothing was deployed or started)"
                ) in " ".join(done.stderr.split())
        filler.unlink()
        assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
        fill(workspace)  # the release is there: the launch refuses the run all the same
        done = dflash_in_process("launch", "node", "--config", str(config), hosts=hosts)
        assert done.returncode == 2, done.stderr
        assert (f"dflash: error: host node: only 0.0 MiB free on the filesystem of {workspace}; "
                f"a run needs at least {preflight.MIN_FREE_MIB} MiB") in " ".join(done.stderr.split())
        assert "Errno" not in done.stderr
        nothing_started(workspace)


def test_fetch_traceback_that_cannot_write_its_file_says_so(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    fabricate_run(tmp_path / "node ws", "died-1", 1)
    with tmpfs(tmp_path / "out", size_mib=1) as out:
        fill(out)
        done = dflash_in_process("--logs-dir", str(tmp_path / "logs"), "fetch-traceback", "died-1", "--host", "node",
                      "-o", str(out / "tb.txt"), hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert f"dflash: error: -o {out}/tb.txt: cannot write it (No space left on device)" in done.stderr
    assert "Traceback" not in done.stderr


# --- what the CLI shows ------------------------------------------------------------------

def fabricate_run(workspace: Path, run_id: str, exit_code: int | None, supervisor: int | None = None) -> float:
    """A finished run as the agent leaves one (run.json, exit.json: none for exit_code
    None, a supervisor that died first); returns its end time. Its pids are above the
    kernel's largest: no process has them."""
    run_dir = workspace / "runs" / run_id
    run_dir.mkdir(parents=True)
    ended = time.time()
    (run_dir / "run.json").write_text(json.dumps({
        "run_id": run_id, "name": None, "release_id": "r", "release_dir": str(workspace / "releases" / "r"),
        "workspace": str(workspace), "config": "", "config_source": "config.yaml", "argv": ["python3"],
        "cwd": str(run_dir), "env_keys": [], "pid": 2 ** 22 + 1, "pgid": 2 ** 22 + 1, "start_time": 1,
        "boot_id": procfs.boot_id(), "host": "node", "started_at": ended - 60, "stall_after": 300.0,
        "resources": [], "supervisor": {"pid": supervisor, "start_time": None if supervisor is None else 1}}))
    if exit_code is not None:
        (run_dir / "exit.json").write_text(json.dumps({"exit_code": exit_code, "signal": None, "oom_killed": False,
                                                       "ended_at": ended, "exec_error": None}))
    return ended


def test_status_is_titled_for_its_run_and_every_time_is_iso(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    fabricate_run(tmp_path / "node ws", "done-1", 0)
    fabricate_run(tmp_path / "node ws", "died-1", 1)
    status = dflash_in_process("status", "done-1", "--host", "node", hosts=hosts)
    assert (status.returncode, status.stdout) == (0, "SUCCEEDED\n")
    assert status.stderr.splitlines()[0].rstrip() == "run done-1 on node"
    assert len(re.findall(ISO_UTC, status.stderr)) == 2  # started, ended
    runs = dflash_in_process("runs", "--host", "node", hosts=hosts)
    assert runs.stderr.splitlines()[0].rstrip() == "runs on node"
    assert len(re.findall(ISO_UTC, runs.stderr)) == 4
    fetched = dflash_in_process("--logs-dir", str(tmp_path / "logs"), "fetch-traceback", "died-1", "--host", "node",
                     hosts=hosts)
    assert fetched.returncode == 1
    assert re.search(rf"^process ended: exit code 1 at {ISO_UTC}$", fetched.stdout, re.MULTILINE), fetched.stdout


def test_the_supervisors_last_error_is_shown_when_nothing_else_says_why_the_run_ended(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    supervisor = 2 ** 22 + 2
    fabricate_run(tmp_path / "node ws", "lost-1", None, supervisor)  # it died before it wrote exit.json
    (tmp_path / "node ws" / "runs" / "lost-1" / "agent.log").write_text(
        f"2026-01-01T00:00:00 supervisor[{supervisor - 1}]: error: an earlier attempt's supervisor\n"
        f"2026-01-01T00:00:01 supervisor[{supervisor}]: trainer pid 7 started (attempt 0): [...]\n"
        f"2026-01-01T00:00:02 supervisor[{supervisor}]: error: RuntimeError: first\n"
        f"2026-01-01T00:00:03 supervisor[{supervisor}]: error: OSError: [Errno 5] Input/output error\n"
        "Traceback (most recent call last):\n  ...\nOSError: [Errno 5] Input/output error\n")
    status = dflash_in_process("status", "lost-1", "--host", "node", hosts=hosts)
    assert (status.returncode, status.stdout) == (1, "LOST\n")
    assert "reason: OSError: [Errno 5] Input/output error" in status.stderr
    fetched = dflash_in_process("--logs-dir", str(tmp_path / "logs"), "fetch-traceback", "lost-1", "--host", "node",
                                hosts=hosts)
    assert fetched.returncode == 1
    assert "agent.log, the supervisor's last error: OSError: [Errno 5] Input/output error\n" in fetched.stdout


def test_status_says_the_oom_killer_ended_a_run(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    runs = tmp_path / "node ws" / "runs"
    fabricate_run(tmp_path / "node ws", "oom-1", None)
    (runs / "oom-1" / "exit.json").write_text(json.dumps({"exit_code": None, "signal": "SIGKILL", "oom_killed": True,
                                                          "ended_at": time.time(), "exec_error": None}))
    status = dflash_in_process("status", "oom-1", "--host", "node", hosts=hosts)
    assert (status.returncode, status.stdout) == (1, "FAILED\n"), status.stderr
    assert ("reason: the kernel's OOM killer ended the trainer (SIGKILL): the host, or its container's limit, ran "
            "out of memory") in " ".join(status.stderr.split())


def test_status_says_a_lost_run_ended_with_a_boot_of_its_host(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    runs = tmp_path / "node ws" / "runs"
    fabricate_run(tmp_path / "node ws", "rebooted-1", None)
    record = json.loads((runs / "rebooted-1" / "run.json").read_text())
    record["boot_id"] = before = "0f0f0f0f-0000-4000-8000-000000000000"  # the boot the run started in
    (runs / "rebooted-1" / "run.json").write_text(json.dumps(record))
    status = dflash_in_process("status", "rebooted-1", "--host", "node", hosts=hosts)
    assert (status.returncode, status.stdout) == (1, "LOST\n"), status.stderr
    assert (f"reason: the host booted again since the run started (boot id {before} then, {procfs.boot_id()} now): "
            "its trainer ended with it") in " ".join(status.stderr.split())


def test_a_cut_short_run_json_is_named_and_the_hosts_other_runs_are_listed(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    fabricate_run(tmp_path / "node ws", "done-1", 0)
    fabricate_run(tmp_path / "node ws", "cut-1", 1)
    run_json = tmp_path / "node ws" / "runs" / "cut-1" / "run.json"
    run_json.write_bytes(run_json.read_bytes()[:40])
    named = f"host node: run 'cut-1': {run_json} cannot be read (JSONDecodeError: "
    for verb in ("status", "resume", "pull"):
        done = dflash_in_process(verb, "cut-1", "--host", "node", hosts=hosts)
        assert done.returncode == 2, done.stderr
        assert f"dflash: error: {named}" in " ".join(done.stderr.split()), done.stderr
    runs = dflash_in_process("runs", "--host", "node", hosts=hosts)
    assert runs.returncode == 2, runs.stderr
    assert runs.stdout == "node\tdone-1\tSUCCEEDED\n"
    assert f"warning: host node: run cut-1 not listed: {run_json} cannot be read (JSONDecodeError: " in \
        " ".join(runs.stderr.split())


def test_hosts_json_is_the_whole_answer(make_inventory, tmp_path):
    done = dflash_in_process("hosts", "--json", hosts=make_inventory(tmp_path))
    assert done.returncode == 0
    assert [json.loads(line)["host"] for line in done.stdout.splitlines()] == [
        "ct200", "ct201", "ct999", "down", "local", "node"]
    assert done.stderr == ""
