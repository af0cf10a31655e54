"""The test bed: a real sshd on 127.0.0.1, a strict fake Proxmox `pct`, inventories."""
from .checkout import copy_release_dirs
from .inventory import container_workspace, workspace_on_node, write_inventory
from .pve import FakePve, make_fake_pve
from .sshd import SshNode, free_port, keygen, kill_ssh_sessions, start_sshd, stop_sshd
from .wait import wait_until

__all__ = ["FakePve", "SshNode", "container_workspace", "copy_release_dirs", "free_port", "keygen",
           "kill_ssh_sessions", "make_fake_pve", "start_sshd", "stop_sshd", "wait_until", "workspace_on_node",
           "write_inventory"]
