"""dflash deploy: a content-addressed release of remote/ and configs/ on each host."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from pathlib import Path
from typing import Iterator

from dflash_agent.jsonio import NO_SPACE
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from .. import console, provenance, release
from ..agent import check_interpreter, parse_reply
from ..errors import DflashError, ExitCode
from ..inventory import Host
from ..session import Session

RECEIVER_SOURCE = (Path(__file__).resolve().parent.parent / "deploy_receiver.py").read_text()
PROGRESS_ABOVE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class DeployResult:
    host: str
    release_id: str
    status: str  # unchanged | switched | installed
    files_sent: int
    files_reused: int
    bytes_sent: int
    round_trips: int
    seconds: float


def deploy_host(session: Session, host: Host, tree: release.Release,
                bars: Progress | None = None) -> DeployResult:
    """Make `tree` the current release of `host`; one round trip when it already is.
    `bars`: where to draw the upload's progress (see `upload_bars`), if anywhere."""
    started = time.monotonic()
    transport = session.transport(host)
    trips_before = transport.round_trips
    release_id = tree.release_id
    reply = _receiver(session, host, "probe", release_id)
    files_sent = bytes_sent = files_reused = 0
    if reply["status"] == "missing":
        have = reply.get("current_files", {})
        changed = {f.path for f in tree.files if have.get(f.path) != f.sha256}
        payload = tree.tar_of(changed)
        reply = _receiver(session, host, "install", release_id, payload, bars)
        files_sent, bytes_sent = len(changed), len(payload)
        files_reused = reply.get("files_reused", 0)
    return DeployResult(host.name, release_id, reply["status"], files_sent, files_reused,
                        bytes_sent, transport.round_trips - trips_before,
                        time.monotonic() - started)


def _receiver(session: Session, host: Host, verb: str, release_id: str,
              payload: bytes | None = None, bars: Progress | None = None) -> dict:
    argv = [host.python, "-c", RECEIVER_SOURCE, verb, host.workspace, release_id]
    stdin = None if payload is None else _with_progress(host.name, payload, bars)
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


class _ProgressReader(io.RawIOBase):
    """The payload as a file, drawing a progress bar as the transport reads it."""

    def __init__(self, data: bytes, progress: Progress, task: int):
        self._data, self._pos, self._progress, self._task = data, 0, progress, task

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self._data[self._pos:self._pos + len(buffer)]
        buffer[:len(chunk)] = chunk
        self._pos += len(chunk)
        self._progress.update(self._task, completed=self._pos)
        if not chunk:
            self._progress.update(self._task, visible=False)  # all sent: the bar goes away
        return len(chunk)


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


def _with_progress(host_name: str, payload: bytes, bars: Progress | None):
    if bars is None or len(payload) <= PROGRESS_ABOVE_BYTES:
        return payload
    return _ProgressReader(payload, bars, bars.add_task(f"deploy {host_name}", total=len(payload)))


def source_tree(source_dir: Path | None) -> tuple[release.Release, dict]:
    """The release to deploy (from --source DIR, the project tree holding the current
    directory, or the copy bundled with dflash) and where it came from, said on stderr."""
    source = release.find_source(source_dir)
    tree = release.scan(source.root)
    record = provenance.describe(source, tree)
    console.say(f"source: {provenance.summary(record)}")
    return tree, record


def run(session: Session, host_names: list[str], all_hosts: bool, source_dir: Path | None) -> ExitCode:
    """Deploy to each host in parallel; a table of results on stderr."""
    if all_hosts:
        host_names = sorted(session.inventory.hosts)
    if not host_names:
        raise DflashError("name at least one host, or use --all", ExitCode.USAGE)
    hosts = [session.host(name) for name in host_names]  # unknown names fail before any work
    tree, _ = source_tree(source_dir)
    with upload_bars() as bars:
        results = session.on_each_host(hosts, lambda host: deploy_host(session, host, tree, bars))
    _print_table(results, host_names, tree)
    failures = [r for r in results.values() if isinstance(r, DflashError)]
    for name in host_names:
        outcome = results[name]
        if isinstance(outcome, DflashError) and outcome.hint:
            console.say(f"{name}: hint: {outcome.hint}")
    for name in host_names:
        outcome = results[name]
        if isinstance(outcome, DeployResult):
            console.data(f"{name}\t{outcome.release_id}\t{outcome.status}\n")
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
