"""The `ssh` transport: one SSH connection per host per invocation, a channel per command.

Fabric resolves the target (`user@host[:port]` or a ~/.ssh/config alias with its
HostName, User, Port, IdentityFile and ProxyJump) and opens the connection; the bytes
go through paramiko channels directly, because Fabric's stream handling is text and
pty oriented. Host keys are checked against one known_hosts file (the host's
`known_hosts`, else ~/.ssh/known_hosts) on every hop: Fabric's default would accept
any key.

Thread safety: Fabric's Connection is not thread-safe, so opening and replacing it is
serialized by a lock; paramiko multiplexes channels of one connection safely, so
several threads may run commands on one transport at once.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

import fabric
import paramiko
from paramiko.ssh_exception import NoValidConnectionsError

from ..errors import ConnectionLost, DflashError, ExitCode, UnreachableError
from ..inventory import Host
from .base import Completed, Transport
from .common import (CHUNK, CommandFailed, Deadline, Tally, Worker, feed_stdin, normalize_argv,
                     read_to_end)

#: seconds between keepalive packets; with TCP_USER_TIMEOUT a silent peer is dropped
#: after KEEPALIVE_S * KEEPALIVE_COUNT seconds (OpenSSH's ServerAliveInterval/CountMax)
KEEPALIVE_S = 5
KEEPALIVE_COUNT = 3
#: the exit code of a command killed by a signal: sshd sends no exit status then, and
#: OpenSSH's client reports 255 as well
SIGNALLED_EXIT = 255
#: guards appends to known_hosts files by the transports of this process
_KNOWN_HOSTS_LOCK = threading.Lock()
_CONNECTION_LOST = (paramiko.SSHException, OSError, EOFError)

# Paramiko logs failures of its transport thread (with tracebacks) through logging,
# which ends on stderr when nothing is configured; each failure reaches the caller as
# an UnreachableError instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as `ssh-keygen -l` prints it (SHA256:base64, no padding)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey):
        super().__init__(f"unknown host key for {hostname}")
        self.hostname = hostname
        self.key = key


def append_known_host(path: Path, hostname: str, key: paramiko.PKey) -> None:
    """Record `key` for `hostname` (as paramiko names it: "[host]:port" off port 22)."""
    line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
    with _KNOWN_HOSTS_LOCK:
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


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """Paramiko calls this only for a host with no key on record; a key that differs
    from the recorded one raises BadHostKeyException before, and is always refused."""

    def __init__(self, known_hosts: Path, accept_new: bool):
        self.known_hosts = known_hosts
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise UnknownHostKey(hostname, key)
        append_known_host(self.known_hosts, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def _close_chain(conn: fabric.Connection) -> None:
    """Close a connection and its ProxyJump gateways (Fabric's close() leaves those open)."""
    conn.client.close()
    if isinstance(conn.gateway, fabric.Connection):
        _close_chain(conn.gateway)


class SshTransport(Tally, Transport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        assert host.ssh, "Host validation guarantees `ssh` for ssh and pct hosts"
        super().__init__()
        self.host = host
        self.describe = host.ssh
        self._accept_new = accept_new_host_key or host.host_key == "accept-new"
        self._known_hosts = Path(os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts"))
        self._lock = threading.Lock()  # guards _connection
        self._connection: fabric.Connection | None = None

    # -- the connection ------------------------------------------------------------------

    def _name(self) -> str:
        return self.host.name or self.host.ssh or "?"

    def _where(self) -> str:
        """The inventory name and the hop chain, for messages: "ct200 (root@node -> pct 200)"."""
        return f"{self.host.name} ({self.describe})" if self.host.name else self.describe

    def _session_transport(self, stale: paramiko.Transport | None = None) -> paramiko.Transport:
        """The live connection's paramiko Transport, connecting when there is none, when
        it died, or when the caller found `stale` dead (another thread may have
        replaced it already)."""
        with self._lock:
            conn = self._connection
            if conn is not None and conn.is_connected and conn.transport is not stale:
                return conn.transport
            if conn is not None:
                _close_chain(conn)
                self._connection = None
            self._connection = self._connect()
            return self._connection.transport

    def _connect(self) -> fabric.Connection:
        # Compression: a follow stream is mostly log text, which zlib shrinks severalfold
        # on the way from a rented box; release tars are gzipped already and cost little.
        connect_kwargs: dict = {"compress": True}
        if self.host.identity_file:
            connect_kwargs["key_filename"] = [os.path.expanduser(self.host.identity_file)]
        conn = fabric.Connection(self.host.ssh, connect_kwargs=connect_kwargs)
        self._harden(conn)
        target = f"{conn.user}@{conn.host}:{conn.port}"
        started = time.monotonic()
        try:
            conn.open()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            _close_chain(conn)
            raise self._unreachable(target, exc, time.monotonic() - started) from exc
        transport = conn.transport
        transport.set_keepalive(KEEPALIVE_S)
        sock = transport.sock
        # Keepalives alone never notice a vanished peer (paramiko does not wait for
        # replies); TCP_USER_TIMEOUT fails the socket when they go unacknowledged.
        if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_S * KEEPALIVE_COUNT * 1000)
        return conn

    def _harden(self, conn: fabric.Connection) -> None:
        """Replace Fabric's accept-any-key client, and its whole-second connect timeout,
        on this hop and every ProxyJump hop before it."""
        client = paramiko.SSHClient()
        if self._known_hosts.is_file():
            try:
                client.get_host_keys().load(str(self._known_hosts))
            except (OSError, paramiko.SSHException) as exc:
                raise DflashError(f"{self._name()}: cannot read known_hosts file {self._known_hosts}: {exc}",
                                  ExitCode.USAGE) from exc
        client.set_missing_host_key_policy(KnownHostsPolicy(self._known_hosts, self._accept_new))
        conn.client = client
        seconds = self.host.connect_timeout
        conn.connect_timeout = None  # Fabric rounds it down to an int; paramiko takes floats
        conn.connect_kwargs.update(timeout=seconds, banner_timeout=seconds, auth_timeout=seconds,
                                   channel_timeout=seconds)
        if isinstance(conn.gateway, fabric.Connection):
            self._harden(conn.gateway)

    def _unreachable(self, target: str, exc: BaseException, elapsed: float) -> UnreachableError:
        where = f"host {self._name()} ({target}) is unreachable"
        known = self._known_hosts
        if isinstance(exc, UnknownHostKey):
            return UnreachableError(
                f"{where}: its host key is unknown ({exc.hostname} {exc.key.get_name()} "
                f"{fingerprint(exc.key)} is not in {known}); refused",
                hint="to trust this key, run again with --accept-new-host-key, "
                     "or set host_key: accept-new for this host in the inventory")
        if isinstance(exc, paramiko.BadHostKeyException):
            return UnreachableError(
                f"{where}: the host key of {exc.hostname} has CHANGED (it sent {exc.key.get_name()} "
                f"{fingerprint(exc.key)}; {known} records {fingerprint(exc.expected_key)}); refused",
                hint=f"if the host was reinstalled, delete its old line from {known}")
        if isinstance(exc, paramiko.AuthenticationException) or "authentication" in str(exc).lower():
            return UnreachableError(f"{where}: authentication failed ({exc})",
                                    hint="check identity_file and the user in `ssh:`")
        if isinstance(exc, socket.gaierror):
            return UnreachableError(f"{where}: cannot resolve the host name ({exc.strerror})")
        if isinstance(exc, NoValidConnectionsError):
            return UnreachableError(f"{where}: connection refused")
        if isinstance(exc, TimeoutError) or elapsed >= self.host.connect_timeout:
            # paramiko reports a handshake that ran out of time as some later step failing
            return UnreachableError(f"{where}: no SSH answer within {self.host.connect_timeout:g} s (connect_timeout)")
        if isinstance(exc, paramiko.SSHException):
            return UnreachableError(f"{where}: SSH handshake failed ({exc})")
        return UnreachableError(f"{where}: {getattr(exc, 'strerror', None) or exc}")

    def _lost(self, argv: Sequence[str], exc: BaseException | None = None) -> ConnectionLost:
        detail = f" ({exc})" if exc else ""
        return ConnectionLost(f"{self._where()}: connection lost while running `{argv[0]}`{detail}")

    def _alive(self, transport: paramiko.Transport) -> bool:
        """Whether the server still answers (a request it must reply to, even if only 'no')."""
        try:
            transport.global_request("keepalive@openssh.com", wait=True)
        except _CONNECTION_LOST:
            return False
        return transport.is_active()

    # -- commands ------------------------------------------------------------------------

    def _wrap(self, argv: list[str]) -> list[str]:
        """The argv the server's shell runs for `argv`."""
        return argv

    def _check_reachable(self, argv: list[str], code: int, stderr: bytes) -> None:
        """Raise UnreachableError when `code` says the target, not the command, failed."""

    def _exec(self, argv: list[str]) -> paramiko.Channel:
        command = shlex.join(self._wrap(argv))  # the one quoting, for the server's login shell
        transport = self._session_transport()
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout)
        except paramiko.ChannelException as exc:
            raise UnreachableError(f"{self._where()}: the server refused a new session ({exc})",
                                   hint="too many commands at once for the server's MaxSessions?") from exc
        except _CONNECTION_LOST:
            # The connection died since it was last used. Nothing ran yet, so one new
            # connection is safe.
            transport = self._session_transport(stale=transport)
            try:
                chan = transport.open_session(timeout=self.host.connect_timeout)
            except _CONNECTION_LOST as exc:
                raise self._lost(argv, exc) from exc
        try:
            chan.exec_command(command)
        except _CONNECTION_LOST as exc:
            chan.close()
            raise self._lost(argv, exc) from exc
        self.tally(trips=1)
        return chan

    def _exit_status(self, chan: paramiko.Channel, argv: list[str]) -> int:
        code = chan.recv_exit_status()  # returns once the status arrived or the channel closed
        if code >= 0:
            return code
        if self._alive(chan.get_transport()):
            return SIGNALLED_EXIT
        raise self._lost(argv)

    @staticmethod
    def _close_stdin(chan: paramiko.Channel) -> None:
        try:
            chan.shutdown_write()
        except _CONNECTION_LOST:
            pass  # the channel is gone already; the exit status says why

    def _feed(self, chan: paramiko.Channel, stdin: bytes | BinaryIO | None, argv: list[str]) -> None:
        if stdin is not None:
            feed_stdin(stdin, chan.sendall, chan.close, f"{self._where()}: `{argv[0]}`", self.tally)
        self._close_stdin(chan)

    def run(self, argv: Sequence[str], *, stdin: bytes | BinaryIO | None = None,
            timeout: float | None = None) -> Completed:
        args = normalize_argv(argv)
        chan = self._exec(args)
        try:
            deadline = Deadline(timeout, chan.close)
            # stdin, stdout and stderr move at once: a command that answers while it
            # reads would otherwise fill the channel window and hang (paramiko #448)
            feeder = Worker(f"{self._name()}-stdin", lambda: self._feed(chan, stdin, args))
            errors = Worker(f"{self._name()}-stderr", lambda: read_to_end(chan.recv_stderr))
            feeder.start()
            errors.start()
            try:
                out = read_to_end(chan.recv)
                err = errors.result()
                feeder.result()
            finally:
                deadline.cancel()
            if deadline.expired:
                raise UnreachableError(f"{self._where()}: `{args[0]}` did not finish within {timeout:g} s")
            self.tally(received=len(out) + len(err))
            code = self._exit_status(chan, args)
        finally:
            chan.close()
        self._check_reachable(args, code, err)
        return Completed(tuple(args), code, out, err)

    def chunks(self, argv: Sequence[str]) -> Iterator[bytes]:
        args = normalize_argv(argv)
        chan = self._exec(args)
        try:
            self._close_stdin(chan)
            errors = Worker(f"{self._name()}-stderr", lambda: read_to_end(chan.recv_stderr))
            errors.start()
            while data := chan.recv(CHUNK):
                self.tally(received=len(data))
                yield data
            err = errors.result()
            self.tally(received=len(err))
            code = self._exit_status(chan, args)
            self._check_reachable(args, code, err)
            if code != 0:
                raise CommandFailed(self._where(), args, code, err)
        finally:
            chan.close()  # also when the consumer stops early: the remote side gets EPIPE

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                _close_chain(self._connection)
                self._connection = None
