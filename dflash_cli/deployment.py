"""Releases onto hosts, for `deploy`, `launch`, `hosts --check` and `--version`: the
release of the source tree (`source_tree`), installed by the host side's receiver
(host_scripts/deploy_receiver.py, sent with `python -c`): one round trip when the host's copy is
intact, else one tar stream of what the host lacks."""
from __future__ import annotations

import dataclasses
import io
import threading
import time
from pathlib import Path

from dflash_files.diskspace import NO_SPACE
from rich.progress import Progress

from . import console, host_scripts, provenance, release
from .agent_client import check_interpreter, parse_reply
from .errors import DflashError, ExitCode
from .inventory import Host
from .progress import PROGRESS_ABOVE_BYTES
from .retry import retry_dropped
from .session import Session

@dataclasses.dataclass(frozen=True)
class DeployResult:
    host: str
    release_id: str
    status: str  # unchanged | switched | present (intact, left as it was: switch=False) | installed | repaired
    files_sent: int
    files_reused: int
    bytes_sent: int
    round_trips: int
    seconds: float
    modified: tuple[str, ...] = ()  # what was wrong with the host's copy, when repaired


class DeployInterrupted(DflashError):
    """Ctrl-C stopped the upload: the host discards what it got, `current` stays."""

    def __init__(self, host: str):
        super().__init__(f"host {host}: upload interrupted; the host discards it and keeps "
                         "its current release", ExitCode.INTERRUPTED)


def deploy_host(session: Session, host: Host, tree: release.Release, bars: Progress | None = None,
                verify: bool = False, cancel: threading.Event | None = None, switch: bool = True) -> DeployResult:
    """Make `tree` the current release of `host`; one round trip when it already is intact.
    `bars`: where to draw the upload's progress (see `progress.transfer_bars`), if anywhere;
    `verify`: re-hash the host's files instead of comparing size, mtime and ctime;
    `cancel`: set by Ctrl-C (see `progress.cancel_on_ctrl_c`), stops the upload;
    `switch`: False installs the release and leaves `current` as it is (launch's deploy)."""
    started = time.monotonic()
    transport = session.transport(host)
    trips_before = transport.round_trips
    release_id = tree.release_id
    check = "verify" if verify else "cheap"
    switching = "switch" if switch else "keep"
    reply = retry_dropped(lambda: _receiver(session, host, "probe", release_id, check, switching))
    files_sent = bytes_sent = files_reused = 0
    modified = tuple(reply.get("modified", ()))
    if reply["status"] == "missing":
        if modified:
            console.warn(f"{host.name}: release {release_id} was modified on the host "
                         f"({_summary(modified)}); installing a fresh copy")
        have = reply.get("current_files", {})
        changed = {f.path for f in tree.files if have.get(f.path) != f.sha256}
        def stop_if_cancelled() -> None:
            if cancel is not None and cancel.is_set():
                raise DeployInterrupted(host.name)

        stop_if_cancelled()
        payload = tree.tar_stream(changed, stop_if_cancelled)
        upload = _Upload(host.name, payload, bars, cancel)
        reply = _receiver(session, host, "install", release_id, str(payload.length), switching, stdin=upload)
        files_sent, bytes_sent = len(changed), payload.length
        files_reused = reply.get("files_reused", 0)
    return DeployResult(host.name, release_id, reply["status"], files_sent, files_reused,
                        bytes_sent, transport.round_trips - trips_before,
                        time.monotonic() - started, modified)


def check_host(session: Session, host: Host) -> list[str]:
    """What differs in the host's current release from its MANIFEST (cheap check)."""
    return retry_dropped(lambda: _receiver(session, host, "check", "cheap"))["modified"]


def _summary(problems: tuple[str, ...] | list[str], shown: int = 3) -> str:
    more = f", and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def _receiver(session: Session, host: Host, verb: str, *args: str, stdin=None) -> dict:
    argv = [host.python, "-c", host_scripts.source("deploy_receiver.py"), verb, host.workspace, *args]
    done = session.transport(host).run(argv, stdin=stdin)
    check_interpreter(host, done)
    reply = parse_reply(done.stdout)
    if reply is None:
        reply = {"status": "error", "error": f"exit {done.exit_code}: "
                 f"{done.stderr.decode(errors='replace').strip()[-1000:]}"}
    if reply.get("status") == "error" and reply.get("errno") in NO_SPACE:
        # The host was reached; it cannot take the release until space is freed.
        raise DflashError(f"host {host.name}: no space left on device in {host.workspace}: deploy {verb} "
                          "failed; the previous release stays current", ExitCode.USAGE)
    if reply.get("status") == "error":
        raise DflashError(f"host {host.name}: deploy {verb} failed: {reply['error']}; "
                          "the previous release stays current", ExitCode.UNREACHABLE)
    return reply


class _Upload(io.RawIOBase):
    """The payload stream as a file for the transport to read: draws a progress bar when
    it is big enough and there is a display, and stops with DeployInterrupted once
    `cancel` is set, which makes the transport end the command before the stream is
    complete."""

    def __init__(self, host_name: str, payload: release.TarStream, bars: Progress | None,
                 cancel: threading.Event | None):
        self._host, self._payload, self._pos, self._cancel = host_name, payload, 0, cancel
        self._bars, self._task = None, None
        if bars is not None and payload.length > PROGRESS_ABOVE_BYTES:
            self._bars, self._task = bars, bars.add_task(f"deploy {host_name}", total=payload.length)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._cancel is not None and self._cancel.is_set() and self._pos < self._payload.length:
            raise DeployInterrupted(self._host)
        count = self._payload.readinto(buffer)
        self._pos += count
        if self._bars is not None:
            self._bars.update(self._task, completed=self._pos)
            if not count:
                self._bars.update(self._task, visible=False)  # all sent: the bar goes away
        return count



def source_tree(source_dir: Path | None, allow_large: bool = False) -> tuple[release.Release, dict]:
    """The release to deploy (from --source DIR, the project tree holding the current
    directory, or the copy bundled with dflash) and where it came from, said on stderr.
    A release over the size threshold is refused here, before any host is contacted,
    unless `allow_large`."""
    source = release.find_source(source_dir)
    tree = release.scan(source.root)
    record = provenance.describe(source, tree)
    console.say(f"source: {provenance.summary(record)}")
    tree.check_size(allow_large)
    return tree, record
