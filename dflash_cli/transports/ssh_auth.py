"""Public-key authentication for the in-process SSH client (ssh.py) as the OpenSSH
client does it, without ever prompting: what neither Fabric nor paramiko does.

Fabric's OpenSSHAuthStrategy asks for a password on the terminal when the keys fail,
offers every agent key whatever IdentitiesOnly says, reads only $SSH_AUTH_SOCK and
sends no certificate named by CertificateFile; paramiko's SSHClient tries the key
files before the agent. `OpenSshKeys` is a paramiko AuthStrategy (what Fabric hands
to SSHClient.connect) that yields, in OpenSSH's order: the agent's keys (the
IdentityAgent socket, else $SSH_AUTH_SOCK; with IdentitiesOnly only those of the
identity files), then the identity files, each with its OpenSSH certificate. A key
protected by a passphrase that no agent offers is named in the error.
"""
from __future__ import annotations

import os
import socket
from typing import Iterator

import paramiko
from paramiko.auth_strategy import AuthFailure, AuthSource, AuthStrategy, InMemoryPrivateKey

from .ssh_options import SshOptions


class KeyNeedsPassphrase(paramiko.AuthenticationException):
    def __init__(self, paths: list[str]):
        super().__init__(f"the key {', '.join(paths)} is protected by a passphrase and no agent offers it")
        self.paths = paths


class _AgentAt(paramiko.agent.AgentSSH):
    """The agent listening on `path` (paramiko's Agent only reads $SSH_AUTH_SOCK)."""

    def __init__(self, path: str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self._conn = None
        self._keys = ()
        self._connect(sock)


def agent_keys(options: SshOptions) -> tuple[paramiko.AgentKey, ...]:
    path = options.identity_agent if options.identity_agent else os.environ.get("SSH_AUTH_SOCK")
    if not path or path == "none":
        return ()
    try:
        return tuple(_AgentAt(path).get_keys())
    except (OSError, paramiko.SSHException):
        return ()  # OpenSSH too goes on without an agent it cannot reach


def _public_blob(path: str) -> bytes | None:
    try:
        return paramiko.PublicBlob.from_file(path + ".pub").key_blob
    except (OSError, ValueError, paramiko.SSHException):
        return None


def _with_certificate(key: paramiko.PKey, path: str, options: SshOptions) -> paramiko.PKey:
    """`key` with the OpenSSH certificate OpenSSH would send along (CertificateFile,
    else PATH-cert.pub), when there is one for it."""
    for candidate in (*options.certificate_files, path + "-cert.pub"):
        if os.path.isfile(candidate):
            try:
                key.load_certificate(candidate)
                return key
            except ValueError:
                continue  # a certificate for another key
    return key


class OpenSshKeys(AuthStrategy):
    """The keys of `options` in OpenSSH's order; raises KeyNeedsPassphrase, or an
    AuthenticationException naming what was tried, when none is accepted."""

    def __init__(self, options: SshOptions):
        super().__init__(ssh_config=None)
        self.options = options
        self.files = [path for path in options.identity_files if os.path.isfile(path)]
        self.locked: list[str] = []  # identity files that need a passphrase no agent offers

    def get_sources(self) -> Iterator[AuthSource]:
        user = self.options.user
        wanted = {_public_blob(path) for path in self.files}
        in_agent = agent_keys(self.options)
        for key in in_agent:
            if not self.options.identities_only or key.asbytes() in wanted:
                yield InMemoryPrivateKey(user, key)
        offered = {key.asbytes() for key in in_agent}
        for path in self.files:
            try:
                key = paramiko.PKey.from_path(path)
            except (paramiko.PasswordRequiredException, TypeError):
                # TypeError: what cryptography raises for an OpenSSH-format key with a passphrase
                if _public_blob(path) not in offered:
                    self.locked.append(path)
                continue
            except (OSError, ValueError, paramiko.SSHException):
                continue  # not a key paramiko reads; OpenSSH skips it too
            yield InMemoryPrivateKey(user, _with_certificate(key, path, self.options))

    def authenticate(self, transport: paramiko.Transport) -> list:
        try:
            return super().authenticate(transport)
        except AuthFailure as failed:
            # AuthStrategy records every exception of a key's attempt; one that is no
            # refusal (the connection ended, the handshake timed out) is what to report
            for _, outcome in failed.result:
                if isinstance(outcome, Exception) and not isinstance(outcome, paramiko.AuthenticationException):
                    raise outcome from failed
            if self.locked:
                raise KeyNeedsPassphrase(self.locked) from failed
            raise paramiko.AuthenticationException(
                f"no key was accepted for {self.options.user} (tried {len(failed.result)}: agent keys and "
                f"{', '.join(self.files) or 'no identity file found'})") from failed
