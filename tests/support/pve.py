"""The fake Proxmox node: a state folder holding the strict fake `pct` (fake_pct, see
its docstring) and the containers it knows. Containers 200 and 202 run, 201 is stopped, and
999 does not exist. Inside a container, its own root folder is bind-mounted over
`mount_point`, which on the node stays an EMPTY folder: anything found there was
written on the node instead of inside the container."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

FAKE_PCT = Path(__file__).with_name("fake_pct")
CONTAINERS = {200: "running", 201: "stopped"}
CONTAINERS[202] = "running"  # a second running container, with its own filesystem: runs on two hosts
UNKNOWN_CONTAINER = 999
#: added by FakePve.add_bare_container: a running container whose `python3` is a bare
#: interpreter (a fresh container's system Python, without torch or transformers)
BARE_CONTAINER = 203
#: added by FakePve.add_gpu_container: a running container whose PATH has a fake
#: nvidia-smi (support/fake_nvidia_smi): a GPU host, as far as the agent can tell
GPU_CONTAINER = 204
FAKE_NVIDIA_SMI = Path(__file__).with_name("fake_nvidia_smi")
#: added by FakePve.add_netns_container: a running container in a network namespace of its
#: own, reached from the node through one link (support/netns.py)
NETNS_CONTAINER = 206


class NeedsRoot(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class FakePve:
    root: Path  # the state folder: pct and lxc/<vmid>.conf
    pct: Path  # the inventory's `pct:` value
    mount_point: Path  # empty on the node; a container's root folder inside it
    node_name: str  # as pct's messages name the node

    def rootfs(self, vmid: int) -> Path:
        """The container's own root folder, as the node sees it."""
        return self.root / "rootfs" / str(vmid)

    def on_node(self, vmid: int, container_path: str | os.PathLike[str]) -> Path:
        """Where a path under mount_point, as container `vmid` sees it, lies on the node."""
        return self.rootfs(vmid) / Path(container_path).relative_to(self.mount_point)

    def add_bare_container(self, bin_dir: Path) -> int:
        """Container BARE_CONTAINER, running, with `bin_dir` (holding its `python3`)
        first on its PATH."""
        _write_conf(self.root, BARE_CONTAINER, "running", self.mount_point,
                    f"path: {bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n")
        return BARE_CONTAINER

    def add_gpu_container(self, bin_dir: Path) -> int:
        """Container GPU_CONTAINER, running, with the fake nvidia-smi put in `bin_dir`,
        first on its PATH."""
        fake = bin_dir / "nvidia-smi"
        fake.write_text(FAKE_NVIDIA_SMI.read_text())
        fake.chmod(0o755)
        _write_conf(self.root, GPU_CONTAINER, "running", self.mount_point,
                    f"path: {bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n")
        return GPU_CONTAINER

    def add_netns_container(self, netns: str) -> int:
        """Container NETNS_CONTAINER, running, its network the namespace file `netns`;
        remove_container takes it away again."""
        _write_conf(self.root, NETNS_CONTAINER, "running", self.mount_point, f"netns: {netns}\n")
        return NETNS_CONTAINER

    def remove_container(self, vmid: int) -> None:
        """Its conf gone (pct then knows no such container); its root folder stays."""
        (self.root / "lxc" / f"{vmid}.conf").unlink()

    def hold_gpu_memory(self, processes: list[tuple[int, int, str, int]]) -> None:
        """Make GPU_CONTAINER's fake nvidia-smi report these compute processes, (GPU index,
        pid, process name, MiB) each, holding memory (and each GPU's memory.used their
        sum); [] reports none again."""
        conf = (self.root / "lxc" / f"{GPU_CONTAINER}.conf").read_text()
        bin_dir = Path(re.search(r"^path: ([^:\n]+):", conf, re.M).group(1))
        apps = bin_dir / "nvidia-smi-apps"
        if not processes:
            apps.unlink(missing_ok=True)
            return
        staged = apps.with_name(".nvidia-smi-apps")
        staged.write_text("".join(f"{index}, {pid}, {name}, {mib}\n" for index, pid, name, mib in processes))
        os.replace(staged, apps)

    def node_leaks(self) -> list[str]:
        """What the node's side of mount_point holds: empty unless something wrote a file
        on the node that belonged in a container."""
        return sorted(os.listdir(self.mount_point))


def make_fake_pve(root: Path) -> FakePve:
    """Lay out a node under `root` (which must not exist yet)."""
    if os.geteuid() != 0:
        raise NeedsRoot("the fake pct needs root for unshare(2) and mount(2), as Proxmox's pct does; "
                        "run the tests as root (CI does)")
    (root / "lxc").mkdir(parents=True)
    pct = root / "pct"  # it finds its state in the folder it lives in
    # This interpreter, not `env python3`: the node's PATH (and whatever a shell profile
    # puts in front of it) must not pick it. -IS: stdlib only, nothing from the environment.
    body = FAKE_PCT.read_text().split("\n", 1)[1]
    pct.write_text(f"#!{sys.executable} -IS\n{body}")
    pct.chmod(0o755)
    mount_point = root / "ct mount"
    mount_point.mkdir()
    for vmid, status in CONTAINERS.items():
        _write_conf(root, vmid, status, mount_point)
    return FakePve(root, pct, mount_point, os.uname().nodename.split(".")[0])


def _write_conf(root: Path, vmid: int, status: str, mount_point: Path, extra: str = "") -> None:
    rootfs = root / "rootfs" / str(vmid)
    rootfs.mkdir(parents=True, exist_ok=True)  # a container added again keeps its root folder
    (root / "lxc" / f"{vmid}.conf").write_text(
        f"hostname: ct{vmid}\nstatus: {status}\nrootfs: {rootfs}\nmountpoint: {mount_point}\n{extra}")
