"""`dflash deploy` starts each host's probe before the CLI's own imports (deploy_early):
what it decides is still made on the tree as hashed after the probe started, and what
it started but the click layer does not take touches nothing on the host."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_cli import cli, deploy_early, probe_cache, release
from dflash_cli.session import Session
from dflash_run import dflash_argv, dflash_env
from support import copy_release_dirs, wait_until, workspace_on_node
from support.import_gate import finish, gated_import
from support.wait import FIRST_INTERVAL_S


def marking_python(tmp_path: Path) -> Path:
    """An interpreter for the host that creates tmp_path/'receiver started' as it starts."""
    python = tmp_path / "python-marking"
    python.write_text(f"#!/bin/sh\ntouch {shlex.quote(str(tmp_path / 'receiver started'))}\n"
                      f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    return python


def project_on_ct200(make_inventory, tmp_path: Path, deployed: bool) -> tuple[Path, Path, str | None]:
    """(inventory, a copy of the project, the release id ct200 has of it, if `deployed`);
    ct200's interpreter marks its start (marking_python)."""
    hosts = make_inventory(tmp_path, ct200={"python": str(marking_python(tmp_path))})
    project = copy_release_dirs(tmp_path / "p")
    if not deployed:
        return hosts, project, None
    first = subprocess.run(dflash_argv("deploy", "ct200", "--source", str(project), hosts=hosts),
                           capture_output=True, text=True, env=dflash_env())
    assert first.returncode == 0, first.stderr
    (tmp_path / "receiver started").unlink()
    return hosts, project, first.stdout.split()[1]


def gated_deploy(tmp_path: Path, hosts: Path, project: Path) -> tuple[subprocess.Popen[str], Path]:
    """`dflash deploy ct200 --source PROJECT` with its click import held until the test
    creates the returned gate file; returns once the probe's receiver started on ct200,
    which this deploy starts once the tree is listed: it has a cache folder of its own, so
    no command line kept by an earlier deploy starts a probe before that (probe_cache)."""
    gate, variables = gated_import(tmp_path, "click")  # the CLI imports click only after the early start
    env = dflash_env({**variables, "XDG_CACHE_HOME": str(tmp_path / "no kept probes")})
    proc = subprocess.Popen(dflash_argv("deploy", "ct200", "--source", str(project), hosts=hosts),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_until((tmp_path / "receiver started").exists, what="the probe's receiver to start",
               interval=FIRST_INTERVAL_S)
    return proc, gate


def test_the_probe_is_on_the_host_before_the_cli_imports_click(make_inventory, tmp_path):
    hosts, project, _ = project_on_ct200(make_inventory, tmp_path, deployed=False)
    proc, gate = gated_deploy(tmp_path, hosts, project)
    gate.touch()
    code, out, err = finish(proc)
    assert code == 0, err
    assert out == f"ct200\t{release.scan(project).release_id}\tinstalled\n"


def test_a_file_changed_after_the_probe_started_is_what_is_deployed(make_inventory, fake_pve, tmp_path):
    hosts, project, first_id = project_on_ct200(make_inventory, tmp_path, deployed=True)
    proc, gate = gated_deploy(tmp_path, hosts, project)
    # Listed before the probe started; changed now, to the same size and mtime: only the
    # content, hashed after this, can tell.
    config = project / "configs" / "hosts.yaml"
    before = config.stat()
    text = config.read_text()
    config.write_text(text[:-2] + ("x" if text[-2] != "x" else "y") + text[-1])
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))
    gate.touch()
    code, out, err = finish(proc)
    assert code == 0, err
    changed_id = release.scan(project).release_id
    assert out == f"ct200\t{changed_id}\tinstalled\n" and changed_id != first_id
    current = workspace_on_node(fake_pve, tmp_path) / "current"
    assert (current / "configs" / "hosts.yaml").read_text() == config.read_text()


def test_a_file_removed_after_it_was_listed_is_an_error_and_changes_nothing(make_inventory, fake_pve, tmp_path):
    hosts, project, first_id = project_on_ct200(make_inventory, tmp_path, deployed=True)
    releases = workspace_on_node(fake_pve, tmp_path) / "releases"
    before = sorted(os.listdir(releases))
    proc, gate = gated_deploy(tmp_path, hosts, project)
    (project / "configs" / "hosts.yaml").unlink()
    gate.touch()
    code, out, err = finish(proc)
    assert code == 2 and out == "", err
    assert "cannot read configs/hosts.yaml" in err and "Traceback" not in err
    assert sorted(os.listdir(releases)) == before
    assert os.readlink(releases.parent / "current") == f"releases/{first_id}"


