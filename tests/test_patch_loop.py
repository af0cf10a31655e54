"""The patch loop: what a release holds, and which patch each run carried. Two launches
with a one-line change between them: `launch` says what is new, `diff` shows that line,
`runs` lists both with the change, `gc` keeps both; large files stay out of releases."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dflash_cli import release
from dflash_cli.cli import main
from dflash_cli.commands.status import source_commit
from dflash_cli.release_store import FileChange, file_diff
from dflash_contract.records import ReleaseSource
from dflash_run import dflash, dflash_argv, dflash_env
from support import copy_release_dirs
from support.disk import fill, tmpfs
from support.train_configs import small_config

PATCHED = "remote/dflash_train/__init__.py"


def _round(n: int) -> str:
    """The patched trainer ends at once: the run shows which code ran in seconds."""
    return f"raise SystemExit('patched trainer: round {n}')\n"


def _cli(tmp_path, *args: str):
    """`dflash --hosts … --logs-dir … ARGS` in this process (the commands' own output is
    what is tested here, not the process boundary)."""
    return CliRunner().invoke(main, ["--hosts", str(tmp_path / "hosts.yaml"), "--logs-dir", str(tmp_path / "logs"),
                                     *args], env={"NO_COLOR": "1", "COLUMNS": "200"})


def _launch(tmp_path, project, config, host: str = "node") -> tuple[str, str]:
    done = _cli(tmp_path, "launch", host, "--config", str(config), "--source", str(project), "--force")
    assert done.exit_code == 0, done.stderr
    return done.stdout.strip(), done.stderr


def _releases(workspace) -> list[str]:
    return sorted(name for name in os.listdir(workspace / "releases") if not name.startswith("."))


@pytest.mark.slow(seconds=32, why="two trainer runs over pct, launched one edit apart")
def test_two_launches_one_line_apart_diff_runs_and_gc(make_inventory, tmp_path):
    make_inventory(tmp_path)
    workspace = tmp_path / "node ws"
    unused = copy_release_dirs(tmp_path / "unused")  # a release no run uses: gc's to remove
    (unused / "configs" / "scratch.yaml").write_text("a: 1\n")
    deployed = _cli(tmp_path, "deploy", "node", "--source", str(unused))
    assert deployed.exit_code == 0, deployed.stderr
    unused_id = deployed.stdout.split("\t")[1]

    project = copy_release_dirs(tmp_path / "project")
    (project / PATCHED).write_text(_round(1))
    run_a, said_a = _launch(tmp_path, project, small_config(tmp_path / "a.yaml"))
    assert "changed since" not in said_a and "same release" not in said_a  # the host's first run
    (project / PATCHED).write_text(_round(2))
    run_b, said_b = _launch(tmp_path, project, small_config(tmp_path / "b.yaml", optim={"max_steps": 13}))
    assert f"node: changed since {run_a}: 1 file (+1 \u22121)" in said_b, said_b
    run_c, said_c = _launch(tmp_path, project, small_config(tmp_path / "b.yaml"))
    assert f"node: same release as {run_b}" in said_c, said_c
    run_local, _ = _launch(tmp_path, project, small_config(tmp_path / "b.yaml"), host="local")
    shutil.rmtree(project)  # diff reads the releases on the host, not the tree

    releases = workspace / "releases"
    release_a = json.loads((workspace / "runs" / run_a / "run.json").read_text())["release_id"]
    for cached in (False, True):
        if cached:  # the second time run_a's release is not needed: what was fetched is kept
            os.rename(releases / release_a, releases / ".away")
        shown = _cli(tmp_path, "diff", run_a, run_b, "--host", "node")
        assert shown.exit_code == 0, shown.stderr
        assert shown.stdout == (f"--- a/{PATCHED}\n+++ b/{PATCHED}\n@@ -1 +1 @@\n"
                                f"-{_round(1)}+{_round(2)}")
    os.rename(releases / ".away", releases / release_a)
    with tmpfs(tmp_path / "full", 1) as full:  # no room to keep what it fetches: said, nothing half-kept
        fill(full)
        cramped = CliRunner().invoke(main, ["--hosts", str(tmp_path / "hosts.yaml"), "--logs-dir", str(full),
                                            "diff", run_a, run_b, "--host", "node"])
        assert cramped.exit_code == 2 and "cannot keep a release file" in cramped.stderr, cramped.stderr
        assert not list(full.glob("releases/*/*"))
    across = _cli(tmp_path, "diff", f"node/{run_a}", f"local/{run_local}")  # the same change, across hosts
    assert across.exit_code == 0 and across.stdout == shown.stdout, across.stderr
    stat = _cli(tmp_path, "diff", f"node/{run_a}", f"node/{run_b}", "--stat")
    assert stat.exit_code == 0, stat.stderr
    assert stat.stdout == f"1\t1\t{PATCHED}\n"
    elsewhere = _cli(tmp_path, "diff", run_a, run_b, "--host", "node", "--", "configs")
    assert elsewhere.exit_code == 0 and elsewhere.stdout == "", elsewhere.stderr
    configs = _cli(tmp_path, "diff", run_a, run_b, "--host", "node", "--config")
    assert configs.exit_code == 0, configs.stderr
    assert [line for line in configs.stdout.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")] \
        == ["-  max_steps: 12", "+  max_steps: 13"]

    listed = _cli(tmp_path, "runs", "--host", "node", "--json")
    assert listed.exit_code == 0, listed.stderr
    runs = {r["run_id"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert runs[run_a]["release_id"] != runs[run_b]["release_id"] == runs[run_c]["release_id"]
    assert runs[run_b]["changed"] == {"since": run_a, "same_release": False, "files": 1, "added": 1,
                                      "removed": 1, "text": f"changed since {run_a}: 1 file (+1 \u22121)"}
    assert runs[run_c]["changed"]["same_release"] is True
    table = _cli(tmp_path, "runs", "--host", "node")
    assert f"changed since {run_a}: 1 file (+1 \u22121)" in table.stderr

    with open(workspace / ".deploy.lock", "a") as lock:  # a deploy installing now
        fcntl.flock(lock, fcntl.LOCK_EX)
        refused = _cli(tmp_path, "gc", "node")
    assert refused.exit_code == 2 and "a deploy is installing" in refused.stderr, refused.stderr
    assert unused_id in _releases(workspace)
    collected = _cli(tmp_path, "gc", "node")
    assert collected.exit_code == 0, collected.stderr
    host, removed, size = collected.stdout.strip().split("\t")
    assert (host, removed) == ("node", unused_id) and int(size) > 0
    assert _releases(workspace) == sorted({runs[run_a]["release_id"], runs[run_b]["release_id"]})
    again = _cli(tmp_path, "gc", "node")
    assert again.exit_code == 0 and again.stdout == "", again.stderr


def test_binary_files_are_said_to_differ():
    change = FileChange("configs/blob.bin", None, None)
    binary = file_diff(change, b"\0\1", b"\0\2", ("a/x", "b/x"))
    assert (binary.text, binary.compared) == ("Files a/x and b/x differ (binary)\n", False)


def _git(root, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_a_release_holds_what_git_would_commit_minus_dflashignore(tmp_path):
    project = copy_release_dirs(tmp_path / "p")
    (project / ".gitignore").write_text("configs/datasets/\n*.tmp\n")
    (project / "configs" / ".gitignore").write_text("!keep.tmp\n")  # the deepest file decides
    (project / "configs" / "datasets").mkdir()
    with open(project / "configs" / "datasets" / "big.bin", "wb") as fh:
        fh.truncate(300 << 20)
    (project / "configs" / "datasets" / "tracked.txt").write_text("tracked though ignored\n")
    (project / "configs" / "notes.tmp").write_text("scratch\n")
    (project / "configs" / "keep.tmp").write_text("kept\n")
    (project / ".dflashignore").write_text("configs/train/qwen3-8b-4gpu.yaml\n")
    _git(project, "init", "-q")
    _git(project, "add", "-A")
    _git(project, "add", "-f", "configs/datasets/tracked.txt")
    _git(project, "commit", "-q", "-m", "tree")
    (project / "configs" / "new.yaml").write_text("untracked, not ignored\n")

    in_git = {f.path for f in release.scan(project).files}
    for path in ("remote/agent.py", "configs/keep.tmp", "configs/new.yaml", "configs/datasets/tracked.txt"):
        assert path in in_git
    for path in ("configs/datasets/big.bin", "configs/notes.tmp", "configs/train/qwen3-8b-4gpu.yaml"):
        assert path not in in_git
    shutil.rmtree(project / ".git")  # the same tree outside git: its .gitignore files decide
    assert {f.path for f in release.scan(project).files} == in_git - {"configs/datasets/tracked.txt"}


def test_large_files_ignored_stay_tracked_stop_the_deploy(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    project = copy_release_dirs(tmp_path / "p")
    (project / ".gitignore").write_text("*.bin\n")
    with open(project / "configs" / "ignored.bin", "wb") as fh:
        fh.truncate(300 << 20)
    sent = dflash("deploy", "node", "--source", str(project), hosts=hosts, cwd=tmp_path)
    assert sent.returncode == 0, sent.stderr
    current = tmp_path / "node ws" / "current"
    assert (current / "configs" / "train").is_dir() and not (current / "configs" / "ignored.bin").exists()
    installed = os.readlink(current)

    with open(project / "configs" / "dataset.jsonl", "wb") as fh:
        fh.truncate(70 << 20)
    refused = dflash("deploy", "node", "--source", str(project), hosts=hosts, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "configs/dataset.jsonl (70.0 MiB)" in refused.stderr and "nothing was sent" in refused.stderr
    assert "data belongs on the host" in refused.stderr and "--allow-large" in refused.stderr
    assert os.readlink(current) == installed and not any(
        name.startswith(".incoming-") for name in os.listdir(tmp_path / "node ws" / "releases"))


def test_allow_large_sends_a_big_file_in_bounded_memory(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    project = copy_release_dirs(tmp_path / "p")
    size = 256 << 20
    with open(project / "configs" / "dataset.bin", "wb") as fh:
        fh.truncate(size)
    # The deploy runs under a small python that reports its children's peak RSS: a child
    # forked from this test process (hundreds of MiB once torch is loaded) would count
    # those pages until its exec.
    measure = ("import resource, subprocess, sys\n"
               "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
               "sys.exit(code)")
    argv = dflash_argv("deploy", "local", "--source", str(project), "--allow-large", hosts=hosts)
    done = subprocess.run([sys.executable, "-c", measure, *argv], cwd=tmp_path, env=dflash_env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "local ws" / "current" / "configs" / "dataset.bin").stat().st_size == size
    peak_kib = int(done.stdout.split()[-1])
    # ru_maxrss in KiB: the whole file held in memory (a tar built in memory would) exceeds it
    assert peak_kib * 1024 < size // 2, f"peak RSS {peak_kib} KiB"


def test_runs_marks_a_source_with_uncommitted_changes():
    def source(commit, dirty):
        return ReleaseSource(kind="checkout", path="/src", release_id="rel", dflash_version=None,
                             git_commit=commit, dirty=dirty, diff_sha256=None, modified=())

    commit = "1a2b3c4d5e6f"
    assert [source_commit(s) for s in (source(commit, True), source(commit, False),
                                       source(None, None), None)] == ["1a2b3c4*", "1a2b3c4", "-", "-"]
