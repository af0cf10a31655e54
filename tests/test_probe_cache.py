"""`dflash deploy` starts each host's probe from the command line the last deploy of the same
command line ran (probe_cache), before it has read the inventory; what it reports comes
only from a probe whose command line the deploy, resolved as always, starts itself, and a
kept line that no longer fits contacts no host it should not, or is abandoned."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from dflash_cli import release
from dflash_run import dflash_argv, dflash_env
from support import copy_release_dirs, wait_until, workspace_on_node
from support.import_gate import finish, gated_import
from support.wait import FIRST_INTERVAL_S


class Bed:
    """A project deployed to ct200 from a hosts.yaml whose ct200 runs `counting_python`,
    with the user's cache folder and temporary folder (TMPDIR: short, for the sockets in
    it) of its own."""

    def __init__(self, make_inventory, tmp_path: Path, temporary: Path):
        self.tmp, self.cache, self.temporary = tmp_path, tmp_path / "user cache", temporary
        self.hosts = make_inventory(tmp_path, ct200={"python": str(self.counting_python("python"))})
        self.project = copy_release_dirs(tmp_path / "p")

    def counting_python(self, name: str) -> Path:
        """An interpreter for the host that adds a line to tmp/'NAME starts' as it starts."""
        python = self.tmp / f"counting {name}"
        python.write_text(f"#!/bin/sh\necho >> {shlex.quote(str(self.tmp / f'{name} starts'))}\n"
                          f"exec {shlex.quote(sys.executable)} \"$@\"\n")
        python.chmod(0o755)
        return python

    def starts(self, name: str = "python") -> int:
        path = self.tmp / f"{name} starts"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def env(self, **extra: str) -> dict[str, str]:
        return dflash_env({"XDG_CACHE_HOME": str(self.cache), "TMPDIR": str(self.temporary), **extra})

    def argv(self, host: str = "ct200") -> list[str]:
        return dflash_argv("deploy", host, "--source", str(self.project), hosts=self.hosts)

    def deploy(self, host: str = "ct200", **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(host), capture_output=True, text=True, env=self.env(**extra), timeout=120)

    def first_deploy(self, **extra: str) -> subprocess.CompletedProcess[str]:
        """The first deploy (it installs, then keeps its probe's line); the counts start after it."""
        done = self.deploy(**extra)
        assert done.returncode == 0, done.stderr
        (self.tmp / "python starts").unlink()
        return done

    def kept(self) -> list[Path]:
        return sorted((self.cache / "dflash" / "deploy-probes").iterdir())

    def gated(self) -> tuple[subprocess.Popen[str], Path]:
        """The deploy with its yaml import held until the test creates the returned gate file."""
        # The CLI reads the inventory with yaml: a probe started before it was read can
        # make the gate appear, one started after it never can.
        gate, variables = gated_import(self.tmp, "yaml")
        proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(**variables))
        return proc, gate


@pytest.fixture
def bed(make_inventory, tmp_path) -> Iterator[Bed]:
    temporary = Path(tempfile.mkdtemp(prefix="dft"))
    try:
        yield Bed(make_inventory, tmp_path, temporary)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def unchanged(bed: Bed, done: subprocess.CompletedProcess[str] | tuple[int, str, str]) -> bool:
    code, out, err = done if isinstance(done, tuple) else (done.returncode, done.stdout, done.stderr)
    assert code == 0, err
    assert "Traceback" not in err
    return out == f"ct200\t{release.scan(bed.project).release_id}\tunchanged\n"


def test_a_repeated_deploy_starts_its_probe_before_reading_the_inventory(bed):
    bed.first_deploy()
    assert [path.suffix for path in bed.kept()] == [".json"]  # written whole: no temporary file left
    proc, gate = bed.gated()
    # the second deploy's receiver starts while the CLI has not yet imported yaml
    wait_until(lambda: bed.starts() == 1, timeout=30, what="the kept probe's receiver to start",
               interval=FIRST_INTERVAL_S)
    gate.touch()
    assert unchanged(bed, finish(proc))
    assert bed.starts() == 1  # the started probe was the deploy's probe: one session on the host
    assert list(bed.temporary.iterdir()) == []  # the private folder went with the connection