def test_what_the_click_layer_does_not_take_is_abandoned_untouched(make_inventory, fake_pve, tmp_path):
    hosts = make_inventory(tmp_path)
    logs = tmp_path / "logs"
    workspace = workspace_on_node(fake_pve, tmp_path)
    argv = ["--hosts", str(hosts), "--logs-dir", str(logs), "deploy", "ct200"]
    try:
        assert deploy_early.start(argv)
        early = deploy_early._started.session
        assert early.transport(early.host("ct200")).round_trips == 1  # the probe is on its way
        other = deploy_early.session(str(hosts), tmp_path / "other logs", False, None)
        assert other is not early and deploy_early._started is None
        assert not workspace.exists(), "the abandoned receiver looked at nothing"

        assert deploy_early.start(argv)
        session = deploy_early.session(str(hosts), logs, False, None)
        assert session is deploy_early._started.session
        assert deploy_early.claim(session, ["ct200"], True, None, False) is None  # --verify: another deploy
        assert not workspace.exists()
        session.close()
    finally:
        deploy_early.abandon()


@pytest.mark.parametrize("argv", [
    ["deploy", "ct200"],
    ["--hosts", "h.yaml", "--logs-dir=l", "--accept-new-host-key", "deploy", "--verify", "a", "b"],
    ["--hosts=h.yaml", "--cli-config", "c.yaml", "deploy", "a", "--source", "src", "--allow-large"],
    ["deploy", "--all", "--source=src"],
])
def test_the_early_parser_reads_a_deploy_as_click_does(argv):
    options, names = probe_cache.parse(argv)
    verb = argv.index("deploy")
    group = cli.main.make_context("dflash", argv[:verb], resilient_parsing=True)
    command = cli.main.get_command(group, "deploy").make_context("deploy", argv[verb + 1:], parent=group)
    assert names == list(command.params["host_names"])
    clicked = {**group.params, **command.params}
    for key, value in options.items():
        assert clicked[key] == (Path(value) if key == "source_dir" else value), key
    for key in ("verify", "all_hosts", "allow_large", "accept_new_host_key"):
        assert clicked[key] == options.get(key, False), key


@pytest.mark.parametrize("argv", [
    [], ["status"], ["launch", "ct200"], ["--version"], ["deploy", "--help"], ["-h", "deploy", "a"],
    ["deploy", "a", "--source"], ["--hosts"], ["deploy", "a", "--no-such-option"], ["deploy", "a", "--"],
])
def test_the_early_parser_starts_nothing_for_any_other_command_line(argv):
    assert probe_cache.parse(argv) is None


def test_a_session_made_early_is_made_as_the_click_layer_makes_it(make_inventory, tmp_path, monkeypatch):
    hosts = make_inventory(tmp_path)
    monkeypatch.setenv("DFLASH_HOSTS", str(hosts))
    monkeypatch.setenv("DFLASH_LOGS", str(tmp_path / "env logs"))
    try:
        assert deploy_early.start(["deploy", "local"])
        early = deploy_early._started.session
        assert isinstance(early, Session)
        assert (early.hosts_file, early.logs_dir) == (str(hosts), tmp_path / "env logs")
    finally:
        deploy_early.abandon()


def test_a_host_whose_options_cannot_be_resolved_fails_alone(make_inventory, tmp_path):
    # its `ssh -G` runs while the tree is listed; its failure is that host's row, as before
    odd = {**yaml.safe_load(make_inventory(tmp_path).read_text())["hosts"]["ct200"], "ssh": "root@bad;host"}
    hosts = make_inventory(tmp_path, odd=odd)
    done = subprocess.run(dflash_argv("deploy", "ct200", "odd", hosts=hosts), capture_output=True, text=True,
                          env=dflash_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == f"ct200\t{release.scan().release_id}\tinstalled\n"
    # the table's cells as one line: where the row wraps depends on the length of the test's paths
    cells = " ".join(re.sub("[│┃]", " ", done.stderr).split())
    assert re.search(r"odd failed: `ssh -G .*bad;host` failed: hostname contains invalid", cells), done.stderr
