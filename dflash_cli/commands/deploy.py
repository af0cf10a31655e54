"""dflash deploy: a content-addressed release of remote/ and configs/ on each host."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

from dflash_files.diskspace import NO_SPACE
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from .. import console, provenance, release
from ..agent_client import check_interpreter, parse_reply
from ..errors import DflashError, ExitCode
from ..inventory import Host
from ..retry import retry_dropped
from ..session import Session

RECEIVER_SOURCE = (Path(__file__).resolve().parent.parent / "deploy_receiver.py").read_text()
PROGRESS_ABOVE_BYTES = 1 << 20


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
    `bars`: where to draw the upload's progress (see `upload_bars`), if anywhere;
    `verify`: re-hash the host's files instead of comparing size, mtime and ctime;
    `cancel`: set by Ctrl-C (see `cancel_on_ctrl_c`), stops the upload;
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
    argv = [host.python, "-c", RECEIVER_SOURCE, verb, host.workspace, *args]
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


@contextlib.contextmanager
def cancel_on_ctrl_c(stopping: str = "the uploads") -> Iterator[threading.Event]:
    """An event the first Ctrl-C sets instead of raising KeyboardInterrupt, so that the
    uploads (or `stopping`) running in worker threads stop at their next chunk and each
    host's outcome is still known; a second Ctrl-C raises as usual."""
    cancel = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        cancel.set()
        signal.signal(signal.SIGINT, previous)
        console.say(f"interrupting: stopping {stopping} (Ctrl-C again to quit at once)")

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def upload_bars() -> Iterator[Progress | None]:
    """One live display for every host's upload bar (hosts deploy in parallel, and rich
    before 14.1 allows one live display per console), gone when the block ends
    however it ends; None off a terminal."""
    if not console.human.is_terminal:
        yield None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=console.human, transient=True) as bars:
        yield bars


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


def run(session: Session, host_names: list[str], all_hosts: bool, verify: bool,
        source_dir: Path | None, allow_large: bool = False) -> ExitCode:
    """Deploy to each host in parallel; a table of results on stderr."""
    if all_hosts:
        host_names = sorted(session.inventory.hosts)
    if not host_names:
        raise DflashError("name at least one host, or use --all", ExitCode.USAGE)
    hosts = [session.host(name) for name in host_names]  # unknown names fail before any work
    tree, _ = source_tree(source_dir, allow_large)
    with upload_bars() as bars, cancel_on_ctrl_c() as cancel:
        results = session.on_each_host(
            hosts, lambda host: deploy_host(session, host, tree, bars, verify, cancel))
    _print_table(results, host_names, tree)
    failures = [r for r in results.values() if isinstance(r, DflashError)]
    for name in host_names:
        outcome = results[name]
        if isinstance(outcome, DflashError) and outcome.hint:
            console.say(f"{name}: hint: {outcome.hint}")
        if cancel.is_set() and isinstance(outcome, DeployResult):
            console.say(f"{name}: release {outcome.release_id} is live ({outcome.status} "
                        "before the interrupt took effect)")
    for name in host_names:
        outcome = results[name]
        if isinstance(outcome, DeployResult):
            console.data(f"{name}\t{outcome.release_id}\t{outcome.status}\n")
    if cancel.is_set():
        return ExitCode.INTERRUPTED
    return max((f.exit_code for f in failures), default=ExitCode.OK)


def _print_table(results: dict, order: list[str], tree: release.Release) -> None:
    table = Table(title=f"release {tree.release_id} ({len(tree.files)} files, "
                        f"{tree.total_bytes / 1024:.0f} KiB)", title_justify="left")
    for column in ("host", "result", "files sent", "reused", "bytes sent", "round trips", "seconds"):
        table.add_column(column, justify="left" if column in ("host", "result") else "right")
    for name in order:
        r = results[name]
        if isinstance(r, DflashError):
            table.add_row(name, Text(f"failed: {r.message}", style="red"), "", "", "", "", "")
        else:
            table.add_row(name, r.status, str(r.files_sent), str(r.files_reused), str(r.bytes_sent),
                          str(r.round_trips), f"{r.seconds:.2f}")
    console.human.print(table)
