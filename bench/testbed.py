"""The benchmarks' host: the test bed's real sshd on 127.0.0.1 and the fake Proxmox
node, set up in a temporary folder and torn down afterwards. Needs root and sshd."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from dflash_run import dflash, popen_dflash  # noqa: E402
from support import (container_workspace, make_fake_pve, start_sshd, stop_sshd,  # noqa: E402
                     workspace_on_node, write_inventory)
from support.pve import FakePve  # noqa: E402
from support.sshd import SshNode  # noqa: E402
from support.train_configs import small_config  # noqa: E402,F401  (re-exported for the benchmarks)


class Bed:
    def __init__(self, work: Path, node: SshNode, pve: FakePve, sshd_pid: int):
        self.work, self.node, self.pve = work, node, pve
        self.sshd_pid = sshd_pid  # the listener: every session (and what it runs) is forked from it
        self.hosts = write_inventory(work, node, pve)
        self.logs = work / "logs"
        self.workspace = container_workspace(pve, work)  # as container 200 sees it
        self.workspace_on_node = workspace_on_node(pve, work)

    def dflash(self, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
        return dflash("--logs-dir", str(self.logs), *args, hosts=self.hosts, **kwargs)

    def popen_dflash(self, *args: str) -> subprocess.Popen[bytes]:
        return popen_dflash("--logs-dir", str(self.logs), *args, hosts=self.hosts)


@contextlib.contextmanager
def test_bed() -> Iterator[Bed]:
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        work = Path(tmp)
        (work / "sshd").mkdir()
        node, proc = start_sshd(work / "sshd")
        try:
            yield Bed(work, node, make_fake_pve(work / "pve node"), proc.pid)
        finally:
            stop_sshd(proc)
