"""The `ssh` and `pct` transports through the user's own OpenSSH client, the default
wherever `ssh` is installed (docs/hosts.md).

Each command is `ssh -T TARGET -- QUOTED-ARGV`, a subprocess run as the local
transport runs one (streaming, stdin, process-group kill), so the user's config
applies unchanged: Include, Match, host certificates through @cert-authority,
ProxyJump, agents, certificates, their ControlMaster. dflash adds only what makes it
a batch client: BatchMode (nothing ever prompts), strict host key checking where the
config would ask (accept-new with --accept-new-host-key or `host_key: accept-new`),
keepalives and ConnectTimeout where the config sets none, and the inventory's
`identity_file`, `known_hosts` and port (as -i, -o, -p).

One connection per invocation: where the user's config shares connections
(ControlMaster auto/yes with a ControlPath) the commands join that master (with no
`ssh -O check` first where its socket is there); otherwise
dflash starts a master of its own, its socket in a private 0700 folder, and ends it
(`ssh -O exit`) when the transport closes. A short ControlPersist ends it anyway when
dflash is killed before that.

ssh exits 255 both when it failed and when the remote command did (or was killed by
a signal). ssh's own messages go to a log file per command (-E), never to the
command's stderr, so: a 255 with something in that log is ssh failing (host key,
authentication, name, refused, timeout) and becomes UnreachableError with ssh's own
words; a 255 with nothing there is the command's own when the master still answers
(`ssh -O check`), and a dropped connection (ConnectionLost) when it does not.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from itertools import count
from pathlib import Path

from ..errors import ConnectionLost, UnreachableError
from ..inventory import Host
from .common import KEEPALIVE_COUNT, KEEPALIVE_S, SIGNALLED_EXIT
from .local import LocalTransport
from .pct import ContainerHop
from .ssh_options import ResolvedTarget, SshOptions, config_file, split_target

#: seconds a master dflash started outlives its last command (a killed dflash leaves
#: it behind no longer than this)
CONTROL_PERSIST_S = 10
#: seconds ssh gets to open a master beyond connect_timeout (authentication, jumps)
_MASTER_GRACE_S = 60


#: what ssh -o LogLevel=DEBUG1 says besides its complaints
_CHATTER = re.compile(r"(debug|Connecting to|Connection established|Authenticated to|Server host key|Host '|"
                              r"Will attempt key|Offering public key|Server accepts key|Authenticating to|"
                              r"Remote protocol|Local version|kex_exchange_identification|Connection closed by|"
                              r"Transferred|Bytes per second|Found key|Warning: Permanently)")


def _quoted(path: str) -> str:
    """A path as an `-o` value: ssh splits those on spaces unless double-quoted."""
    return f'"{path}"'


class OpenSshTransport(ResolvedTarget, LocalTransport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        assert host.ssh, "Host validation guarantees `ssh` for ssh and pct hosts"
        super().__init__(host)
        self.describe = host.ssh
        self._accept_new = accept_new_host_key
        self._lock = threading.Lock()  # guards the master and the private folder
        self._folder: str | None = None  # 0700: dflash's ControlPath and the per-command logs
        self._connected = False  # a master was found or started since the folder was made
        self._logs = count()

    # -- options -------------------------------------------------------------------------

    @property
    def shares_users_master(self) -> bool:
        """Whether the user's config shares connections itself (then dflash joins it)."""
        return self.options.control_master in ("true", "auto") and self.options.control_path is not None

    def _private_folder(self) -> str:
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="dflash-ssh-")  # mode 0700
        return self._folder

    def _ssh(self, *extra: str, command: str | None = None, shared: bool = True) -> list[str]:
        """`ssh` with dflash's options, `extra`, the target, and `command` after `--`;
        `shared`: through the master (else a connection of its own)."""
        options, host = self.options, self.host
        user, name, port = split_target(host.ssh)
        config = config_file()
        args = ["ssh", *(["-F", config] if config else []), "-o", "BatchMode=yes"]
        if host.identity_file:
            args += ["-i", os.path.expanduser(host.identity_file)]
        if host.known_hosts:
            args += ["-o", f"UserKnownHostsFile={_quoted(os.path.expanduser(host.known_hosts))}"]
        if self._accept_new or options.accept_new:
            args += ["-o", "StrictHostKeyChecking=accept-new"]
        elif options.strict_host_key_checking == "ask":  # OpenSSH would ask; dflash refuses
            args += ["-o", "StrictHostKeyChecking=yes"]
        if options.server_alive_interval == 0:
            args += ["-o", f"ServerAliveInterval={KEEPALIVE_S}", "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"]
        if options.connect_timeout == "none":
            args += ["-o", f"ConnectTimeout={math.ceil(host.connect_timeout)}"]
        if not shared:
            args += ["-o", "ControlPath=none", "-o", "ControlMaster=no"]
        elif not self.shares_users_master:
            args += ["-o", f"ControlPath={_quoted(os.path.join(self._private_folder(), '%C'))}",
                     "-o", f"ControlPersist={CONTROL_PERSIST_S}"]
        elif options.control_persist == "no":
            # a master that lives as long as its first command would serve no other
            args += ["-o", f"ControlPersist={CONTROL_PERSIST_S}"]
        args += [*extra, *(["-l", user] if user else []), *(["-p", str(port)] if port else []), name]
        return args if command is None else [*args, "--", command]

    def _log(self) -> str:
        return os.path.join(self._private_folder(), f"ssh-{next(self._logs)}.log")

    @staticmethod
    def _said(log: str) -> str:
        """What ssh wrote to `log` (then removed)."""
        try:
            with open(log, encoding="utf-8", errors="replace") as file:
                text = file.read()
            os.unlink(log)
        except FileNotFoundError:
            return ""
        return text.strip()

    # -- the shared connection -------------------------------------------------------------

    def _control(self, operation: str) -> bool:
        """`ssh -O operation` (check, exit) on the master; whether it succeeded."""
        done = subprocess.run(self._ssh("-O", operation), stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=_MASTER_GRACE_S)
        return done.returncode == 0

    def _connect(self) -> None:
        """Make sure a master is up before the first command, so that commands started
        at once by several threads share it instead of each opening a connection."""
        with self._lock:
            if self._connected:
                return
            self._prepare_known_hosts()
            # Where the user's master has its socket, the commands join it with no
            # `ssh -O check` first (a process more on every invocation); should the socket be stale,
            # the first command replaces it and becomes the master (ControlMaster auto).
            if not (self.shares_users_master and _is_socket(self.options.control_path)):
                # -N with ControlPersist: ssh returns once authenticated, the master stays
                done, said = self._attempt("-N", "-o", "ControlMaster=yes")
                if done.returncode != 0:
                    raise self._unreachable(said)
            self._connected = True

    def _attempt(self, *extra: str, level: str = "ERROR", command: str | None = None,
                 shared: bool = True) -> tuple[subprocess.CompletedProcess[bytes], str]:
        """Run ssh to connect; what it said (its log and stderr) besides."""
        log = self._log()
        try:
            done = subprocess.run(self._ssh("-E", log, "-o", f"LogLevel={level}", *extra, command=command,
                                            shared=shared), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=self.host.connect_timeout + _MASTER_GRACE_S)
        except subprocess.TimeoutExpired as exc:
            raise UnreachableError(f"host {self._name()} ({self._target()}) is unreachable: ssh did "
                                   f"not connect within {exc.timeout:g} s") from exc
        return done, "\n".join(filter(None, (self._said(log), done.stderr.decode("utf-8", "replace").strip())))

    def _diagnose(self) -> str:
        """What ssh says, connecting once more without a master: a ProxyJump hop's own
        messages (a master sends them to /dev/null) and the key the host sent (a debug line)."""
        done, said = self._attempt("-T", level="DEBUG1", command="true", shared=False)
        return said if done.returncode != 0 else ""

    def _prepare_known_hosts(self) -> None:
        """Before ssh may record a new host key: the first known_hosts file's folder
        exists (ssh would skip recording otherwise) and its last line ends (ssh would
        append to it)."""
        if not (self._accept_new or self.options.accept_new) or not self.options.known_hosts:
            return
        path = Path(self.options.known_hosts[0])
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.is_file() and path.stat().st_size:
            with open(path, "rb+") as known:
                known.seek(-1, os.SEEK_END)
                if known.read(1) != b"\n":
                    known.write(b"\n")

    def close(self) -> None:
        """End dflash's own master (a user's master is theirs) and remove the folder."""
        with self._lock:
            if self._folder is None:
                return
            if not self.shares_users_master:
                self._control("exit")
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder, self._connected = None, False

    # -- commands ------------------------------------------------------------------------

    def _wrap(self, argv: list[str]) -> list[str]:
        """The argv the server's shell runs for `argv`."""
        return argv

    def _check_reachable(self, argv: list[str], code: int, stderr: bytes) -> None:
        """Raise UnreachableError when `code` says the target, not the command, failed."""

    def _command(self, argv: list[str]) -> list[str]:
        self._connect()
        # ControlMaster auto: should the master have gone (dropped, ControlPersist over),
        # this command opens the next one (or, with no master yet, becomes it)
        return self._ssh("-T", "-E", self._log(), "-o", "LogLevel=ERROR", "-o", "ControlMaster=auto",
                         command=shlex.join(self._wrap(argv)))  # the one quoting, for the server's shell

    def _outcome(self, proc: subprocess.Popen[bytes], argv: list[str], code: int, stderr: bytes) -> int:
        command = list(proc.args)  # type: ignore[arg-type]
        said = self._said(command[command.index("-E") + 1])
        if code == SIGNALLED_EXIT:
            if said:
                raise self._unreachable(said)
            if not self._control("check"):
                with self._lock:
                    self._connected = False
                raise ConnectionLost(f"{self._where()}: connection lost while running `{argv[0]}`")
        self._check_reachable(argv, code, stderr)
        return code

    # -- ssh's failures, in dflash's words -----------------------------------------------------

    def _target(self) -> str:
        options = self.options
        return f"{options.user}@{options.hostname}:{options.port}"

    def _unreachable(self, said: str) -> UnreachableError:
        options = self.options
        where = f"host {self._name()} ({self._target()}) is unreachable"
        if options.proxy_jump:
            where += f" (through ProxyJump {options.proxy_jump})"
        unclear = options.proxy_jump or options.proxy_command
        if re.search(r"host key is known for|Host key verification failed", said) or (
                unclear and not re.search(r"Permission denied|Could not resolve|refused|timed out", said)):
            diagnosis = self._diagnose()
            sent = re.search(r"Server host key: (\S+) (\S+)", diagnosis)
            # the verbose lines are not ssh's complaint; the hop's messages are
            said += "".join(f"\n{line}" for line in diagnosis.splitlines() if not _CHATTER.match(line))
            if sent:
                said += f"\nthe host sent {sent.group(1)} {sent.group(2)}"
        lines = list(dict.fromkeys(line.strip() for line in said.splitlines()
                                   if line.strip() and not line.startswith("@@@")))
        ssh_says = "ssh: " + "; ".join(line.removeprefix("ssh: ") for line in lines[-3:])

        def found(pattern: str) -> re.Match[str] | None:
            return re.search(pattern, said, re.I)

        files = ", ".join(options.known_hosts)
        if found(r"REMOTE HOST IDENTIFICATION HAS CHANGED"):
            return UnreachableError(
                f"{where}: the host key has CHANGED; refused ({'; '.join(lines)})",
                hint="if the host was reinstalled, delete its old line from that known_hosts file")
        if found(r"REVOKED HOST KEY|was revoked"):
            return UnreachableError(f"{where}: the host key is REVOKED; refused ({ssh_says})")
        if found(r"host key is known for|Host key verification failed"):
            return UnreachableError(
                f"{where}: its host key is unknown or unverified; refused ({ssh_says}; known_hosts files: {files})",
                hint="to trust this key, run again with --accept-new-host-key, or set host_key: accept-new "
                     "for this host in the inventory")
        if found(r"Permission denied"):
            if locked := _locked_keys(options):
                return UnreachableError(
                    f"{where}: the key {', '.join(locked)} is protected by a passphrase and no agent offers it; "
                    f"dflash never asks for a passphrase", hint=f"load it into your agent first: ssh-add {locked[0]}")
            return UnreachableError(f"{where}: authentication failed ({ssh_says})",
                                    hint="check identity_file and the user in `ssh:`, or `dflash hosts --check -v`")
        if match := found(r"Could not resolve hostname [^:]*: (.*)"):
            alias = "" if options.hostname != split_target(options.target)[1] else (
                "; it is no alias of your ssh config either")
            return UnreachableError(f"{where}: cannot resolve the host name ({match.group(1).strip()}){alias}")
        if found(r"Connection refused"):
            return UnreachableError(f"{where}: connection refused ({ssh_says})")
        if found(r"timed out"):
            return UnreachableError(
                f"{where}: no SSH answer within {self.host.connect_timeout:g} s (connect_timeout; {ssh_says})")
        return UnreachableError(f"{where}: {ssh_says if lines else 'ssh failed without a word'}")