def test_a_changed_inventory_starts_nothing_before_it_is_read(bed, make_inventory, tmp_path):
    bed.first_deploy()
    # the same host, now run by another interpreter: the kept line (with the old one) is not started
    make_inventory(tmp_path, ct200={"python": str(bed.counting_python("other python"))})
    assert unchanged(bed, bed.deploy())
    assert (bed.starts(), bed.starts("other python")) == (0, 1)
    assert unchanged(bed, bed.deploy())  # the line kept now is the new inventory's
    assert (bed.starts(), bed.starts("other python")) == (0, 2)


def test_a_line_an_included_ssh_config_made_stale_is_abandoned(bed, tmp_path):
    # `Include`d files are not part of the kept line's key: only the check against the
    # line the deploy makes itself tells it is stale
    included = tmp_path / "included ssh config"
    included.write_text("")
    config = tmp_path / "ssh config"
    config.write_text(f"Include {shlex.quote(str(included))}\n")
    bed.first_deploy(DFLASH_SSH_CONFIG=str(config))  # kept: a line with dflash's own master
    sockets = Path(tempfile.mkdtemp(prefix="cm"))  # short: a socket's path is at most ~100 bytes
    included.write_text(f"ControlMaster auto\nControlPath {sockets}/%C\nControlPersist 60\n")
    try:
        done = bed.deploy(DFLASH_SSH_CONFIG=str(config))
        assert unchanged(bed, done)
        # the deploy's own probe joined the user's master, as the config now says; the kept
        # line's (a master of dflash's own, in a private folder) was abandoned and cleaned up
        assert [path.is_socket() for path in sockets.iterdir()] == [True]
        assert list(bed.temporary.iterdir()) == []
        assert unchanged(bed, bed.deploy(DFLASH_SSH_CONFIG=str(config)))
    finally:
        for socket in sockets.iterdir():
            subprocess.run(["ssh", "-F", os.devnull, "-o", f"ControlPath={socket}", "-O", "exit", "unused"],
                           capture_output=True)
            socket.unlink(missing_ok=True)
        sockets.rmdir()


@pytest.mark.parametrize("damage", ["truncated", "empty", "not json", "another program"])
def test_a_damaged_cache_file_is_ignored_and_written_again(bed, tmp_path, damage):
    bed.first_deploy()
    (kept,) = bed.kept()
    text = kept.read_text()
    marker = tmp_path / "ran"
    data = json.loads(text)
    data["hosts"]["ct200"]["probe"] = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    kept.write_text({"truncated": text[: len(text) // 2], "empty": "", "not json": "\0\1 garbage",
                     "another program": json.dumps(data)}[damage])
    assert unchanged(bed, bed.deploy())
    assert not marker.exists()  # a kept line runs ssh, or nothing
    assert bed.starts() == 1
    assert json.loads(kept.read_text())["hosts"]["ct200"]["probe"][0] == "ssh"  # written again, whole
    assert unchanged(bed, bed.deploy())
    assert bed.starts() == 2


def test_a_release_over_the_size_limit_contacts_no_host_even_with_a_kept_line(bed):
    bed.first_deploy()
    with open(bed.project / "remote" / "data.bin", "wb") as large:  # sparse: no disk used
        large.truncate(release.LARGE_RELEASE_BYTES + 1)
    done = bed.deploy()
    assert done.returncode == 2 and "nothing was sent" in done.stderr, done.stderr
    assert bed.starts() == 0


def test_an_unreachable_host_fails_as_it_does_without_a_kept_line(bed):
    without = bed.deploy("down")  # its line is kept all the same: it is what the deploy ran
    assert without.returncode == 3 and bed.kept(), without.stderr
    speculated = bed.deploy("down")
    assert speculated.returncode == 3
    said = [line for line in speculated.stderr.splitlines() if "unreachable" in line]
    assert said and said == [line for line in without.stderr.splitlines() if "unreachable" in line]


def test_a_deploy_killed_with_its_kept_probe_started_changes_nothing(bed, fake_pve, tmp_path):
    first = bed.first_deploy()
    workspace = workspace_on_node(fake_pve, tmp_path)
    before = sorted(os.listdir(workspace / "releases"))
    proc, _ = bed.gated()
    wait_until(lambda: bed.starts() == 1, timeout=30, what="the kept probe's receiver to start",
               interval=FIRST_INTERVAL_S)
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    # its stdin closed with the process: the receiver exits having looked at nothing
    assert sorted(os.listdir(workspace / "releases")) == before
    assert os.readlink(workspace / "current") == f"releases/{first.stdout.split()[1]}"
    assert unchanged(bed, bed.deploy())
