"""The test bed: a real sshd on 127.0.0.1, a strict fake Proxmox `pct`, inventories."""
from .inventory import container_workspace, write_inventory
from .pve import FakePve, make_fake_pve
from .sshd import SshNode, free_port, keygen, kill_ssh_sessions, start_sshd, stop_sshd

__all__ = ["FakePve", "SshNode", "container_workspace", "free_port", "keygen", "kill_ssh_sessions",
           "make_fake_pve", "start_sshd", "stop_sshd", "write_inventory"]
