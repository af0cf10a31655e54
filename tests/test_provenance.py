"""Which tree `deploy` and `launch` send, and the provenance a run records: the project
tree holding the current directory, --source DIR, or the copy a wheel ships; its git
commit and uncommitted changes in the `source:` line, run.json and `status`."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from dflash_cli import DISTRIBUTION, provenance, release
from dflash_run import REPO, dflash, dflash_env
from support import copy_release_dirs, workspace_on_node
from support.checkout import build_wheel
from support.inventory import HOST_ENV
from support.train_configs import small_config

PATCHED = "remote/dflash_train/__init__.py"
UNTRACKED = "remote/dflash_train/NOTES.txt"
MODIFIED = sorted([PATCHED, UNTRACKED])
#: the patched trainer ends at once, so a launched run shows which code ran in seconds
PATCH = "raise SystemExit('patched trainer: stopping before training')\n"


@pytest.fixture
def hosts(tmp_path) -> Path:
    """An inventory with only `local`, its workspace under tmp_path."""
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"local": {
        "transport": "local", "workspace": str(tmp_path / "ws"), "python": sys.executable,
        "env": dict(HOST_ENV)}}}))
    return path


def git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True).stdout


def patched_project(dest: Path) -> tuple[Path, str]:
    """A project tree elsewhere: a git repository with one commit, then a patched
    tracked file and a new untracked one. Returns its path and the commit."""
    copy_release_dirs(dest)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "the code as released")
    patched = dest / PATCHED
    patched.write_text(PATCH + patched.read_text())
    (dest / UNTRACKED).write_text("what the patch is for\n")
    return dest.resolve(), git(dest, "rev-parse", "HEAD").decode().strip()


def expected_diff_sha256(project: Path) -> str:
    """The documented recipe (docs/releases.md, "Source tree and provenance"): `git diff HEAD
    --binary -- remote configs`, then NUL path NUL sha256 of each deployed file git does not track."""
    digest = hashlib.sha256(git(project, "diff", "HEAD", "--binary", "--", "remote", "configs"))
    untracked_sha = hashlib.sha256((project / UNTRACKED).read_bytes()).hexdigest()
    digest.update(b"\0" + UNTRACKED.encode() + b"\0" + untracked_sha.encode())
    return digest.hexdigest()


def deployed(done: subprocess.CompletedProcess[str]) -> str:
    """The release id `deploy local` printed."""
    assert done.returncode == 0, done.stderr
    host, release_id, _ = done.stdout.strip().split("\t")
    assert host == "local"
    return release_id


def source_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("source: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_deploy_sends_the_project_tree_holding_the_current_directory(hosts, tmp_path):
    project, commit = patched_project(tmp_path / "my project")
    done = dflash("deploy", "local", hosts=hosts, cwd=project / "remote" / "dflash_train")
    release_id = deployed(done)
    assert release_id == release.scan(project).release_id != release.scan(REPO).release_id
    on_host = tmp_path / "ws" / "current"
    assert (on_host / PATCHED).read_text() == (project / PATCHED).read_text()
    assert (on_host / UNTRACKED).exists()
    assert source_line(done) == (
        f"source: {project} (git {commit[:7]}, modified: 2 files [{', '.join(MODIFIED)}], "
        f"diff sha256 {expected_diff_sha256(project)[:12]})")

    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "the patch")
    again = dflash("deploy", "local", hosts=hosts, cwd=project)
    assert deployed(again) == release_id  # same files, now committed
    assert source_line(again) == f"source: {project} (git {git(project, 'rev-parse', 'HEAD').decode()[:7]}, clean)"


@pytest.mark.slow(seconds=10, why="a patched trainer launched over pct")
def test_launch_records_the_source_in_run_json_and_status_shows_it(make_inventory, fake_pve, tmp_path):
    """Over the pct hop, from a project whose path holds a space and a quote: the
    source travels to the agent as one argument, intact."""
    hosts = make_inventory(tmp_path)
    project, commit = patched_project(tmp_path / "it's my project")
    config = small_config(tmp_path / "cfg.yaml")
    launched = dflash("launch", "ct200", "--config", str(config), "--follow", hosts=hosts, cwd=project)
    assert launched.returncode == 1, launched.stderr  # the patched trainer ran, and stopped
    assert "patched trainer: stopping before training" in launched.stdout
    run_id = launched.stdout.splitlines()[0]
    release_id = release.scan(project).release_id
    source = {"kind": "checkout", "path": str(project), "release_id": release_id,
              "git_commit": commit, "dirty": True, "diff_sha256": expected_diff_sha256(project),
              "modified": MODIFIED, "modified_count": 2, "git_problem": None}
    launch_line = source_line(launched)
    run_json = json.loads(workspace_on_node(fake_pve, tmp_path).joinpath("runs", run_id, "run.json").read_text())
    assert {k: run_json["source"][k] for k in source} == source
    assert run_json["release_id"] == release_id

    as_json = dflash("status", run_id, "--host", "ct200", "--json", hosts=hosts, cwd=tmp_path)
    status = json.loads(as_json.stdout)
    assert status["source"] == run_json["source"]
    shown = dflash("status", run_id, "--host", "ct200", hosts=hosts, cwd=tmp_path)
    assert shown.stdout == "FAILED\n"
    assert source_line(shown) == launch_line
    assert launch_line.startswith(f"source: {project} (git {commit[:7]}, modified: 2 files")


def test_dflash_version_is_looked_up_for_a_kept_record_or_a_line_that_shows_it():
    from importlib import metadata

    tree = release.scan(REPO)
    checkout, bundled = release.SourceTree(REPO, "checkout"), release.SourceTree(REPO, "bundled")
    installed = metadata.version(DISTRIBUTION)
    assert provenance.describe(checkout, tree).dflash_version == installed  # launch keeps it in run.json
    assert provenance.describe(checkout, tree, version=False).dflash_version is None  # deploy's line
    shown = provenance.describe(bundled, tree, version=False)
    assert shown.dflash_version == installed
    assert provenance.summary(shown).startswith(f"bundled with dflash {installed} ")


def test_a_tree_inside_a_larger_repository_counts_the_untracked_files_it_deploys(tmp_path):
    repo = tmp_path / "mono"
    tree = copy_release_dirs(repo / "vendor" / "dflash")
    (repo / ".gitignore").write_text("secret.yaml\n__pycache__/\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "vendored")
    (tree / "configs" / "secret.yaml").write_text("token: 1\n")  # ignored by git: not deployed
    (tree / "configs" / "notes.yaml").write_text("a: 1\n")  # untracked, not ignored: deployed, counted
    (tree / "remote" / "dflash_agent" / "__pycache__").mkdir(exist_ok=True)
    (tree / "remote" / "dflash_agent" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")  # neither

    source = release.find_source(cwd=tree / "configs")
    assert source == release.SourceTree(tree.resolve(), "checkout")
    scanned = release.scan(source.root)
    assert "configs/secret.yaml" not in {f.path for f in scanned.files}
    facts = provenance.describe(source, scanned)
    assert facts.modified == ("configs/notes.yaml",) and facts.dirty is True
    assert facts.git_commit == git(repo, "rev-parse", "HEAD").decode().strip()
    sha = hashlib.sha256(b"a: 1\n").hexdigest()
    assert facts.diff_sha256 == hashlib.sha256(b"\0configs/notes.yaml\0" + sha.encode()).hexdigest()

    # The same tree where git ignores remote/agent.py too (a copy inside an ignored
    # folder, as a wheel's in a venv): that repository's commit says nothing about it.
    (repo / ".gitignore").write_text("vendor/\n")
    git(repo, "rm", "-r", "-q", "--cached", "vendor")
    git(repo, "commit", "-q", "-m", "unvendored")
    facts = provenance.describe(source, scanned)
    assert (facts.git_commit, facts.dirty, facts.git_problem) == (None, None, "not a git checkout")


def test_without_git_the_source_says_so(tmp_path, monkeypatch):
    project, _ = patched_project(tmp_path / "proj")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a PATH with no git on it
    source = release.find_source(cwd=project)
    facts = provenance.describe(source, release.scan(source.root))
    assert (facts.git_commit, facts.dirty, facts.git_problem) == (None, None, "git not found")
    assert provenance.summary(facts) == f"{project} (git not found)"


def test_source_option_names_the_tree_and_a_bad_one_is_refused(hosts, tmp_path):
    plain = copy_release_dirs(tmp_path / "plain copy")  # no git here
    (plain / "configs" / "mine.yaml").write_text("a: 1\n")
    done = dflash("deploy", "local", "--source", str(plain), hosts=hosts, cwd=REPO)  # --source wins over the cwd
    assert deployed(done) == release.scan(plain).release_id != release.scan(REPO).release_id
    assert source_line(done) == f"source: {plain.resolve()} (not a git checkout)"

    config = small_config(tmp_path / "cfg.yaml")
    for command in (["deploy", "local"], ["launch", "local", "--config", str(config)]):
        missing = dflash(*command, "--source", str(tmp_path / "nowhere"), hosts=hosts, cwd=tmp_path)
        assert missing.returncode == 2 and missing.stdout == ""
        assert f"--source {tmp_path / 'nowhere'}: no such directory" in missing.stderr
        not_tree = dflash(*command, "--source", str(plain / "configs"), hosts=hosts, cwd=tmp_path)
        assert not_tree.returncode == 2 and not_tree.stdout == ""
        assert (f"--source {plain / 'configs'}: not a dflash project tree "
                "(it needs remote/agent.py and remote/dflash_agent/__init__.py)") in not_tree.stderr
    current = os.readlink(tmp_path / "ws" / "current")
    assert current == f"releases/{release.scan(plain).release_id}", "the refused commands changed nothing"


@pytest.fixture
def installed_wheel(tmp_path) -> Path:
    """dflash built as a wheel from a copy of this checkout (offline, no build
    isolation) and installed, not editable, into a fresh venv; returns its `dflash`.
    The venv reaches this interpreter's packages (click, fabric, …) through a .pth
    written after the install, so pip never sees the editable dflash there."""
    env = {k: v for k, v in dflash_env().items() if k != "PYTHONPATH"}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    venv = tmp_path / "venv"

    def run(*argv: str) -> str:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    wheel = build_wheel(tmp_path)
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    run(*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", "-q", str(wheel))
    site = run(str(venv / "bin" / "python"), "-c",
               "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    Path(site, "outer-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "dflash"


@pytest.mark.slow(seconds=9, why="builds a wheel of the project and installs it into a virtualenv")
def test_a_wheel_install_deploys_its_bundled_copy_or_the_project_tree(installed_wheel, hosts, tmp_path):
    env = {k: v for k, v in dflash_env().items() if k != "PYTHONPATH"}  # the installed dflash, nothing else

    def installed(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(installed_wheel), "--hosts", str(hosts), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bundled = installed("deploy", "local", cwd=elsewhere)
    assert deployed(bundled) == release.scan(REPO).release_id  # the same files, the same id
    line = source_line(bundled)
    assert line.startswith("source: bundled with dflash 0.1.0 (")
    assert line.endswith("site-packages/dflash_cli/_release, not a git checkout)")
    assert str(tmp_path / "venv") in line

    api = subprocess.run([str(installed_wheel.parent / "python"), "-c", "import dflash_trainer; print(dflash_trainer.__file__)"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert api.returncode == 0, api.stderr
    assert api.stdout.startswith(str(tmp_path / "venv")), api.stdout  # the wheel's Python API, not a checkout's

    project, commit = patched_project(tmp_path / "proj")
    inside = installed("deploy", "local", cwd=project / "configs")
    assert deployed(inside) == release.scan(project).release_id
    assert source_line(inside).startswith(f"source: {project} (git {commit[:7]}, modified: 2 files")


def test_a_large_patch_is_counted_whole_and_listed_in_part(tmp_path):
    """run.json's source travels as one argument: its path list is capped, the count
    and the diff hash are not."""
    project, _ = patched_project(tmp_path / "proj")
    many = project / "configs" / "many"
    many.mkdir()
    for i in range(provenance.MODIFIED_LISTED + 50):
        (many / f"{i:04d}.yaml").write_text(f"i: {i}\n")
    source = release.find_source(cwd=project)
    facts = provenance.describe(source, release.scan(source.root))
    assert facts.modified_count == provenance.MODIFIED_LISTED + 52
    assert list(facts.modified) == sorted(facts.modified) and len(facts.modified) == provenance.MODIFIED_LISTED
    assert f"modified: {provenance.MODIFIED_LISTED + 52} files [configs/many/0000.yaml, " in provenance.summary(facts)
    (many / "0249.yaml").write_text("i: changed\n")  # beyond the listed paths, still in the hash
    assert provenance.describe(source, release.scan(source.root)).diff_sha256 != facts.diff_sha256
