"""An installed release is never written to: no bytecode, no shared inode, read-only
bits; an edit made on the host anyway is found (hosts --check, deploy) and repaired
with a fresh copy, never by writing into a release."""
from __future__ import annotations

import json
import os
import py_compile
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_cli import deployment, host_scripts, release
from dflash_cli.session import Session
from dflash_run import dflash
from support import copy_release_dirs, wait_until, workspace_on_node
from support.train_configs import small_config

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def session(make_inventory, tmp_path):
    s = Session(str(make_inventory(tmp_path)), tmp_path / "logs")
    yield s
    s.close()


def releases_on_node(fake_pve, tmp_path) -> Path:
    return workspace_on_node(fake_pve, tmp_path) / "releases"


def files_under(folder: Path) -> list[Path]:
    return [Path(d) / name for d, _, names in os.walk(folder) for name in names]


def test_releases_are_read_only_and_share_no_inode(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    deployment.deploy_host(session, host, tree)
    changed_root = copy_release_dirs(tmp_path / "checkout")
    config = changed_root / "configs" / "hosts.yaml"
    config.write_text(config.read_text() + "# one more line\n")
    changed = release.scan(changed_root)
    result = deployment.deploy_host(session, host, changed)
    assert (result.status, result.files_sent) == ("installed", 1)

    releases = releases_on_node(fake_pve, tmp_path)
    old, new = releases / tree.release_id, releases / changed.release_id
    inodes = {folder: {p.stat().st_ino for p in files_under(folder)} for folder in (old, new)}
    assert not inodes[old] & inodes[new], "a file shared by two releases changes with either"
    for folder in (old, new):
        for dirpath, _, names in os.walk(folder):
            assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o555, dirpath
            for name in names:
                assert stat.S_IMODE(os.stat(Path(dirpath) / name).st_mode) in (0o444, 0o555), name
    # Appending to a file of the current release leaves the older release as it was.
    with open(new / "remote" / "agent.py", "a") as fh:
        fh.write("raise SystemExit('edited on the host')\n")
    assert (old / "remote" / "agent.py").read_bytes() == (changed_root / "remote" / "agent.py").read_bytes()


@pytest.mark.slow(seconds=41, why="deploys, and a trainer run over pct")
def test_an_edited_release_is_reported_then_replaced_by_a_fresh_copy(make_inventory, fake_pve, tmp_path):
    hosts = make_inventory(tmp_path, ct201=None, ct999=None, down=None)
    tree_id = release.scan().release_id
    assert dflash("deploy", "ct200", hosts=hosts).returncode == 0
    folder = releases_on_node(fake_pve, tmp_path) / tree_id
    edited = folder / "remote" / "dflash_agent" / "report.py"
    with open(edited, "a") as fh:  # root writes through read-only bits
        fh.write("# edited on the host\n")

    checked = dflash("hosts", "--check", "--json", "ct200", "node", hosts=hosts)
    assert checked.returncode == 2, checked.stderr
    entries = {e["host"]: e for e in map(json.loads, checked.stdout.splitlines())}
    assert entries["ct200"]["release_modified"] == ["remote/dflash_agent/report.py: changed since install"]
    assert entries["node"]["release_modified"] == []
    table = dflash("hosts", "--check", "ct200", hosts=hosts)  # --json draws no table
    assert table.returncode == 2 and "release modified" in table.stderr and "report.py" in table.stderr

    done = dflash("deploy", "ct200", hosts=hosts)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"ct200\t{tree_id}\trepaired\n"
    assert "report.py: changed since install" in done.stderr
    assert edited.read_bytes() == (release.project_root() / "remote" / "dflash_agent" / "report.py").read_bytes()
    (aside,) = [p for p in folder.parent.iterdir() if p.name.startswith(f".modified-{tree_id}-")]
    assert (aside / "remote" / "dflash_agent" / "report.py").read_text().endswith("# edited on the host\n")
    assert os.readlink(folder.parent.parent / "current") == f"releases/{tree_id}"
    again = dflash("hosts", "--check", "--json", "ct200", hosts=hosts)
    assert again.returncode == 0, again.stderr
    assert dflash("deploy", "ct200", hosts=hosts).stdout == f"ct200\t{tree_id}\tunchanged\n"


def test_deploy_verify_rehashes_what_the_cheap_check_cannot_see(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    deployment.deploy_host(session, host, tree)
    folder = releases_on_node(fake_pve, tmp_path) / tree.release_id
    edited = folder / "configs" / "hosts.yaml"
    original = edited.read_bytes()
    edited.write_bytes(original.replace(b"#", b"!", 1))  # same size
    # An edit whose record was made to match: only re-hashing finds it.
    record_path = folder / "INSTALLED"
    record = json.loads(record_path.read_text())
    st = edited.stat()
    record["files"]["configs/hosts.yaml"] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    record_path.write_text(json.dumps(record))
    assert deployment.deploy_host(session, host, tree).status == "unchanged"
    result = deployment.deploy_host(session, host, tree, verify=True)
    assert result.status == "repaired"
    assert result.modified == ("configs/hosts.yaml: content differs from MANIFEST",)
    assert result.files_sent == 1  # the intact files were copied on the host
    assert edited.read_bytes() == original


def _truncated_pyc(source: Path, into: Path) -> None:
    """A .pyc of `source` with a valid header (Python trusts it) and its body cut short,
    as a full disk leaves it."""
    compiled = into.parent / "whole.pyc"
    py_compile.compile(str(source), cfile=str(compiled), doraise=True)
    data = compiled.read_bytes()
    compiled.unlink()
    into.parent.mkdir(exist_ok=True)
    into.write_bytes(data[: 16 + (len(data) - 16) // 3])


def test_a_truncated_pyc_in_a_release_is_repaired_by_deploy(make_inventory, fake_pve, tmp_path):
    hosts = make_inventory(tmp_path)
    tree_id = release.scan().release_id
    assert dflash("deploy", "ct200", hosts=hosts).returncode == 0
    package = releases_on_node(fake_pve, tmp_path) / tree_id / "remote" / "dflash_agent"
    os.chmod(package, 0o755)  # as a release installed before releases were read-only
    _truncated_pyc(package / "cli.py", package / "__pycache__" / f"cli.{sys.implementation.cache_tag}.pyc")
    broken = dflash("runs", "--host", "ct200", hosts=hosts)
    # Where the cut falls (a third of cli.py's code, which changes with cli.py) decides
    # which of marshal's three words for a cut-short stream it gives.
    assert broken.returncode == 3 and any(words in broken.stderr for words in (
        "marshal data too short", "EOF read where object expected", "EOF read where not expected")), broken.stderr

    done = dflash("deploy", "ct200", hosts=hosts)
    assert (done.returncode, done.stdout) == (0, f"ct200\t{tree_id}\trepaired\n"), done.stderr
    assert "__pycache__" in done.stderr and "not in MANIFEST" in done.stderr
    works = dflash("runs", "--host", "ct200", hosts=hosts)
    assert works.returncode == 0, works.stderr


@pytest.mark.slow(seconds=33, why="deploy, launch and a whole trainer run over pct")
def test_no_bytecode_is_written_into_a_release_by_deploy_launch_and_a_run(make_inventory, fake_pve, tmp_path):
    hosts = make_inventory(tmp_path)
    config = small_config(tmp_path / "small.yaml")
    done = dflash("--logs-dir", str(tmp_path / "logs"), "launch", "ct200", "--config", str(config),
                  "--follow", hosts=hosts)
    assert done.returncode == 0, done.stderr
    assert dflash("runs", "--host", "ct200", hosts=hosts).returncode == 0
    releases = releases_on_node(fake_pve, tmp_path)
    cached = [p for p in files_under(releases) if "__pycache__" in p.parts or p.suffix == ".pyc"]
    assert cached == []
    assert dflash("hosts", "--check", "ct200", hosts=hosts).returncode == 0


def state(status) -> str:
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)["state"]


@pytest.mark.slow(seconds=24, why="a trainer run over pct kept running while its release is repaired")
def test_repairing_the_release_of_a_running_run_leaves_the_run_alone(make_inventory, fake_pve, tmp_path):
    hosts = make_inventory(tmp_path)
    logs = ("--logs-dir", str(tmp_path / "logs"))
    config = small_config(tmp_path / "hang.yaml", faults=[{"thread": "drafter-0", "at": "step:2", "kind": "hang"}])
    launched = dflash(*logs, "launch", "ct200", "--config", str(config), hosts=hosts)
    assert launched.returncode == 0, launched.stderr
    run_id = launched.stdout.strip()
    run_dir = workspace_on_node(fake_pve, tmp_path) / "runs" / run_id
    wait_until(lambda: state(dflash(*logs, "status", "--json", hosts=hosts)) == "RUNNING", 240,
               "the run to get to RUNNING (past its imports)", interval=0.5)
    folder = releases_on_node(fake_pve, tmp_path) / release.scan().release_id
    with open(folder / "configs" / "hosts.yaml", "a") as fh:
        fh.write("# edited on the host\n")

    repaired = dflash("deploy", "ct200", hosts=hosts)
    assert repaired.returncode == 0 and repaired.stdout.endswith("\trepaired\n"), repaired.stderr
    assert state(dflash(*logs, "status", "--json", hosts=hosts)) == "RUNNING"
    # The path the run resolved at launch holds the release as deployed.
    assert json.loads((run_dir / "run.json").read_text())["release_dir"].endswith(folder.name)
    assert (folder / "configs" / "hosts.yaml").read_bytes() == (release.project_root() / "configs" / "hosts.yaml").read_bytes()
    stopped = dflash(*logs, "stop", "--grace", "2", hosts=hosts)
    assert (stopped.returncode, stopped.stdout.strip()) == (0, "STOPPED"), stopped.stderr


def test_a_release_with_a_file_gone_or_its_record_cut_short_is_not_unchanged(session, tmp_path):
    host = session.host("local")
    project = copy_release_dirs(tmp_path / "p")
    tree = release.scan(project)
    deployment.deploy_host(session, host, tree)
    folder = tmp_path / "local ws" / "releases" / tree.release_id
    gone = folder / "configs" / "hosts.yaml"
    os.chmod(gone.parent, 0o755)
    gone.unlink()  # as an install cut short by hand would leave it
    os.chmod(gone.parent, 0o555)
    result = deployment.deploy_host(session, host, tree)
    assert (result.status, result.modified) == ("repaired", ("configs/hosts.yaml: missing",))

    folder = tmp_path / "local ws" / "releases" / tree.release_id
    record = folder / "INSTALLED"
    os.chmod(folder, 0o755)
    os.chmod(record, 0o644)
    record.write_bytes(record.read_bytes()[:-40])  # half written
    with open(folder / "remote" / "agent.py", "ab") as fh:  # and a file edited
        fh.write(b"# edited\n")
    result = deployment.deploy_host(session, host, tree)
    assert (result.status, result.modified) == ("repaired", ("remote/agent.py: content differs from MANIFEST",))


def test_paths_json_escapes_are_checked_as_plain_ones_are(session, tmp_path):
    host = session.host("local")
    project = copy_release_dirs(tmp_path / "p")
    odd = project / "configs" / 'naïve "quoted" \\ name.yaml'
    odd.write_text("a: 1\n")
    tree = release.scan(project)
    assert deployment.deploy_host(session, host, tree).status == "installed"
    assert deployment.deploy_host(session, host, tree).status == "unchanged"
    installed = tmp_path / "local ws" / "releases" / tree.release_id / "configs" / odd.name
    with open(installed, "a") as fh:  # root writes through read-only bits
        fh.write("b: 2\n")
    result = deployment.deploy_host(session, host, tree)
    assert (result.status, result.modified) == ("repaired", (f"configs/{odd.name}: changed since install",))


def test_an_unchanged_probe_answers_one_json_line_saying_so(session, tmp_path):
    host = session.host("local")
    tree = release.scan()
    deployment.deploy_host(session, host, tree)
    probe = subprocess.run([sys.executable, "-S", "-c", host_scripts.source("deploy_receiver.py"), "probe",
                            host.workspace, tree.release_id, "cheap"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.count("\n") == 1
    assert json.loads(probe.stdout) == {"status": "unchanged", "release_id": tree.release_id}
