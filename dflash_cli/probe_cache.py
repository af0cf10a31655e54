"""`dflash deploy` starts each host's probe from the ssh command line the last deploy of the
same command line ran, first thing, and keeps it only where this deploy, resolved as
always, makes the very same command line (docs/releases.md, "Deploy").

`start(argv)`, called by the `dflash` command before anything else is imported, reads
the command line (`parse`, the forms deploy takes), looks up the command lines kept for it
(`record` keeps them, in the user's cache folder), and starts each host's `ssh` with
them. The deploy then runs as always (deploy_early, deployment.start_probes): the
inventory read, `ssh -G` run, the tree listed, and each host's transport `adopt`s the
started process only if it runs exactly the command line the transport would start
itself; any other is abandoned: its stdin ends without a release id, so its receiver
exits having looked at nothing. Nothing is reported from a process that was not adopted.

What a kept command line may reach before the check: the file is found by this command
line, the current directory and the variables that name the inventory and the ssh
config, and used only while the inventory file holds the bytes, and the ssh config files
and the receiver the size and times, that it was recorded from. The host a speculative
`ssh` reaches is the one the inventory's `ssh:` names, as the user's ssh config resolves it
as that ssh starts (`Match exec` included): dflash's own options in the line, from an
earlier `ssh -G`, only tune the connection (keepalives, timeouts, the master's socket). A
host whose options accept new host keys is never started this way, so a stale line never
records a key the current config would refuse. A release that may be over the size limit
(the files under remote/ and configs/, before git and .dflashignore leave any out) starts
nothing: such a release is refused before any host is contacted.

Imports here are the standard library's few (json, zlib and subprocess, only for a
deploy; not hashlib or tempfile, ~4 ms more): what runs before the first `ssh` is on the
path of every unchanged deploy.
"""
from __future__ import annotations

import os

from .project_tree import LARGE_RELEASE_BYTES, size_bound, source_folder

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (~3 ms) before the first ssh
if TYPE_CHECKING:
    from typing import Sequence

#: the options `parse` knows, as click spells them, and the parameter each sets
_GLOBAL_VALUES = {"--hosts": "hosts_file", "--logs-dir": "logs_dir", "--cli-config": "cli_config_file"}
_GLOBAL_FLAGS = {"--accept-new-host-key": "accept_new_host_key"}
_DEPLOY_VALUES = {"--source": "source_dir"}
_DEPLOY_FLAGS = {"--all": "all_hosts", "--verify": "verify", "--allow-large": "allow_large"}
#: what the kept command lines depend on besides the command line: the inventory's place
#: (session.HOSTS_ENV), the ssh config (ssh_options.CONFIG_ENV), the programs found on PATH
#: and what ~ means
_ENVIRONMENT = ("DFLASH_HOSTS", "DFLASH_SSH_CONFIG", "PATH", "HOME")
_DEFAULT_INVENTORY = os.path.join("configs", "hosts.yaml")
_SSH_CONFIGS = ("~/.ssh/config", "/etc/ssh/ssh_config")
_RECEIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_scripts", "deploy_receiver.py")
#: stands for a transport's private folder in a kept command line (no argument holds a NUL)
FOLDER = "\0folder\0"
#: the files kept, the least recently written removed beyond this
_KEPT_FILES = 32
_FORMAT = 1


def parse(argv: Sequence[str]) -> tuple[dict[str, str | bool], list[str]] | None:
    """The options and host names of `dflash [OPTIONS] deploy [OPTIONS] HOST...`, None for
    any other command line (another verb, --help, --version, an option it does not know)."""
    options: dict[str, str | bool] = {}
    names: list[str] = []
    deploy = False
    words = iter(argv)
    for word in words:
        values, flags = (_DEPLOY_VALUES, _DEPLOY_FLAGS) if deploy else (_GLOBAL_VALUES, _GLOBAL_FLAGS)
        option, equals, value = word.partition("=")
        if option in values:
            if not equals:
                value = next(words, None)
                if value is None:
                    return None
            options[values[option]] = value
        elif word in flags:
            options[flags[word]] = True
        elif word.startswith("-"):
            return None
        elif deploy:
            names.append(word)
        elif word == "deploy":
            deploy = True
        else:
            return None
    return (options, names) if deploy else None


