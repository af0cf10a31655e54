"""Writes a hosts.yaml for the test bed: `local`, `node` (ssh), `ct200` (pct, running),
`ct201` (stopped), `ct999` (unknown) and `down` (ssh to a closed port)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from .pve import UNKNOWN_CONTAINER, FakePve
from .sshd import SshNode, free_port

#: The environment of every process of the suite (tests/conftest.py sets it) and of the
#: trainer on every test host:
#: - no model or tokenizer downloads, ever;
#: - Inductor on CPU writes scalar C++ instead of vectorized: a cold compile of the drafter's
#:   train step (one compile thread) costs 59 CPU-seconds instead of 77, mostly g++'s, and the
#:   suite compiles several. What the compile tests check is ours (threads, caches,
#:   artifacts, the losses); the vector code is Inductor's, and a GPU runs Triton;
#: - the suite's processes always outnumber the cores (`make test`: 4 workers on 2 cores, and
#:   the trainers and jobs they start). torch's OpenMP threads spin at each barrier while they
#:   wait for a core another process holds; passive, they sleep. The in-process torch tests
#:   then take 39 CPU-seconds instead of 78, and jobs that use every core (evaluate,
#:   regenerate) stop burning the cores the rest of the suite needs.
#: - no warm interpreter (runs.md): each would outlive its test by its idle timeout, with
#:   torch imported; tests/test_warm_interpreter.py turns it on for its launches.
HOST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "0",
            "OMP_WAIT_POLICY": "PASSIVE", "DFLASH_WARM_IDLE_S": "0"}


def container_workspace(pve: FakePve, tmp_path: Path) -> Path:
    """The workspace path, as the containers see it, for the test owning `tmp_path`."""
    return pve.mount_point / f"ws {tmp_path.name}"


def workspace_on_node(pve: FakePve, tmp_path: Path) -> Path:
    """Container 200's copy of that workspace, as the node sees it (for checking)."""
    return pve.on_node(200, container_workspace(pve, tmp_path))


def _remote(node: SshNode) -> dict[str, Any]:
    return {"ssh": node.target, "identity_file": str(node.identity_file), "known_hosts": str(node.known_hosts),
            "python": sys.executable, "connect_timeout": 5.0, "env": dict(HOST_ENV)}


def container_host(tmp_path: Path, node: SshNode, pve: FakePve, vmid: int) -> dict[str, Any]:
    """The inventory entry of container `vmid` of the fake node, as ct200's, for the test
    owning `tmp_path` (an override adding a host: `make_inventory(tmp_path, name=entry)`)."""
    return {"transport": "pct", **_remote(node), "container": vmid, "pct": str(pve.pct),
            "workspace": str(container_workspace(pve, tmp_path))}


def default_hosts(tmp_path: Path, node: SshNode, pve: FakePve) -> dict[str, dict[str, Any]]:
    remote = _remote(node)
    return {
        "local": {"transport": "local", "workspace": str(tmp_path / "local ws"), "python": sys.executable,
                  "env": dict(HOST_ENV)},
        "node": {"transport": "ssh", **remote, "workspace": str(tmp_path / "node ws")},
        "ct200": container_host(tmp_path, node, pve, 200),
        "ct201": container_host(tmp_path, node, pve, 201),
        "ct999": container_host(tmp_path, node, pve, UNKNOWN_CONTAINER),
        "down": {"transport": "ssh", **remote, "ssh": f"root@{node.address}:{free_port()}",
                 "connect_timeout": 1.0, "workspace": "/nonexistent/dflash"},
    }


def write_inventory(tmp_path: Path, node: SshNode, pve: FakePve, /, **overrides: dict[str, Any] | None) -> Path:
    """Write tmp_path/hosts.yaml and return its path.

    overrides: `name=None` drops a host; `name={key: value}` changes keys of a host (a
    value of None drops that key), or adds a host of that name."""
    hosts = default_hosts(tmp_path, node, pve)
    for name, changes in overrides.items():
        if changes is None:
            hosts.pop(name, None)
            continue
        entry = hosts.setdefault(name, {})
        for key, value in changes.items():
            if value is None:
                entry.pop(key, None)
            else:
                entry[key] = value
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False, allow_unicode=True))
    return path
