"""The `ssh` and `pct` transports in-process, where no OpenSSH client is installed or
the inventory says `ssh_client: paramiko` (openssh.py is the default): one SSH
connection per host per invocation, a channel per command.

The target (`user@host[:port]` or an alias of the user's ssh config) is resolved as
the user's OpenSSH client resolves it (ssh_options: `ssh -G`). Fabric's Connection
then opens it with those options and with no configuration of its own (no
~/.ssh/config, no fabric.yaml): a ProxyJump hop is the gateway Connection of the
next, connect_timeout bounds every step of the handshake, zlib compression is on.
What Fabric does not do stays here: the host key checked against every known_hosts
file OpenSSH reads, `@revoked` included (a policy on Fabric's client, which keeps no
keys of its own), authentication as OpenSSH does it and never prompting
(ssh_auth.py), ProxyCommand with OpenSSH's tokens (Fabric's gateway command expands
%p to 22 and %r to the local user).

Commands do not use Connection.run: Invoke's runner decodes output to text, feeds
stdin from a file one byte per 10 ms and joins all the output captured so far again
for every 1000 bytes it reads (docs/hosts.md; bench/fabric_run.py measures it). Each
command is a channel of the connection that the methods below pump themselves.

Thread safety: opening and replacing the connection is serialized by a lock;
paramiko multiplexes channels of one connection safely, so several threads may run
commands on one transport at once.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import threading
import time
from typing import BinaryIO, Iterator, Sequence

import fabric
import paramiko
from paramiko.ssh_exception import NoValidConnectionsError

from ..errors import ConnectionLost, UnreachableError
from ..inventory import Host
from .base import Completed, Transport
from .common import (CHUNK, KEEPALIVE_COUNT, KEEPALIVE_S, SIGNALLED_EXIT, CommandFailed, Deadline,
                     ResultThread, Tally, feed_stdin, normalize_argv, read_to_end)
from .known_hosts import HostKeyRefused, KnownHosts, fingerprint
from .pct import ContainerHop
from .ssh_auth import KeyNeedsPassphrase, OpenSshKeys
from .ssh_options import ResolvedTarget, SshOptions, resolve, split_target

_CONNECTION_LOST = (paramiko.SSHException, OSError, EOFError)

# Paramiko logs failures of its transport thread (with tracebacks) through logging,
# which ends on stderr when nothing is configured; each failure reaches the caller as
# an UnreachableError instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class _KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """Fabric's client is given no host keys, so it asks this policy about every key
    (Fabric's own policy adds any): it must be on record in `options`' known_hosts
    files and not revoked; an unknown one is recorded where accepting new keys is
    allowed."""

    def __init__(self, options: SshOptions, accept_new: bool):
        self.options = options
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        known = KnownHosts(self.options.known_hosts)
        try:
            known.check(self.options.host_key_name, key)
        except HostKeyRefused as exc:
            if exc.problem != "unknown" or not self.accept_new:
                raise
            known.record(self.options.host_key_name, key)


def _proxy_command(options: SshOptions) -> paramiko.ProxyCommand:
    """options' ProxyCommand as OpenSSH runs it: its tokens expanded (`ssh -G` prints
    them as written), by the user's shell with exec."""
    assert options.proxy_command
    tokens = {"h": options.hostname, "p": str(options.port), "r": options.user,
              "n": split_target(options.target)[1], "%": "%"}
    command = re.sub(r"%(.)", lambda found: tokens.get(found.group(1), found.group(0)), options.proxy_command)
    return paramiko.ProxyCommand(shlex.join([os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"]))


def _close(connection: fabric.Connection) -> None:
    connection.close()
    # Fabric's close leaves alone a client whose connect failed half-way (its transport
    # thread still runs)
    connection.client.close()


class SshTransport(ResolvedTarget, Tally, Transport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        assert host.ssh, "Host validation guarantees `ssh` for ssh and pct hosts"
        super().__init__()
        self.host = host
        self.describe = host.ssh
        self._accept_new = accept_new_host_key
        self._lock = threading.Lock()  # guards _chain
        self._chain: list[fabric.Connection] = []  # ProxyJump hops, then the host itself

    # -- the connection ------------------------------------------------------------------

    def _session_transport(self, stale: paramiko.Transport | None = None) -> paramiko.Transport:
        """The live connection's paramiko Transport, connecting when there is none, when
        it died, or when the caller found `stale` dead (another thread may have
        replaced it already)."""
        with self._lock:
            if self._chain and self._chain[-1].is_connected and self._chain[-1].transport is not stale:
                return self._chain[-1].transport
            self._close_chain()
            self._chain = self._open(self.options, via=None)
            return self._chain[-1].transport

    def _close_chain(self) -> None:
        for connection in reversed(self._chain):
            _close(connection)
        self._chain = []

    def _open(self, options: SshOptions, via: fabric.Connection | None) -> list[fabric.Connection]:
        """Connect to `options`' host (through `via`, its own ProxyJump hops or its
        ProxyCommand); the chain of connections, the host's last. Each hop is opened
        on its own, so that a failure names the hop that failed."""
        chain: list[fabric.Connection] = []
        if via is None and options.proxy_jump:
            for hop in options.proxy_jump.split(","):
                chain += self._open(resolve(hop, self.host), via=chain[-1] if chain else None)
            via = chain[-1]
        target = f"{options.user}@{options.hostname}:{options.port}"
        started = time.monotonic()
        seconds = self.host.connect_timeout
        try:
            connection = fabric.Connection(
                options.hostname, user=options.user, port=options.port, gateway=via or False,
                config=fabric.Config(ssh_config=paramiko.SSHConfig(), lazy=True),
                # the timeout in connect_kwargs: Fabric's connect_timeout is cut to whole seconds
                connect_kwargs={"timeout": seconds, "banner_timeout": seconds, "auth_timeout": seconds,
                                "channel_timeout": seconds, "auth_strategy": OpenSshKeys(options),
                                # a follow stream is mostly log text, which zlib shrinks
                                # severalfold on the way from a rented box
                                "compress": True,
                                **({"sock": _proxy_command(options)} if via is None and options.proxy_command else {})})
            chain.append(connection)
            connection.client.set_missing_host_key_policy(
                _KnownHostsPolicy(options, self._accept_new or options.accept_new))
            connection.open()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            for opened in reversed(chain):
                _close(opened)
            raise self._unreachable(target, options, exc, time.monotonic() - started) from exc
        transport = connection.transport
        transport.set_keepalive(options.server_alive_interval or KEEPALIVE_S)
        sock = transport.sock
        # Keepalives alone never notice a vanished peer (paramiko does not wait for
        # replies); TCP_USER_TIMEOUT fails the socket when they go unacknowledged.
        if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_S * KEEPALIVE_COUNT * 1000)
        return chain

    def _unreachable(self, target: str, options: SshOptions, exc: BaseException, elapsed: float) -> UnreachableError:
        if options is not self.options:  # one of its ProxyJump hops failed
            where = f"host {self._name()} is unreachable at its ProxyJump hop {options.target} ({target})"
        else:
            where = f"host {self._name()} ({target}) is unreachable" + (
                f" (through ProxyJump {options.proxy_jump})" if options.proxy_jump else "")
        if isinstance(exc, HostKeyRefused) and exc.problem == "unknown":
            return UnreachableError(
                f"{where}: its host key is unknown ({exc.hostname} {exc.key.get_name()} "
                f"{fingerprint(exc.key)} is {exc.detail}); refused",
                hint="to trust this key, run again with --accept-new-host-key, or set host_key: accept-new "
                     "for this host in the inventory" + (
                         "; @cert-authority lines are not used by dflash: record the host's own key"
                         if KnownHosts(options.known_hosts).has_cert_authority else ""))
        if isinstance(exc, HostKeyRefused) and exc.problem == "changed":
            return UnreachableError(
                f"{where}: the host key of {exc.hostname} has CHANGED (it sent {exc.key.get_name()} "
                f"{fingerprint(exc.key)}; {exc.detail}); refused",
                hint="if the host was reinstalled, delete its old line from that known_hosts file")
        if isinstance(exc, HostKeyRefused):
            return UnreachableError(f"{where}: the host key of {exc.hostname} ({fingerprint(exc.key)}) "
                                    f"is REVOKED: {exc.detail}; refused")
        if isinstance(exc, KeyNeedsPassphrase):
            return UnreachableError(f"{where}: {exc}; dflash never asks for a passphrase",
                                    hint=f"load it into your agent first: ssh-add {exc.paths[0]}")
        if isinstance(exc, paramiko.AuthenticationException) or "authentication" in str(exc).lower():
            return UnreachableError(f"{where}: authentication failed ({exc})",
                                    hint="check identity_file and the user in `ssh:`, or `dflash hosts --check -v`")
        if isinstance(exc, socket.gaierror):
            alias = "" if options.hostname != options.target.rpartition("@")[2].partition(":")[0] else (
                "; it is no alias of your ssh config either")
            return UnreachableError(f"{where}: cannot resolve the host name ({exc.strerror}){alias}")
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
            feeder = ResultThread(f"{self._name()}-stdin", lambda: self._feed(chan, stdin, args))
            errors = ResultThread(f"{self._name()}-stderr", lambda: read_to_end(chan.recv_stderr))
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
            errors = ResultThread(f"{self._name()}-stderr", lambda: read_to_end(chan.recv_stderr))
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
            self._close_chain()


class PctTransport(ContainerHop, SshTransport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        super().__init__(host, accept_new_host_key=accept_new_host_key)
        self._enter_container(host)
