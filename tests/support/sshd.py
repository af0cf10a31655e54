"""A real OpenSSH sshd on 127.0.0.1 for the tests: its own host key, one client key
for root, a known_hosts file with its key. Only this sshd and its own children are
ever signalled, by the pids found from the one pid started here."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
ADDRESS = "127.0.0.1"
START_TIMEOUT_S = 10.0


class SshdMissing(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class SshNode:
    address: str
    port: int
    alt_port: int  # a second port of the same sshd: two hops that known_hosts tells apart
    user: str
    identity_file: Path  # the client's private key, authorized for root
    known_hosts: Path  # holds this sshd's host key
    host_key_line: str  # "ssh-ed25519 AAAA…" as sshd presents it
    pid: int  # the listening sshd, started by the fixture
    log_path: Path  # sshd's own log (-e: everything it says on stderr)
    user_ca: Path | None = None  # a CA private key whose user certificates sshd trusts (TrustedUserCAKeys)
    host_ca_line: str | None = None  # "ssh-ed25519 AAAA…" of the CA that signed sshd's host certificate

    @property
    def target(self) -> str:
        """The inventory's `ssh:` value for this node."""
        return f"{self.user}@{self.address}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        return f"[{self.address}]:{self.port}"

    def accepted_logins(self) -> int:
        """How many connections have authenticated so far (one log line each)."""
        return len(re.findall(r"^Accepted publickey for ", self.log_path.read_text(errors="replace"), re.M))


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on (when asked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:  # all bound at once, so the kernel hands out distinct ports
            sock.bind((ADDRESS, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def keygen(path: Path, comment: str) -> str:
    """An ed25519 key pair at path / path.pub; returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)
    return path.with_name(path.name + ".pub").read_text().strip()


def _sshd_version() -> tuple[int, int]:
    out = subprocess.run([str(SSHD), "-V"], capture_output=True, text=True).stderr
    found = re.search(r"OpenSSH_(\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _write_config(workdir: Path, ports: tuple[int, int], host_key: Path, authorized: Path,
                  user_ca_pub: Path, host_certificate: Path | None) -> Path:
    lines = [
        *([f"HostCertificate {host_certificate}"] if host_certificate else []),
        f"TrustedUserCAKeys {user_ca_pub}",
        *(f"Port {port}" for port in ports),
        f"ListenAddress {ADDRESS}",
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized}",
        "StrictModes no",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "MaxSessions 100",
        "MaxStartups 100",
        "PidFile none",
        "LogLevel INFO",
    ]
    if _sshd_version() >= (9, 8):
        # Killed sessions count as crashes there and would lock 127.0.0.1 out for a while.
        lines.append("PerSourcePenalties no")
    config = workdir / "sshd_config"
    config.write_text("\n".join(lines) + "\n")
    return config


def _certify_host_key(workdir: Path, host_key: Path) -> tuple[Path, str]:
    """A host certificate for `host_key` (for 127.0.0.1) signed by a new CA; its path
    and the CA's public key line."""
    host_ca = workdir / "host_ca"
    ca_line = keygen(host_ca, "dflash-test-host-ca")
    subprocess.run(["ssh-keygen", "-q", "-s", str(host_ca), "-h", "-I", "dflash-test-host", "-n", ADDRESS,
                    str(host_key.with_name(host_key.name + ".pub"))], check=True, stdin=subprocess.DEVNULL)
    return host_key.with_name(host_key.name + "-cert.pub"), " ".join(ca_line.split()[:2])


def start_sshd(workdir: Path, host_certificate: bool = False) -> tuple[SshNode, subprocess.Popen[bytes]]:
    """Start sshd -D on a free port of 127.0.0.1 and wait until it listens; with
    `host_certificate`, sshd also presents a certificate of its host key signed by a CA
    of its own (SshNode.host_ca_line)."""
    if not SSHD.exists():
        raise SshdMissing(f"{SSHD} is missing: the tests need OpenSSH's server; "
                          "run `apt-get install -y openssh-server`")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
    host_key = workdir / "ssh_host_ed25519_key"
    host_key_line = keygen(host_key, "dflash-test-host")
    client_key = workdir / "id_ed25519"
    (workdir / "authorized_keys").write_text(keygen(client_key, "dflash-test-client") + "\n")
    key_type, key_b64 = host_key_line.split()[:2]
    user_ca = workdir / "user_ca"
    keygen(user_ca, "dflash-test-user-ca")
    certificate, host_ca_line = _certify_host_key(workdir, host_key) if host_certificate else (None, None)
    for _attempt in range(3):  # another process may take the free port before sshd does
        port, alt_port = free_ports(2)
        config = _write_config(workdir, (port, alt_port), host_key, workdir / "authorized_keys",
                               user_ca.with_name("user_ca.pub"), certificate)
        log_path = workdir / f"sshd-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            said = log_path.read_text(errors="replace")
            if all(f"Server listening on {ADDRESS} port {p}." in said for p in (port, alt_port)):
                known_hosts = workdir / "known_hosts"
                known_hosts.write_text(f"[{ADDRESS}]:{port} {key_type} {key_b64}\n")
                node = SshNode(ADDRESS, port, alt_port, "root", client_key, known_hosts, f"{key_type} {key_b64}",
                               proc.pid, log_path, user_ca, host_ca_line)
                return node, proc
            time.sleep(0.02)
        stop_sshd(proc)
    raise RuntimeError(f"sshd did not start; its log:\n{log_path.read_text(errors='replace')}")


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid`, from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # the field after the parenthesised command name: state, then ppid
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _is_sshd(pid: int) -> bool:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("sshd")
    except OSError:
        return False


def _session_pids(listener: int) -> list[int]:
    """The per-connection sshd processes under the listening sshd `listener`, found by
    walking /proc ppid links through sshd processes only."""
    found: list[int] = []
    frontier = [listener]
    while frontier:
        frontier = [child for pid in frontier for child in _children(pid) if _is_sshd(child)]
        found += frontier
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_ssh_sessions(sshd: SshNode) -> int:
    """SIGKILL every per-connection sshd process under *our* listening sshd, which drops
    every client connection at once, the way a dying network or server does. The
    commands those sessions run are left alone. Returns how many were killed."""
    pids = _session_pids(sshd.pid)
    _kill_all(pids)
    return len(pids)


def stop_sshd(proc: subprocess.Popen[bytes]) -> None:
    """Stop the sshd this module started, and the sessions still open under it."""
    if proc.poll() is None:
        _kill_all(_session_pids(proc.pid))
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sign_user_key(node: SshNode, key: Path, principal: str = "root") -> Path:
    """An OpenSSH user certificate for `key` (KEY-cert.pub) signed by the CA `node` trusts."""
    assert node.user_ca is not None
    subprocess.run(["ssh-keygen", "-q", "-s", str(node.user_ca), "-I", "dflash-test", "-n", principal,
                    str(key.with_name(key.name + ".pub"))], check=True, stdin=subprocess.DEVNULL)
    return key.with_name(key.name + "-cert.pub")
