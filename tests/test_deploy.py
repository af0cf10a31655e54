"""dflash deploy over the real transports: content-addressed, verified, atomic."""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from dflash_cli import release
from dflash_cli.commands import deploy
from dflash_cli.errors import DflashError
from dflash_cli.session import Session
from dflash_run import REPO, dflash
from support import copy_release_dirs, workspace_on_node


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
    first = deploy.deploy_host(session, host, tree)
    assert first.status == "installed" and first.files_sent == len(tree.files)
    current = node_path(fake_pve, tmp_path, "current")
    assert os.readlink(current) == f"releases/{tree.release_id}"
    assert (current / "MANIFEST").read_text() == tree.manifest_text
    assert (current / "remote" / "agent.py").read_bytes() == (REPO / "remote" / "agent.py").read_bytes()

    again = deploy.deploy_host(session, host, tree)
    assert (again.status, again.round_trips, again.bytes_sent) == ("unchanged", 1, 0)

    changed_root = copy_release_dirs(tmp_path / "checkout")
    config = changed_root / "configs" / "hosts.yaml"
    config.write_text(config.read_text() + "# one more line\n")
    changed = release.scan(changed_root)
    assert changed.release_id != tree.release_id
    result = deploy.deploy_host(session, host, changed)
    assert (result.status, result.files_sent, result.files_reused) == ("installed", 1, len(tree.files) - 1)
    assert result.bytes_sent < tree.total_bytes / 4
    assert os.readlink(current) == f"releases/{changed.release_id}"
    # The previous release is untouched: still complete and still verifiable.
    old = node_path(fake_pve, tmp_path, "releases", tree.release_id)
    assert (old / "MANIFEST").read_text() == tree.manifest_text
    assert "one more line" not in (old / "configs" / "hosts.yaml").read_text()

    # Going back to a release the host already has only moves `current`.
    back = deploy.deploy_host(session, host, tree)
    assert (back.status, back.round_trips) == ("switched", 1)
    assert os.readlink(current) == f"releases/{tree.release_id}"


def test_a_mode_only_change_leaves_the_older_release_as_it_was(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    deploy.deploy_host(session, host, tree)
    changed_root = copy_release_dirs(tmp_path / "checkout")
    (changed_root / "configs" / "hosts.yaml").chmod(0o755)  # same bytes, now executable
    changed = release.scan(changed_root)
    result = deploy.deploy_host(session, host, changed)
    assert (result.status, result.files_sent) == ("installed", 0)  # nothing new to send

    def mode(release_id: str) -> int:
        return node_path(fake_pve, tmp_path, "releases", release_id, "configs", "hosts.yaml").stat().st_mode & 0o777

    assert mode(changed.release_id) == 0o555
    assert mode(tree.release_id) == 0o444  # a shared inode would have turned this one executable too


def test_interrupted_or_corrupt_deploy_leaves_current_release(session, fake_pve, tmp_path):
    host = session.host("ct200")
    tree = release.scan()
    deploy.deploy_host(session, host, tree)
    changed_root = copy_release_dirs(tmp_path / "checkout")
    (changed_root / "configs" / "extra.yaml").write_text("a: 1\n")
    changed = release.scan(changed_root)
    payload = changed.tar_of({"configs/extra.yaml"})

    with pytest.raises(DflashError, match="previous release stays current"):
        deploy._receiver(session, host, "install", changed.release_id, payload[: len(payload) // 2])
    # Same MANIFEST, other bytes for the file it lists: the host's verification refuses it.
    with pytest.raises(DflashError, match="verification failed for configs/extra.yaml"):
        deploy._receiver(session, host, "install", changed.release_id,
                         _tar(MANIFEST=changed.manifest_text.encode(), **{"configs/extra.yaml": b"a: 2\n"}))
    # The CLI itself refuses to send a file that changed since it was hashed.
    (changed_root / "configs" / "extra.yaml").write_text("a: 3\n")
    with pytest.raises(DflashError, match="configs/extra.yaml changed while deploying"):
        changed.tar_of({"configs/extra.yaml"})

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
