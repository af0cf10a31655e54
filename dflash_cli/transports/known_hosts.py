"""Host keys as OpenSSH keeps them: every known_hosts file it would read (plain and
hashed names), `@revoked` keys refused wherever they appear, and new keys appended to
the first file (OpenSSH's first UserKnownHostsFile).

`@cert-authority` lines are read but cannot vouch for a host here: paramiko does not
negotiate host certificates (docs/hosts.md); such a host needs its plain
key on record, and the refusal says so.
"""
from __future__ import annotations

import base64
import hashlib
import os
import threading
from pathlib import Path

import paramiko

from ..errors import DflashError, ExitCode

#: guards appends to known_hosts files by the transports of this process
_APPEND_LOCK = threading.Lock()


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as `ssh-keygen -l` prints it (SHA256:base64, no padding)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class HostKeyRefused(paramiko.SSHException):
    """The server's key is unknown, changed or revoked; `problem` says which."""

    def __init__(self, problem: str, hostname: str, key: paramiko.PKey, detail: str = ""):
        super().__init__(f"{problem} host key for {hostname}")
        self.problem = problem  # "unknown", "changed" or "revoked"
        self.hostname = hostname
        self.key = key
        self.detail = detail


class KnownHosts:
    def __init__(self, files: tuple[str, ...]):
        self.files = files
        self.keys = paramiko.HostKeys()
        self.revoked: set[bytes] = set()
        self.has_cert_authority = False
        for file in files:
            self._load(Path(file))

    def _load(self, path: Path) -> None:
        try:
            text = path.read_text(errors="replace") if path.is_file() else ""
        except OSError as exc:
            raise DflashError(f"cannot read known_hosts file {path}: {exc}", ExitCode.USAGE) from exc
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("@"):
                fields = line.split()
                if fields[0] == "@revoked" and len(fields) >= 4:
                    self.revoked.add(base64.b64decode(fields[3] + "=="))
                elif fields[0] == "@cert-authority":
                    self.has_cert_authority = True
                continue
            try:
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line, number)
            except (paramiko.SSHException, ValueError):
                entry = None  # a key type paramiko lacks; OpenSSH would skip it too
            if entry is not None:
                for name in entry.hostnames:
                    self.keys.add(name, entry.key.get_name(), entry.key)

    def check(self, hostname: str, key: paramiko.PKey) -> None:
        """Return when `key` is on record for `hostname`, else raise HostKeyRefused."""
        where = ", ".join(self.files)
        if key.asbytes() in self.revoked:
            raise HostKeyRefused("revoked", hostname, key, f"it is marked @revoked in {where}")
        recorded = self.keys.lookup(hostname) or {}
        expected = recorded.get(key.get_name())
        if expected is None:
            raise HostKeyRefused("unknown", hostname, key, f"not in {where}")
        if expected.asbytes() != key.asbytes():
            raise HostKeyRefused("changed", hostname, key,
                                 f"{where} records {fingerprint(expected)}")

    def record(self, hostname: str, key: paramiko.PKey) -> Path:
        """Append `key` for `hostname` to the first file (OpenSSH's choice); returns it."""
        path = Path(self.files[0])
        append_known_host(path, hostname, key)
        self.keys.add(hostname, key.get_name(), key)
        return path


def append_known_host(path: Path, hostname: str, key: paramiko.PKey) -> None:
    """Record `key` for `hostname` (as OpenSSH names it: "[host]:port" off port 22)."""
    line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
    with _APPEND_LOCK:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.is_file() and path.stat().st_size:
            with open(path, "rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    line = "\n" + line
        # One write() with O_APPEND: a reader never sees half a line and lines other
        # programs add meanwhile are kept (a rewrite-and-replace could drop them).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