class StartedProbe:
    """A host's probe started from a kept command line: `ssh`, its private folder made,
    waiting for the release id on its stdin. A transport adopts it (Transport.adopt) or it
    is abandoned."""

    def __init__(self, line: list[str], exit_line: list[str] | None):
        import subprocess

        self.folder = _private_folder()
        self.argv = [word.replace(FOLDER, self.folder) for word in line]
        # `ssh -O exit` for the master this ssh becomes where dflash runs its own
        self._exit_argv = None if exit_line is None else [word.replace(FOLDER, self.folder) for word in exit_line]
        try:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True)
        except OSError:
            os.rmdir(self.folder)
            raise
        self.abandoned = False

    def abandon(self) -> None:
        """Its stdin ends without a release id: its receiver exits having looked at nothing
        (`finish` ends what is left of it)."""
        self.abandoned = True
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def finish(self) -> None:
        """After `abandon`, at the end: its ssh ended (killed if still connecting: without a
        release id the receiver does nothing), the master it became ended, its folder removed."""
        import shutil
        import signal
        import subprocess

        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()
        if self._exit_argv is not None:
            try:
                subprocess.run(self._exit_argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass  # no master left to end, or one that ControlPersist ends
        shutil.rmtree(self.folder, ignore_errors=True)


class _Speculation:
    def __init__(self, key: dict, path: str, kept: dict[str, dict]):
        self.key, self.path, self.kept = key, path, kept
        self.started: dict[str, StartedProbe] = {}  # not yet taken by the deploy
        self.taken: list[StartedProbe] = []


_speculation: _Speculation | None = None


def start(argv: Sequence[str]) -> None:
    """For `dflash ... deploy ...`: each host's probe started from the command line kept for
    this deploy, where one is kept and may be used; else nothing (not a word of output:
    the deploy then starts them as it always does)."""
    global _speculation
    parsed = parse(argv)
    if parsed is None:
        return
    options, names = parsed
    try:
        key = _key(argv, options)
    except OSError:
        return  # an inventory or ssh config that cannot be read: the deploy says so itself
    path = _cache_file(key)
    kept = _read(path, key)
    _speculation = _Speculation(key, path, kept)
    if options.get("all_hosts"):
        names = sorted(kept)
    if not names or any(name not in kept for name in names) or not _may_contact_hosts(options):
        return
    for name in names:
        try:
            _speculation.started[name] = StartedProbe(kept[name]["probe"], kept[name]["exit"])
        except OSError:
            return  # no ssh to start: the deploy meets that itself


def take() -> dict[str, StartedProbe]:
    """The probes `start` started, for the deploy's transports to adopt or abandon (once)."""
    if _speculation is None:
        return {}
    started, _speculation.started = _speculation.started, {}
    _speculation.taken += started.values()
    return started


def record(lines: dict[str, tuple[list[str], list[str] | None] | None]) -> None:
    """Keep each host's probe command line, as its transport made it for this deploy (with
    the private folder as FOLDER, and the master's `-O exit` line), for the next deploy of
    this command line; a host with None is started no more. Written only while the
    inventory file holds the bytes the key was made from; a cache that cannot be written
    is no error (the next deploy starts its probes as always)."""
    if _speculation is None:
        return
    kept = {name: {"probe": line[0], "exit": line[1]} for name, line in lines.items() if line is not None}
    if kept == _speculation.kept:
        return
    try:
        if _inventory_bytes(_speculation.key["inventory"]) != _speculation.key["inventory_bytes"]:
            return
        _write(_speculation.path, {"key": _speculation.key, "hosts": kept})
    except OSError:
        pass


def abandon() -> None:
    """Ends what was started and not adopted (the end of the `dflash` command)."""
    global _speculation
    speculation, _speculation = _speculation, None
    if speculation is None:
        return
    for probe in speculation.started.values():
        probe.abandon()
    for probe in [*speculation.started.values(), *speculation.taken]:
        if probe.abandoned:  # not adopted: its transport would have ended it
            probe.finish()


def _may_contact_hosts(options: dict[str, str | bool]) -> bool:
    """Whether the deploy gets as far as contacting hosts, as far as the size limit goes:
    the tree it sends is no larger than the limit, counting every file under its release
    folders, or --allow-large."""
    if options.get("allow_large"):
        return True
    explicit = options.get("source_dir")
    found = source_folder(explicit if isinstance(explicit, str) else None, os.getcwd())
    return found is not None and size_bound(found[0]) <= LARGE_RELEASE_BYTES


def _key(argv: Sequence[str], options: dict[str, str | bool]) -> dict:
    """What the kept command lines were made from, as found now: the command line, the
    current directory, the variables in _ENVIRONMENT, the inventory file and its bytes
    (as latin-1 text: every byte kept), and the size, times and inode of each ssh config
    file and of the receiver."""
    from .project_tree import in_state_root  # the standard library's os alone

    hosts_file = options.get("hosts_file") or os.environ.get("DFLASH_HOSTS") or in_state_root(_DEFAULT_INVENTORY)
    assert isinstance(hosts_file, str)
    config = os.environ.get("DFLASH_SSH_CONFIG")
    configs = [config] if config else [os.path.expanduser(path) for path in _SSH_CONFIGS]
    return {"format": _FORMAT, "argv": list(argv), "cwd": os.getcwd(),
            "environment": [os.environ.get(name) for name in _ENVIRONMENT],
            "inventory": os.path.abspath(hosts_file), "inventory_bytes": _inventory_bytes(hosts_file),
            "files": [_identity(path) for path in [*configs, _RECEIVER]]}


def _inventory_bytes(hosts_file: str) -> str | None:
    try:
        with open(hosts_file, "rb") as file:
            return file.read().decode("latin-1")
    except FileNotFoundError:
        return None


def _identity(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def cache_folder() -> str:
    """Where the kept command lines are: $XDG_CACHE_HOME/dflash/deploy-probes, by default
    ~/.cache/dflash/deploy-probes."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dflash", "deploy-probes")


def _cache_file(key: dict) -> str:
    """One file per command line, directory and environment: a changed inventory or ssh
    config replaces its lines there."""
    import json
    import zlib

    named_by = json.dumps([key["argv"], key["cwd"], key["environment"], key["inventory"]]).encode()
    # two checksums, not a hash: a name two command lines share only misses (`_read` compares the key)
    name = f"{zlib.crc32(named_by):08x}{zlib.adler32(named_by):08x}"
    return os.path.join(cache_folder(), f"{name}.json")


def _read(path: str, key: dict) -> dict[str, dict]:
    """The command lines kept in `path` for `key`; none where the file is missing, made
    for another key, or not what `_write` writes (truncated, edited): never an error."""
    import json

    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        if data["key"] != key:
            return {}
        kept = data["hosts"]
        for entry in kept.values():
            probe, exit_line = entry["probe"], entry["exit"]
            if not (_is_ssh_line(probe) and (exit_line is None or _is_ssh_line(exit_line))):
                return {}
        return kept
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _is_ssh_line(line: object) -> bool:
    return isinstance(line, list) and bool(line) and line[0] == "ssh" and all(isinstance(word, str) for word in line)


def _write(path: str, data: dict) -> None:
    """`data` as the file at `path`, written whole or not at all (a temporary file renamed
    over it); the least recently written files beyond _KEPT_FILES removed."""
    import json

    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    entries = [entry for entry in os.scandir(folder) if entry.name.endswith(".json")]
    for entry in sorted(entries, key=lambda entry: entry.stat().st_mtime_ns)[:-_KEPT_FILES]:
        os.unlink(entry.path)


def _private_folder() -> str:
    """A new 0700 folder for the started ssh's log and socket, where the transport would
    make its own (tempfile.mkdtemp's, whose import costs ~2 ms more)."""
    base = next((os.environ[name] for name in ("TMPDIR", "TEMP", "TMP") if os.path.isdir(os.environ.get(name, ""))),
                "/tmp")
    folder = os.path.join(base, f"dflash-ssh-{os.urandom(6).hex()}")
    os.mkdir(folder, 0o700)
    return folder
