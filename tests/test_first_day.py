"""What a new user trips on first (issue: a new user's first day): messages that say what
to do next, help that says where a setting comes from."""
from __future__ import annotations

import json
import shutil
import threading

from dflash_run import dflash_in_process
from test_bad_input import fabricate_run

from dflash_cli.local_state import RunRef, set_latest
from dflash_cli.session import LOGS_ENV
from dflash_train.runlog import error_record


def _record(thread: str) -> dict:
    try:
        raise RuntimeError(f"{thread} broke")
    except RuntimeError as exc:
        return {**error_record(exc, thread=thread, thread_ident=threading.get_ident(), phase="train", step=3).to_json(),
                "attempt": 0}


def test_fetch_traceback_of_a_thread_without_a_record_lists_those_that_have_one(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    fabricate_run(tmp_path / "node ws", "died-1", 1)
    errors = tmp_path / "node ws" / "runs" / "died-1" / "errors.jsonl"
    errors.write_text("".join(json.dumps(_record(thread)) + "\n" for thread in ("drafter-1", "target-0")))
    done = dflash_in_process("--logs-dir", str(tmp_path / "logs"), "fetch-traceback", "died-1", "--host", "node",
                             "--thread", "nosuch", hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert ("dflash: error: run died-1: no error record from thread 'nosuch'; threads with records: drafter-1, "
            "target-0") in " ".join(done.stderr.split())


def test_logs_dir_help_names_its_environment_variable():
    done = dflash_in_process("--help")
    assert f"env {LOGS_ENV})" in " ".join(done.stdout.split())


def test_the_top_level_help_says_each_commands_first_sentence_whole():
    done = dflash_in_process("--help")
    text = " ".join(done.stdout.split())
    assert "launch Start a training run on HOST, detached; print its run id on stdout." in text
    assert "deploy Send remote/ and configs/ to HOSTs as a content-addressed release." in text
    assert "..." not in done.stdout.split("Commands:")[1]


def test_state_is_found_from_any_folder_of_the_project(make_inventory, tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    shutil.copy(make_inventory(tmp_path), project / "configs" / "hosts.yaml")
    monkeypatch.delenv(LOGS_ENV)  # the project's own logs/, as a user has it
    assert dflash_in_process("deploy", "node", cwd=project).returncode == 0
    fabricate_run(tmp_path / "node ws", "done-1", 0)
    set_latest(project / "logs", RunRef("node", "done-1"))
    (project / "docs").mkdir()
    done = dflash_in_process("status", cwd=project / "docs")
    assert (done.returncode, done.stdout) == (0, "SUCCEEDED\n"), done.stderr
    listed = dflash_in_process("runs", cwd=project / "docs")
    assert listed.returncode == 0, listed.stderr
    assert not (project / "docs" / "logs").exists()  # nothing of the project's state under docs/
    unknown = dflash_in_process("status", "--host", "nowhere", cwd=project / "docs")
    assert unknown.returncode == 2 and "unknown host 'nowhere'" in unknown.stderr


def test_no_project_root_is_said_when_no_run_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv(LOGS_ENV)
    (tmp_path / "empty").mkdir()
    done = dflash_in_process("status", cwd=tmp_path / "empty")
    assert done.returncode == 2
    assert f"(no project root above {tmp_path / 'empty'}: no folder there holds configs/hosts.yaml, dflash.yaml, " \
           "logs)" in " ".join(done.stderr.split())


def _named_run(workspace, run_id: str, name: str) -> None:
    """A finished run as fabricate_run leaves one, its run.json naming it as launch does."""
    fabricate_run(workspace, run_id, 0)
    record = workspace / "runs" / run_id / "run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "name": name}))


def test_a_run_is_named_by_a_unique_prefix_or_its_name_and_a_miss_names_the_closest(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    assert dflash_in_process("deploy", "node", hosts=hosts).returncode == 0
    workspace = tmp_path / "node ws"
    for run_id, name in (("tiny-cpu-20261204-150000-aaaa", "tiny-cpu"), ("tiny-cpu-20261204-160000-bbbb", "tiny-cpu"),
                         ("exp-20261204-170000-cccc", "exp"), ("exp2-20261204-180000-dddd", "exp2")):
        _named_run(workspace, run_id, name)

    def status(*args: str):
        return dflash_in_process("status", *args, hosts=hosts)

    by_prefix = status("tiny-cpu-20261204-15", "--host", "node")
    assert (by_prefix.returncode, by_prefix.stdout) == (0, "SUCCEEDED\n"), by_prefix.stderr
    assert "tiny-cpu-20261204-15: run tiny-cpu-20261204-150000-aaaa on node" in by_prefix.stderr
    by_name = status("exp", "--host", "node")  # a name, though exp2's id starts with it too
    assert by_name.returncode == 0 and "exp: run exp-20261204-170000-cccc on node" in by_name.stderr
    several = status("tiny-cpu", "--host", "node")  # a name two runs have
    assert several.returncode == 2 and several.stdout == ""
    assert ("'tiny-cpu' names 2 runs on node or recorded under " in several.stderr
            and "tiny-cpu-20261204-160000-bbbb, tiny-cpu-20261204-150000-aaaa" in one_line(several.stderr))
    missed = status("tiny-cpu-20261204-150000-aaab", "--host", "node")
    assert missed.returncode == 2
    assert "no run 'tiny-cpu-20261204-150000-aaab' on node" in missed.stderr
    assert "hint: did you mean tiny-cpu-20261204-150000-aaaa?" in missed.stderr
    # Without --host: the runs recorded here, and the latest run's host's.
    set_latest(tmp_path / "logs", RunRef("node", "exp2-20261204-180000-dddd"))
    found = status("tiny-cpu-20261204-16")
    assert (found.returncode, found.stdout) == (0, "SUCCEEDED\n"), found.stderr
    assert "run tiny-cpu-20261204-160000-bbbb on node" in found.stderr
    # `local`, asked next, has no release: the miss is said, not local's trouble.
    typo = status("tiny-cpu-20261204-17")
    assert typo.returncode == 2 and "no run 'tiny-cpu-20261204-17' on node or recorded under" in typo.stderr


def test_launch_records_each_run_so_that_a_prefix_finds_it_without_asking_a_host(tmp_path):
    logs = tmp_path / "logs"
    set_latest(logs, RunRef("node", "first-20261204-150000-aaaa"))
    set_latest(logs, RunRef("node", "second-20261204-160000-bbbb"))
    # The inventory lacks `node`: only the local records can have found the first run.
    done = dflash_in_process("--logs-dir", str(logs), "plot", "first")
    assert done.returncode == 2
    assert "first: run first-20261204-150000-aaaa on node" in done.stderr
    assert "no events of run first-20261204-150000-aaaa on node here" in one_line(done.stderr)


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_init_writes_a_commented_inventory_from_the_ssh_config_and_keeps_what_is_there(tmp_path, monkeypatch):
    from dflash_cli.inventory import load_inventory
    from dflash_cli.local_config import load_local_config

    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("Host *\n  ServerAliveInterval 30\n\nHost gpu-* \n  User ubuntu\n\n"
                          "Host trainer\n  HostName 10.1.2.3\n  User root\n  Port 2222\n\n"
                          "Host github.com\n  User git\n")
    monkeypatch.setenv("DFLASH_SSH_CONFIG", str(ssh_config))
    project = tmp_path / "project"
    project.mkdir()
    done = dflash_in_process("init", "trainer", cwd=project)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{project / 'configs' / 'hosts.yaml'}\n{project / 'dflash.yaml'}\n"
    text = (project / "configs" / "hosts.yaml").read_text()
    assert "  trainer:  # hostname 10.1.2.3 user root port 2222\n    transport: ssh\n" in text
    assert "  # github.com:" in text and "gpu-" not in text  # the others commented out; no pattern
    inventory = load_inventory(project / "configs" / "hosts.yaml")
    assert sorted(inventory.hosts) == ["local", "trainer"]
    assert (inventory.hosts["trainer"].ssh, inventory.hosts["trainer"].workspace) == ("trainer", "~/dflash")
    assert load_local_config(project / "dflash.yaml").trackers.named == []
    (project / "dflash.yaml").write_text("trackers: {trackio: {}}\n")  # the user's own since
    again = dflash_in_process("init", cwd=project)
    assert again.returncode == 2
    assert f"{project / 'configs' / 'hosts.yaml'}, {project / 'dflash.yaml'} exist; nothing was written" in \
        one_line(again.stderr)
    assert (project / "dflash.yaml").read_text() == "trackers: {trackio: {}}\n"
    unknown = dflash_in_process("init", "nosuch", "--force", cwd=project)
    assert unknown.returncode == 2 and "nosuch: not a Host of" in unknown.stderr
    assert dflash_in_process("init", "--force", cwd=project).returncode == 0
    assert sorted(load_inventory(project / "configs" / "hosts.yaml").hosts) == ["local"]
    status = dflash_in_process("hosts", cwd=project / "configs")  # found from a folder under it
    assert status.returncode == 0 and status.stdout == "local\n"


def test_hosts_check_cuts_no_header_or_version_at_80_columns(make_inventory, tmp_path):
    import torch
    import transformers

    done = dflash_in_process("hosts", "local", "--check", hosts=make_inventory(tmp_path), env={"COLUMNS": "80"})
    assert done.returncode in (0, 2), done.stderr  # ok, or needs setup: the table is what is checked
    lines = done.stderr.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in done.stderr, done.stderr
    header = next(line for line in lines if "host" in line and "status" in line)
    assert {"host", "status", "GPUs", "torch", "transformers"} <= set(header.replace("┃", " ").split()), header
    assert torch.__version__ in done.stderr and transformers.__version__ in done.stderr
    assert "left out for want of width:" in one_line(done.stderr)
