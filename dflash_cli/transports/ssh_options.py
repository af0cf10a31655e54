"""What one SSH target resolves to, the way the user's OpenSSH client resolves it.

Where an OpenSSH client is installed, `ssh -G TARGET` prints the effective options
after `Include`, `Match`, `Host` patterns and the built-in defaults; that answer is
used as is. Without a client, paramiko's config parser reads ~/.ssh/config (no
`Include`, no `Match`) and says so. The inventory's `identity_file` and
`known_hosts` override either answer; a port in `ssh:` overrides the config's.

DFLASH_SSH_CONFIG names another client config file (OpenSSH's `ssh -F`).
"""
from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import subprocess
from pathlib import Path
from typing import Mapping

from ..errors import DflashError, ExitCode
from ..inventory import Host

#: the environment variable naming the client config file (`ssh -F`)
CONFIG_ENV = "DFLASH_SSH_CONFIG"
#: what `ssh -G` says for the options dflash uses (its keys are lower case)
USED = ("hostname", "port", "user", "identityfile", "identitiesonly", "identityagent", "certificatefile",
        "userknownhostsfile", "globalknownhostsfile", "stricthostkeychecking", "proxyjump",
        "proxycommand", "connecttimeout", "serveraliveinterval", "controlmaster", "controlpath",
        "controlpersist")
_DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


@dataclasses.dataclass(frozen=True)
class SshOptions:
    target: str  # as written: alias, host, user@host[:port]
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    identity_agent: str | None  # a socket path; None: $SSH_AUTH_SOCK; "none": no agent
    certificate_files: tuple[str, ...]
    known_hosts: tuple[str, ...]  # every file read, the first one written by accept-new
    accept_new: bool  # StrictHostKeyChecking accept-new (a changed key is refused always)
    proxy_jump: str | None
    proxy_command: str | None
    server_alive_interval: int
    strict_host_key_checking: str  # as ssh -G says it: ask, yes, accept-new, no...
    connect_timeout: str  # seconds, or "none"
    # the user's connection sharing (the OpenSSH client reuses it): ControlMaster as
    # ssh -G says it (false, true, auto, ask, autoask), ControlPath or None, ControlPersist
    control_master: str
    control_path: str | None
    control_persist: str
    resolved_by: str  # "ssh -G" or "paramiko (no OpenSSH client)"
    sources: Mapping[str, str]  # option -> where its value came from

    def explain(self) -> list[tuple[str, str, str]]:
        """(OpenSSH option, effective value, where it came from), for `hosts --check -v`."""
        values = [("HostName", self.hostname, "hostname"), ("Port", str(self.port), "port"),
                  ("User", self.user, "user"),
                  ("IdentityFile", " ".join(self.identity_files) or "none", "identityfile"),
                  ("IdentitiesOnly", "yes" if self.identities_only else "no", "identitiesonly"),
                  ("IdentityAgent", self.identity_agent or "$SSH_AUTH_SOCK", "identityagent"),
                  ("CertificateFile", " ".join(self.certificate_files) or "none", "certificatefile"),
                  ("KnownHostsFiles", " ".join(self.known_hosts), "userknownhostsfile"),
                  ("StrictHostKeyChecking", "accept-new" if self.accept_new else "yes", "stricthostkeychecking"),
                  ("ProxyJump", self.proxy_jump or "none", "proxyjump"),
                  ("ProxyCommand", self.proxy_command or "none", "proxycommand"),
                  ("ServerAliveInterval", str(self.server_alive_interval), "serveraliveinterval")]
        sources = dict(self.sources)
        if sources.get("stricthostkeychecking") == "OpenSSH default":
            sources["stricthostkeychecking"] = "dflash default (OpenSSH would ask; dflash never prompts)"
        return [(option, value, sources.get(key, "default")) for option, value, key in values]

    @property
    def host_key_name(self) -> str:
        """The name known_hosts files use for this host (OpenSSH's and paramiko's)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def split_target(target: str) -> tuple[str | None, str, int | None]:
    """user@host[:port] -> (user, host, port); both user and port are optional. Also
    [host]:port, the form `ssh -G` prints ProxyJump hops in."""
    user, _, rest = target.rpartition("@")
    host, colon, port = rest.rpartition(":") if rest.startswith("[") else rest.partition(":")
    if colon and port.isdigit():
        return user or None, host.strip("[]"), int(port)
    return user or None, rest.strip("[]"), None


def config_file() -> str | None:
    return os.environ.get(CONFIG_ENV) or None


def _ssh_g(args: list[str], config: str | None) -> dict[str, list[str]]:
    command = ["ssh", "-G", *(["-F", config] if config else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if done.returncode != 0:
        raise DflashError(f"`{' '.join(command)}` failed: {done.stderr.strip()}", ExitCode.USAGE)
    options: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        options.setdefault(key.lower(), []).append(value)
    return options


def _with_openssh(host: str, user: str | None, port: int | None,
                  explain: bool) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The options `ssh -G` gives, and with `explain` per option whether the config
    file set it (it differs from what OpenSSH says without any config file) or
    OpenSSH's default (a second `ssh -G`, so only when asked)."""
    config = config_file()
    args = [*(["-l", user] if user else []), *(["-p", str(port)] if port else []), host]
    options = _ssh_g(args, config)
    sources: dict[str, str] = {}
    if explain:
        defaults = _ssh_g(args, os.devnull)
        where = f"ssh config ({config or '~/.ssh/config, /etc/ssh/ssh_config'})"
        sources = {key: where if options.get(key) != defaults.get(key) else "OpenSSH default" for key in USED}
    if user:
        sources["user"] = "inventory ssh:"
    if port:
        sources["port"] = "inventory ssh:"
    return options, sources