class OpenSshPctTransport(ContainerHop, OpenSshTransport):
    def __init__(self, host: Host, *, accept_new_host_key: bool = False):
        super().__init__(host, accept_new_host_key=accept_new_host_key)
        self._enter_container(host)


def _is_socket(path: str | None) -> bool:
    try:
        return path is not None and stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _run_quietly(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, env=env)


def _locked_keys(options: SshOptions) -> list[str]:
    """The identity files that need a passphrase and that no agent holds: what BatchMode
    skipped without a word (looked for only once authentication failed)."""
    agent = options.identity_agent or os.environ.get("SSH_AUTH_SOCK")
    offered: set[str] = set()
    if agent and agent != "none":
        listed = _run_quietly(["ssh-add", "-L"], {**os.environ, "SSH_AUTH_SOCK": agent}).stdout
        offered = {words[1] for words in map(str.split, listed.splitlines()) if len(words) > 1}
    return [path for path in options.identity_files if os.path.isfile(path)
            and "passphrase" in _run_quietly(["ssh-keygen", "-y", "-P", "", "-f", path]).stderr
            and _public_key(path) not in offered]


def _public_key(path: str) -> str | None:
    """The base64 part of the key's PATH.pub, where there is one."""
    try:
        with open(path + ".pub", encoding="utf-8") as public:
            words = public.read().split()
    except OSError:
        return None
    return words[1] if len(words) > 1 else None
