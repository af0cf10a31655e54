"""The `ssh` and `pct` transports through paramiko, where no OpenSSH client is installed
or the inventory says `ssh_client: paramiko` (openssh.py is the default): one SSH
connection per host per invocation, a channel per command.

The target (`user@host[:port]` or an alias of the user's ssh config) is resolved as
the user's OpenSSH client resolves it (ssh_options: `ssh -G`); paramiko then opens
the connection with those options: the host and port, ProxyJump hops (a direct-tcpip
channel of the previous hop's connection) or ProxyCommand, the host keys of every
known_hosts file OpenSSH reads, keys from the agent (also a non-default IdentityAgent
socket), the identity files and their OpenSSH certificates. Nothing ever prompts: a
key protected by a passphrase that no agent holds is named in the error.

Thread safety: opening and replacing the connection is serialized by a lock;
paramiko multiplexes channels of one connection safely, so several threads may run
commands on one transport at once.
"""
from __future__ import annotations

import logging
import os
import shlex
import socket
import threading
import time
from typing import BinaryIO, Iterator, Sequence

import paramiko
from paramiko.ssh_exception import NoValidConnectionsError

from ..errors import ConnectionLost, UnreachableError
from ..inventory import Host
from .base import Completed, Transport
from .common import (CHUNK, KEEPALIVE_COUNT, KEEPALIVE_S, SIGNALLED_EXIT, CommandFailed, Deadline,
                     ResultThread, Tally, feed_stdin, normalize_argv, read_to_end)
from .known_hosts import HostKeyRefused, KnownHosts, fingerprint
from .pct import ContainerHop
from .ssh_options import ResolvedTarget, SshOptions, resolve

_CONNECTION_LOST = (paramiko.SSHException, OSError, EOFError)

# Paramiko logs failures of its transport thread (with tracebacks) through logging,
# which ends on stderr when nothing is configured; each failure reaches the caller as
# an UnreachableError instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


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


def authenticate(transport: paramiko.Transport, options: SshOptions) -> None:
    """Public-key authentication in OpenSSH's order: agent keys (only those of the
    identity files with IdentitiesOnly), then the identity files. Never prompts."""
    tried: list[BaseException] = []
    locked: list[str] = []
    files = [path for path in options.identity_files if os.path.isfile(path)]
    wanted = {_public_blob(path) for path in files}
    in_agent = agent_keys(options)
    for key in in_agent:
        if options.identities_only and key.asbytes() not in wanted:
            continue
        try:
            transport.auth_publickey(options.user, key)
            return
        except paramiko.AuthenticationException as exc:
            tried.append(exc)
    offered = {key.asbytes() for key in in_agent}
    for path in files:
        try:
            key = paramiko.PKey.from_path(path)
        except (paramiko.PasswordRequiredException, TypeError):
            # TypeError: what cryptography raises for an OpenSSH-format key with a passphrase
            if _public_blob(path) not in offered:
                locked.append(path)
            continue
        except (OSError, ValueError, paramiko.SSHException) as exc:
            tried.append(exc)
            continue
        try:
            transport.auth_publickey(options.user, _with_certificate(key, path, options))
            return
        except paramiko.AuthenticationException as exc:
            tried.append(exc)
    if locked:
        raise KeyNeedsPassphrase(locked)
    raise paramiko.AuthenticationException(
        f"no key was accepted for {options.user} (tried {len(tried)}: agent keys and "
        f"{', '.join(files) or 'no identity file found'})")


class SshTransport(ResolvedTarget, Tally, Transport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        assert host.ssh, "Host validation guarantees `ssh` for ssh and pct hosts"
        super().__init__()
        self.host = host
        self.describe = host.ssh
        self._accept_new = accept_new_host_key
        self._lock = threading.Lock()  # guards _chain
        self._chain: list[paramiko.Transport] = []  # ProxyJump hops, then the host itself

    # -- the connection ------------------------------------------------------------------

    def _session_transport(self, stale: paramiko.Transport | None = None) -> paramiko.Transport:
        """The live connection's paramiko Transport, connecting when there is none, when
        it died, or when the caller found `stale` dead (another thread may have
        replaced it already)."""
        with self._lock:
            if self._chain and self._chain[-1].is_active() and self._chain[-1] is not stale:
                return self._chain[-1]
            self._close_chain()
            self._chain = self._open(self.options, via=None)
            return self._chain[-1]

    def _close_chain(self) -> None:
        for transport in reversed(self._chain):
            transport.close()
        self._chain = []

    def _open(self, options: SshOptions, via: paramiko.Transport | None) -> list[paramiko.Transport]:
        """Connect to `options`' host (through `via`, its own ProxyJump hops or its
        ProxyCommand); the chain of connections, the host's last."""
        chain: list[paramiko.Transport] = []
        if via is None and options.proxy_jump:
            for hop in options.proxy_jump.split(","):
                chain += self._open(resolve(hop, self.host), via=chain[-1] if chain else None)
            via = chain[-1]
        target = f"{options.user}@{options.hostname}:{options.port}"
        started = time.monotonic()
        seconds = self.host.connect_timeout
        try:
            try:
                if via is not None:
                    sock = via.open_channel("direct-tcpip", (options.hostname, options.port), ("127.0.0.1", 0),
                                            timeout=seconds)
                elif options.proxy_command:
                    sock = paramiko.ProxyCommand(options.proxy_command)
                else:
                    sock = socket.create_connection((options.hostname, options.port), timeout=seconds)
            except ConnectionRefusedError as exc:
                raise NoValidConnectionsError({(options.hostname, options.port): exc}) from exc
            transport = paramiko.Transport(sock)
            chain.append(transport)
            # Compression: a follow stream is mostly log text, which zlib shrinks
            # severalfold on the way from a rented box.
            transport.use_compression(True)
            transport.banner_timeout = transport.auth_timeout = transport.channel_timeout = seconds
            transport.start_client(timeout=seconds)
            self._check_host_key(options, transport.get_remote_server_key())
            authenticate(transport, options)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            for opened in reversed(chain):
                opened.close()
            raise self._unreachable(target, options, exc, time.monotonic() - started) from exc
        transport.set_keepalive(options.server_alive_interval or KEEPALIVE_S)
        sock = transport.sock
        # Keepalives alone never notice a vanished peer (paramiko does not wait for
        # replies); TCP_USER_TIMEOUT fails the socket when they go unacknowledged.
        if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_S * KEEPALIVE_COUNT * 1000)
        return chain

    def _check_host_key(self, options: SshOptions, key: paramiko.PKey) -> None:
        known = KnownHosts(options.known_hosts)
        try:
            known.check(options.host_key_name, key)
        except HostKeyRefused as exc:
            if exc.problem != "unknown" or not (self._accept_new or options.accept_new):
                raise
            known.record(options.host_key_name, key)

    def _unreachable(self, target: str, options: SshOptions, exc: BaseException, elapsed: float) -> UnreachableError:
        where = f"host {self._name()} ({target}) is unreachable"
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