def _with_paramiko(host: str, user: str | None, port: int | None) -> tuple[dict[str, list[str]], dict[str, str]]:
    import paramiko
    path = Path(config_file() or os.path.expanduser("~/.ssh/config"))
    found = paramiko.SSHConfig.from_path(str(path)).lookup(host) if path.is_file() else {"hostname": host}
    options = {key: value if isinstance(value, list) else [str(value)] for key, value in found.items()}
    sources = {key: f"ssh config ({path}, read by paramiko)" if key in options else "default" for key in USED}
    options.setdefault("user", [getpass.getuser()])
    options.setdefault("port", ["22"])
    if user:
        options["user"], sources["user"] = [user], "inventory ssh:"
    if port:
        options["port"], sources["port"] = [str(port)], "inventory ssh:"
    options.setdefault("identityfile", [f"~/.ssh/id_{kind}" for kind in ("rsa", "ecdsa", "ed25519")])
    return options, sources


def _expand(path: str, options: dict[str, list[str]]) -> str:
    """OpenSSH's tokens in file names that `ssh -G` leaves as written, and ~."""
    tokens = {"%d": os.path.expanduser("~"), "%u": getpass.getuser(), "%h": options["hostname"][0],
              "%p": options["port"][0], "%r": options["user"][0], "%%": "%"}
    for token, value in tokens.items():
        path = path.replace(token, value)
    return os.path.expanduser(path)


def _words(options: dict[str, list[str]], key: str) -> list[str]:
    return [word for value in options.get(key, []) for word in value.split() if word != "none"]


def resolve(target: str, host: Host, *, explain: bool = False) -> SshOptions:
    """The options for `target` (the host's `ssh:` or one of its ProxyJump hops);
    `explain` fills in `sources` for every option, not only the inventory's."""
    user, name, port = split_target(target)
    if shutil.which("ssh"):
        options, sources = _with_openssh(name, user, port, explain)
        resolved_by = "ssh -G"
    else:
        options, sources = _with_paramiko(name, user, port)
        resolved_by = "paramiko (no OpenSSH client: Include, Match and known_hosts markers are not read)"
    identity_files = [_expand(p, options) for p in options.get("identityfile", [])]
    if host.identity_file:
        identity_files, sources["identityfile"] = [os.path.expanduser(host.identity_file)], "inventory identity_file"
    known_hosts = [_expand(p, options) for p in _words(options, "userknownhostsfile")] or \
        [os.path.expanduser(_DEFAULT_KNOWN_HOSTS)]
    known_hosts += [_expand(p, options) for p in _words(options, "globalknownhostsfile")]
    if host.known_hosts:
        known_hosts, sources["userknownhostsfile"] = [os.path.expanduser(host.known_hosts)], "inventory known_hosts"
    strict = (options.get("stricthostkeychecking") or ["ask"])[0].lower()
    agent = (options.get("identityagent") or [None])[0]
    jump = (options.get("proxyjump") or [None])[0]
    command = (options.get("proxycommand") or [None])[0]
    alive = (options.get("serveraliveinterval") or ["0"])[0]
    control_path = (options.get("controlpath") or ["none"])[0]
    return SshOptions(
        target=target, hostname=options["hostname"][0], port=int(options["port"][0]), user=options["user"][0],
        identity_files=tuple(identity_files),
        identities_only=(options.get("identitiesonly") or ["no"])[0].lower() in ("yes", "true"),
        identity_agent=None if agent in (None, "SSH_AUTH_SOCK") else (
            "none" if agent == "none" else _expand(agent.strip('"'), options)),
        certificate_files=tuple(_expand(p, options) for p in options.get("certificatefile", []) if p != "none"),
        known_hosts=tuple(known_hosts),
        # "no" would also accept a changed key; dflash never does, so it acts as accept-new
        accept_new=strict in ("accept-new", "no", "false", "off") or host.host_key == "accept-new",
        proxy_jump=None if jump in (None, "none") else jump,
        proxy_command=None if command in (None, "none") else command,
        server_alive_interval=int(alive) if alive.isdigit() else 0,
        strict_host_key_checking=strict, connect_timeout=(options.get("connecttimeout") or ["none"])[0],
        control_master=(options.get("controlmaster") or ["false"])[0].lower(),
        control_path=None if control_path == "none" else _expand(control_path, options),
        control_persist=(options.get("controlpersist") or ["no"])[0],
        resolved_by=resolved_by, sources=sources)


class ResolvedTarget:
    """What the transports of both SSH clients share: the host's names for messages and
    its options, resolved once per transport (`ssh -G`)."""

    host: Host
    describe: str
    _options: SshOptions | None = None

    def _name(self) -> str:
        return self.host.name or self.host.ssh or "?"

    def _where(self) -> str:
        """The inventory name and the hop chain, for messages: "ct200 (root@node -> pct 200)"."""
        return f"{self.host.name} ({self.describe})" if self.host.name else self.describe

    def prepare(self) -> None:
        """Resolve the options now, ahead of the first command (Transport.prepare)."""
        self.options

    @property
    def options(self) -> SshOptions:
        """The host's resolved options (`ssh -G` runs once per transport)."""
        if self._options is None:
            assert self.host.ssh, "Host validation guarantees `ssh` for ssh and pct hosts"
            self._options = resolve(self.host.ssh, self.host)
        return self._options
