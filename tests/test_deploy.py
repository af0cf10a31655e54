"""dflash deploy over the real transports: content-addressed, verified, atomic."""
from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

import pytest
import yaml

from dflash_cli import deployment, release
from dflash_cli.errors import DflashError
from dflash_cli.session import Session
from dflash_run import REPO, dflash, dflash_argv, dflash_env, dflash_in_process
from support import container_workspace, copy_release_dirs, kill_ssh_sessions, wait_until, workspace_on_node
from support.hash_gate import finish, held_dflash_argv
from support.train_configs import small_config
from support.wait import FIRST_INTERVAL_S


@pytest.fixture
def session(make_inventory, tmp_path):
    s = Session(str(make_inventory(tmp_path)), tmp_path / "logs")
    yield s
    s.close()


def node_path(fake_pve, tmp_path, *parts) -> Path:
    """A path inside container 200's workspace, as seen from the node (for checking)."""
    return workspace_on_node(fake_pve, tmp_path).joinpath(*parts)


def test_fresh_then_unchanged_then_one_changed_file_over_pct(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    first = deployment.deploy_host(session, host, tree)
    assert first.status == "installed" and first.files_sent == len(tree.files)
    current = node_path(fake_pve, tmp_path, "current")
    assert os.readlink(current) == f"releases/{tree.release_id}"
    assert (current / "MANIFEST").read_text() == tree.manifest_text
    assert (current / "remote" / "agent.py").read_bytes() == (REPO / "remote" / "agent.py").read_bytes()

    again = deployment.deploy_host(session, host, tree)
    assert (again.status, again.round_trips, again.bytes_sent) == ("unchanged", 1, 0)

    changed_root = copy_release_dirs(tmp_path / "checkout")
    config = changed_root / "configs" / "hosts.yaml"
    config.write_text(config.read_text() + "# one more line\n")
    changed = release.scan(changed_root)
    assert changed.release_id != tree.release_id
    result = deployment.deploy_host(session, host, changed)
    assert (result.status, result.files_sent, result.files_reused) == ("installed", 1, len(tree.files) - 1)
    assert result.bytes_sent < tree.total_bytes / 4
    assert os.readlink(current) == f"releases/{changed.release_id}"
    # The previous release is untouched: still complete and still verifiable.
    old = node_path(fake_pve, tmp_path, "releases", tree.release_id)
    assert (old / "MANIFEST").read_text() == tree.manifest_text
    assert "one more line" not in (old / "configs" / "hosts.yaml").read_text()

    # Going back to a release the host already has only moves `current`.
    back = deployment.deploy_host(session, host, tree)
    assert (back.status, back.round_trips) == ("switched", 1)
    assert os.readlink(current) == f"releases/{tree.release_id}"


def test_a_mode_only_change_leaves_the_older_release_as_it_was(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    deployment.deploy_host(session, host, tree)
    changed_root = copy_release_dirs(tmp_path / "checkout")
    (changed_root / "configs" / "hosts.yaml").chmod(0o755)  # same bytes, now executable
    changed = release.scan(changed_root)
    result = deployment.deploy_host(session, host, changed)
    assert (result.status, result.files_sent) == ("installed", 0)  # nothing new to send

    def mode(release_id: str) -> int:
        return node_path(fake_pve, tmp_path, "releases", release_id, "configs", "hosts.yaml").stat().st_mode & 0o777

    assert mode(changed.release_id) == 0o555
    assert mode(tree.release_id) == 0o444  # a shared inode would have turned this one executable too


def test_interrupted_or_corrupt_deploy_leaves_current_release(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    deployment.deploy_host(session, host, tree)
    changed_root = copy_release_dirs(tmp_path / "checkout")
    (changed_root / "configs" / "extra.yaml").write_text("a: 1\n")
    changed = release.scan(changed_root)
    payload = changed.tar_stream({"configs/extra.yaml"}).read()

    with pytest.raises(DflashError, match="previous release stays current"):
        deployment._receiver(session, host, "install", changed.release_id, str(len(payload)),
                         stdin=payload[: len(payload) // 2])
    # A stream that ends between two files is a well-formed, shorter tar: the byte
    # count the CLI announced tells the host that it was cut short.
    whole = _tar(MANIFEST=changed.manifest_text.encode(), **{"configs/extra.yaml": b"a: 1\n"})
    with pytest.raises(DflashError, match="upload cut short"):
        deployment._receiver(session, host, "install", changed.release_id, str(len(whole) + 512),
                         stdin=whole)
    # Same MANIFEST, other bytes for the file it lists: the host's verification refuses it.
    corrupt = _tar(MANIFEST=changed.manifest_text.encode(), **{"configs/extra.yaml": b"a: 2\n"})
    with pytest.raises(DflashError, match="verification failed for configs/extra.yaml"):
        deployment._receiver(session, host, "install", changed.release_id, str(len(corrupt)), stdin=corrupt)
    # The CLI itself refuses to send a file that changed since it was hashed.
    (changed_root / "configs" / "extra.yaml").write_text("a: 3\n")
    with pytest.raises(DflashError, match="configs/extra.yaml changed while deploying"):
        changed.tar_stream({"configs/extra.yaml"}).read()

    current = node_path(fake_pve, tmp_path, "current")
    assert os.readlink(current) == f"releases/{tree.release_id}"
    releases = sorted(os.listdir(node_path(fake_pve, tmp_path, "releases")))
    assert releases == [tree.release_id], "no half-deployed release may remain"


def _tar(**members: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_cli_deploys_several_hosts_in_parallel_and_reports_each(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    done = dflash("deploy", "ct200", "node", "local", "down", "ct201", hosts=hosts)
    assert done.returncode == 3, done.stderr
    rows = dict(line.split("\t", 1) for line in done.stdout.splitlines())
    tree_id = release.scan().release_id
    assert rows == {name: f"{tree_id}\tinstalled" for name in ("ct200", "node", "local")}
    assert "failed" in done.stderr and "ct201" in done.stderr and "not running" in done.stderr
    again = dflash("deploy", "ct200", "node", "local", hosts=hosts)
    assert again.returncode == 0, again.stderr
    assert sorted(again.stdout.splitlines()) == sorted(f"{h}\t{tree_id}\tunchanged" for h in ("ct200", "local", "node"))
    # `local` and `node` are the same machine here; their workspaces hold spaces in the name.
    assert os.readlink(tmp_path / "local ws" / "current") == f"releases/{tree_id}"
    assert os.readlink(tmp_path / "node ws" / "current") == f"releases/{tree_id}"


def test_deploy_of_unknown_host_does_nothing(make_inventory, tmp_path):
    done = dflash("deploy", "ct200", "nosuch", hosts=make_inventory(tmp_path))
    assert done.returncode == 2
    assert "unknown host 'nosuch'" in done.stderr
    assert done.stdout == ""


def _receivers_in(workspace: Path) -> list[int]:
    """Pids of deploy receivers (`python -c SOURCE install WORKSPACE …`) working on `workspace`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"install" in argv and str(workspace).encode() in argv and b"-c" in argv:
            pids.append(int(entry.name))
    return pids


def interrupt_midway(proc: subprocess.Popen, err: Path, uploads: list[tuple[Callable[[], bool], Path]]) -> None:
    """Ctrl-C to the CLI with every upload midway, for (under way?, receiver's workspace) pairs.

    Every receiver is stopped (SIGSTOP) as soon as it exists, before it can have read much;
    then each in turn runs alone until its upload is under way and is stopped again. They
    resume only once the CLI says it is stopping the uploads. However fast the machine, no
    upload can complete before the interrupt takes effect: at most a few polls' worth of
    data arrives while a receiver runs, and the rest is still with the CLI."""
    stopped: set[int] = set()

    def hold(pids: list[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)

    def held_all() -> bool:  # one pass over every workspace: none runs unwatched while another is awaited
        found = [_receivers_in(workspace) for _, workspace in uploads]
        for receivers in found:
            hold([pid for pid in receivers if pid not in stopped])
        return all(found)

    try:
        wait_until(held_all, what="every upload's receiver to start", interval=0.005)
        for under_way, workspace in uploads:
            receivers = _receivers_in(workspace)
            for pid in receivers:
                os.kill(pid, signal.SIGCONT)
            try:
                wait_until(under_way, what=f"the upload to {workspace} to start", interval=0.002)
            finally:
                hold(receivers)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "interrupting: stopping" in err.read_text(), what="the CLI to take the interrupt")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)


def uploading_big_bin(workspace: Path) -> bool:
    """Whether some of checkout_with_a_big_file's big.bin has reached `workspace` (as the node sees it)."""
    return any(p.stat().st_size > 0 for p in (workspace / "releases").glob(".incoming-*/configs/big.bin"))


def checkout_with_a_big_file(tmp_path: Path) -> Path:
    """A copy of the release's folders with a new 96 MiB file."""
    checkout = copy_release_dirs(tmp_path / "checkout")
    with open(checkout / "configs" / "big.bin", "wb") as fh:
        for _ in range(96):
            fh.write(os.urandom(1 << 20))
    return checkout


@pytest.mark.parametrize("when", ["as soon as it names its source", "with both uploads midway"])
def test_ctrl_c_during_a_big_deploy_stops_it_and_keeps_the_current_release(make_inventory, fake_pve, tmp_path,
                                                                           when):
    hosts = make_inventory(tmp_path)
    tree_id = release.scan().release_id
    assert dflash("deploy", "ct200", "node", hosts=hosts).returncode == 0
    checkout = checkout_with_a_big_file(tmp_path)  # and the CLI: it deploys the tree it runs from
    shutil.copytree(REPO / "dflash_cli", checkout / "dflash_cli", ignore=shutil.ignore_patterns("__pycache__"))
    new_id = release.scan(checkout).release_id
    workspaces = {"ct200": node_path(fake_pve, tmp_path), "node": tmp_path / "node ws"}
    receiving = {"ct200": container_workspace(fake_pve, tmp_path), "node": workspaces["node"]}

    err_path = tmp_path / "deploy.err"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(dflash_argv("deploy", "ct200", "node", "--allow-large", hosts=hosts),
                                stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=checkout,
                                env=dflash_env({"PYTHONPATH": f"{checkout}{os.pathsep}{checkout / 'remote'}"}))
    try:
        if when == "as soon as it names its source":  # hashed; the hosts are being reached
            wait_until(lambda: "source:" in err_path.read_text(), what="the CLI to name its source",
                       interval=FIRST_INTERVAL_S)
            proc.send_signal(signal.SIGINT)
        else:
            interrupt_midway(proc, err_path, [(lambda host=host: uploading_big_bin(workspaces[host]), receiving[host])
                                              for host in workspaces])
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err_path.read_text()
    assert proc.returncode == 130, err
    for host, workspace in workspaces.items():
        wait_until(lambda: not _receivers_in(receiving[host]), what=f"{host}'s receiver to exit")
    # What the CLI says of each host is what the host has. An upload stopped midway leaves no
    # second release; one that completed before the interrupt took effect (possible only
    # in the first case: nothing holds the receivers there) is said to be live.
    went_live = {host for host in workspaces if f"{host}: release {new_id} is live" in err}
    for host, workspace in workspaces.items():
        if host in went_live:
            assert os.readlink(workspace / "current") == f"releases/{new_id}", host
            assert f"{host}\t{new_id}\t" in out
        else:
            assert f"host {host}: upload interrupted" in err, err
            assert os.readlink(workspace / "current") == f"releases/{tree_id}", host
            assert sorted(os.listdir(workspace / "releases")) == [tree_id], host
            assert host not in out
    if when == "with both uploads midway":
        assert went_live == set() and out == ""


def test_ctrl_c_during_launchs_deploy_starts_no_run_and_keeps_the_current_release(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    tree_id = release.scan().release_id
    assert dflash("deploy", "node", hosts=hosts).returncode == 0
    checkout = checkout_with_a_big_file(tmp_path)  # launch deploys the tree it runs in
    workspace = tmp_path / "node ws"
    err_path = tmp_path / "launch.err"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(dflash_argv("launch", "node", "--config", "configs/train/tiny-cpu.yaml",
                                            "--allow-large", hosts=hosts),
                                stdout=subprocess.PIPE, stderr=err_file, text=True, cwd=checkout, env=dflash_env())
    try:
        interrupt_midway(proc, err_path, [(lambda: uploading_big_bin(workspace), workspace)])
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err_path.read_text()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "is live" not in err, err
    assert out == "", "no run id: no run was started"
    assert os.readlink(workspace / "current") == f"releases/{tree_id}"
    assert not (workspace / "runs").exists() or not os.listdir(workspace / "runs")
    wait_until(lambda: not _receivers_in(workspace), what="the receiver to exit")
    assert sorted(os.listdir(workspace / "releases")) == [tree_id]



@pytest.mark.slow(seconds=12, why="starts two trainers that hang at start-up, then stops them")
def test_a_launch_refused_for_a_busy_resource_leaves_current_where_it_was(make_inventory, tmp_path):
    """launch installs its release beside the current one; `current` moves only with a run
    that starts, so a launch the host refuses (the CPU is another run's) leaves it as it was."""
    hosts = make_inventory(tmp_path)
    current = tmp_path / "node ws" / "current"
    hang = small_config(tmp_path / "hang.yaml", faults=[{"thread": "coordinator", "at": "startup", "kind": "hang"}])
    first = dflash_in_process("launch", "node", "--config", str(hang), hosts=hosts)
    assert first.returncode == 0, first.stderr
    run_ids = first.stdout.split()
    tree_id = release.scan().release_id
    checkout = copy_release_dirs(tmp_path / "checkout")
    (checkout / "configs" / "another.yaml").write_text("another: release\n")
    new_id = release.scan(checkout).release_id
    try:
        assert os.readlink(current) == f"releases/{tree_id}"
        busy = dflash_in_process("launch", "node", "--config", str(hang), "--source", str(checkout), hosts=hosts)
        assert busy.returncode == 2, busy.stderr
        assert f"cpu is in use by run '{run_ids[0]}' (" in busy.stderr and busy.stdout == ""
        assert os.readlink(current) == f"releases/{tree_id}"
        assert (current.parent / "releases" / new_id / "MANIFEST").is_file()  # installed beside it
        forced = dflash_in_process("launch", "node", "--config", str(hang), "--source", str(checkout), "--force",
                                   hosts=hosts)
        assert forced.returncode == 0, forced.stderr
        run_ids += forced.stdout.split()
        assert os.readlink(current) == f"releases/{new_id}"  # with the run that started
    finally:
        for run_id in run_ids:
            dflash_in_process("stop", run_id, "--host", "node", "--grace", "2", hosts=hosts)

def test_probe_is_made_again_after_a_dropped_connection(make_inventory, ssh_node, tmp_path):
    # The first interpreter started on the node marks that it runs, then hangs: the
    # connection drops under the probe, as a flaky link does it.
    marker = tmp_path / "first call"
    python = tmp_path / "python-once-hanging"
    python.write_text(f"#!/bin/sh\nif mkdir {shlex.quote(str(marker))} 2>/dev/null; then sleep 5; exit 9; fi\n"
                      f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    hosts = make_inventory(tmp_path, node={"python": str(python)})
    proc = subprocess.Popen(dflash_argv("deploy", "node", hosts=hosts), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dflash_env())
    try:
        wait_until(marker.exists, what="the probe to start", interval=FIRST_INTERVAL_S)
        assert kill_ssh_sessions(ssh_node) >= 1
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "connection lost" in err and "reconnecting" in err
    assert out == f"node\t{release.scan().release_id}\tinstalled\n"


def test_a_partial_release_left_by_a_killed_deploy_is_removed_by_the_next(session, tmp_path):
    host = session.host("local")
    deployment.deploy_host(session, host, release.scan())
    gone = subprocess.Popen(["true"])
    gone.wait()
    releases = tmp_path / "local ws" / "releases"
    left = releases / f".incoming-0123456789abcdef-{gone.pid}"  # its receiver was SIGKILLed
    (left / "configs").mkdir(parents=True)
    (left / "configs" / "half.yaml").write_text("a: ")
    os.chmod(left / "configs", 0o555)
    changed_root = copy_release_dirs(tmp_path / "checkout")
    (changed_root / "configs" / "extra.yaml").write_text("a: 1\n")
    assert deployment.deploy_host(session, host, release.scan(changed_root)).status == "installed"
    assert not left.exists()


def test_an_early_probe_answers_once_given_the_id_and_an_abandoned_one_touches_nothing(session, fake_pve, tmp_path):
    host = session.host("ct200")
    workspace = node_path(fake_pve, tmp_path)
    transport = session.transport(host)
    abandoned = deployment.EarlyProbe(session, host)
    abandoned.abandon()
    assert transport.round_trips == 1 and not workspace.exists(), "the receiver ran, and looked at nothing"

    tree = release.scan()
    first = deployment.deploy_host(session, host, tree, early=deployment.EarlyProbe(session, host))
    assert (first.status, first.round_trips, first.files_sent) == ("installed", 2, len(tree.files))
    again = deployment.deploy_host(session, host, tree, early=deployment.EarlyProbe(session, host))
    assert (again.status, again.round_trips, again.bytes_sent) == ("unchanged", 1, 0)

    changed_root = copy_release_dirs(tmp_path / "checkout")
    (changed_root / "configs" / "hosts.yaml").write_text("# another inventory\n")
    changed = release.scan(changed_root)
    result = deployment.deploy_host(session, host, changed, early=deployment.EarlyProbe(session, host))
    assert (result.status, result.round_trips, result.files_sent) == ("installed", 2, 1)
    assert os.readlink(workspace / "current") == f"releases/{changed.release_id}"


def test_the_receiver_refuses_a_release_id_that_is_not_one(session, fake_pve, tmp_path):
    host = session.host("ct200")
    deployment.deploy_host(session, host, release.scan())
    for bad in ("../../etc", "0123456789ABCDEF", "0123456789abcdef0"):
        with pytest.raises(DflashError, match="a release id is 16 hex digits"):
            deployment._receiver(session, host, "probe", "-", "cheap", "switch", stdin=f"{bad}\n".encode())
    assert sorted(os.listdir(node_path(fake_pve, tmp_path, "releases"))) == [release.scan().release_id]


@pytest.mark.parametrize("client", ["openssh", "paramiko"])
def test_an_unchanged_deploy_is_one_round_trip_and_a_refused_one_starts_no_receiver(make_inventory, tmp_path, client):
    started = tmp_path / "receivers started"
    python = tmp_path / "python-counting"
    python.write_text(f"#!/bin/sh\necho >> {shlex.quote(str(started))}\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    hosts = make_inventory(tmp_path, ct200={"python": str(python), "ssh_client": client})
    assert dflash("deploy", "ct200", hosts=hosts).returncode == 0
    started.unlink()
    again = dflash("deploy", "ct200", hosts=hosts)
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"ct200\t{release.scan().release_id}\tunchanged\n"
    row = next(line for line in again.stderr.splitlines() if line.lstrip("│ ").startswith("ct200"))
    assert row.replace("│", " ").split()[1:6] == ["unchanged", "0", "0", "0", "1"]  # sent, reused, bytes, trips
    assert started.read_text() == "\n", "one interpreter started on the host"

    project = copy_release_dirs(tmp_path / "p")
    with open(project / "configs" / "dataset.jsonl", "wb") as fh:
        fh.truncate(70 << 20)
    started.unlink()
    refused = dflash("deploy", "ct200", "--source", str(project), hosts=hosts)
    assert refused.returncode == 2 and "nothing was sent" in refused.stderr, refused.stderr
    assert not started.exists(), "a release refused for its size contacts no host"


def test_a_file_changed_to_the_same_size_with_its_mtime_put_back_is_deployed(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    project = copy_release_dirs(tmp_path / "p")
    config = project / "configs" / "hosts.yaml"
    first = dflash("deploy", "local", "--source", str(project), hosts=hosts)
    assert first.returncode == 0, first.stderr
    before = config.stat()
    text = config.read_text()
    config.write_text(text[:-2] + ("x" if text[-2] != "x" else "y") + text[-1])
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (config.stat().st_size, config.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = dflash("deploy", "local", "--source", str(project), hosts=hosts)
    assert second.returncode == 0, second.stderr
    new_id = release.scan(project).release_id
    assert second.stdout == f"local\t{new_id}\tinstalled\n" and new_id not in first.stdout
    assert (tmp_path / "local ws" / "current" / "configs" / "hosts.yaml").read_text() == config.read_text()


def counting_python(tmp_path: Path) -> Path:
    """An interpreter for the host that adds a line to tmp_path/'receivers started' as it starts."""
    python = tmp_path / "python-counting"
    python.write_text(f"#!/bin/sh\necho >> {shlex.quote(str(tmp_path / 'receivers started'))}\n"
                      f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    return python


def held_deploy(tmp_path: Path, hosts: Path, project: Path, temporary: Path | None = None
                ) -> tuple[subprocess.Popen[str], Path]:
    """`dflash deploy ct200 --source PROJECT` with its hashing held until the test creates the
    returned gate file; returns once the probe's receiver started on ct200 (it waits there
    for the release id)."""
    (tmp_path / "receivers started").unlink(missing_ok=True)
    gate = tmp_path / "gate"
    env = dflash_env({"TMPDIR": str(temporary)} if temporary else None)
    proc = subprocess.Popen(held_dflash_argv(gate, "deploy", "ct200", "--source", str(project), hosts=hosts),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_until((tmp_path / "receivers started").exists, what="the probe's receiver to start",
               interval=FIRST_INTERVAL_S)
    return proc, gate


def deployed_project(make_inventory, tmp_path: Path) -> tuple[Path, Path, str]:
    """(an inventory whose ct200 runs counting_python, a copy of the project, its release id
    deployed to ct200)."""
    hosts = make_inventory(tmp_path, ct200={"python": str(counting_python(tmp_path))})
    project = copy_release_dirs(tmp_path / "p")
    first = dflash("deploy", "ct200", "--source", str(project), hosts=hosts)
    assert first.returncode == 0, first.stderr
    return hosts, project, first.stdout.split()[1]


def test_a_file_changed_after_the_probe_started_is_what_is_deployed(make_inventory, fake_pve, tmp_path):
    hosts, project, first_id = deployed_project(make_inventory, tmp_path)
    temporary = Path(tempfile.mkdtemp(prefix="dft"))  # short: the master's socket is in it
    try:
        proc, gate = held_deploy(tmp_path, hosts, project, temporary)
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
        assert list(temporary.iterdir()) == []  # the private folder went with the connection
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def test_a_file_removed_after_it_was_listed_is_an_error_and_changes_nothing(make_inventory, fake_pve, tmp_path):
    hosts, project, first_id = deployed_project(make_inventory, tmp_path)
    releases = workspace_on_node(fake_pve, tmp_path) / "releases"
    before = sorted(os.listdir(releases))
    proc, gate = held_deploy(tmp_path, hosts, project)
    (project / "configs" / "hosts.yaml").unlink()
    gate.touch()
    code, out, err = finish(proc)
    assert code == 2 and out == "", err
    assert "cannot read configs/hosts.yaml" in err and "Traceback" not in err
    assert sorted(os.listdir(releases)) == before
    assert os.readlink(releases.parent / "current") == f"releases/{first_id}"


def test_a_deploy_killed_with_its_probe_started_changes_nothing(make_inventory, fake_pve, tmp_path):
    hosts, project, first_id = deployed_project(make_inventory, tmp_path)
    workspace = workspace_on_node(fake_pve, tmp_path)
    before = sorted(os.listdir(workspace / "releases"))
    proc, _ = held_deploy(tmp_path, hosts, project)
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    # its stdin closed with the process: the receiver exits having looked at nothing
    assert sorted(os.listdir(workspace / "releases")) == before
    assert os.readlink(workspace / "current") == f"releases/{first_id}"
    again = dflash("deploy", "ct200", "--source", str(project), hosts=hosts)
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"ct200\t{first_id}\tunchanged\n"


def test_a_host_whose_options_cannot_be_resolved_fails_alone(make_inventory, tmp_path):
    # its `ssh -G` runs while the tree is listed; its failure is that host's row
    odd = {**yaml.safe_load(make_inventory(tmp_path).read_text())["hosts"]["ct200"], "ssh": "root@bad;host"}
    hosts = make_inventory(tmp_path, odd=odd)
    done = subprocess.run(dflash_argv("deploy", "ct200", "odd", hosts=hosts), capture_output=True, text=True,
                          env=dflash_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == f"ct200\t{release.scan().release_id}\tinstalled\n"
    # the table's cells as one line: where the row wraps depends on the length of the test's paths
    cells = " ".join(re.sub("[│┃]", " ", done.stderr).split())
    assert re.search(r"odd failed: `ssh -G .*bad;host` failed: hostname contains invalid", cells), done.stderr
