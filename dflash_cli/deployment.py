"""Releases onto hosts, for `deploy`, `launch`, `hosts --check` and `--version`: the
release of the source tree (`source_tree`), installed by the host side's receiver
(host_scripts/deploy_receiver.py, sent with `python -S -c`): one round trip when the host's copy is
intact, else one tar stream of what the host lacks. `deploy` starts each host's probe
(`EarlyProbe`) once the tree's files are listed, so that the connection and the host's
interpreter start while the tree is hashed."""
from __future__ import annotations

import dataclasses
import io
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_contract.checker import Message, ProtocolError
from dflash_contract.deploy import CheckAnswer, InstallAnswer, ProbeAnswer, ReceiverError
from dflash_contract.records import ReleaseSource
from dflash_files.diskspace import NO_SPACE

from . import console, host_scripts, provenance, release
from .errors import DflashError, ExitCode
from .host_replies import check_interpreter, parse_reply
from .inventory import Host
from .progress import PROGRESS_ABOVE_BYTES
from .retry import retry_dropped
from .session import Session
from .transports.common import ResultThread

_ANSWERS: dict[str, type[Message]] = {"probe": ProbeAnswer, "install": InstallAnswer, "check": CheckAnswer}

if TYPE_CHECKING:
    from rich.progress import Progress

#: how long the hashing waits for a host's probe to be on its way (a slow host's
#: connection does not hold up the others' for longer)
_START_WAIT_S = 1.0


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


class _ReleaseIdLine(io.RawIOBase):
    """An early probe's stdin: nothing until `give` is called, then the release id's line
    (or, given None, the end of the stream at once). `asked` is set once the transport
    reads it: the command has started."""

    def __init__(self) -> None:
        self._ready, self._line, self.asked = threading.Event(), b"", threading.Event()

    def give(self, release_id: str | None) -> None:
        if not self._ready.is_set():  # the first answer stands
            self._line = b"" if release_id is None else f"{release_id}\n".encode()
            self._ready.set()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self.asked.set()
        self._ready.wait()
        count = min(len(buffer), len(self._line))
        buffer[:count], self._line = self._line[:count], self._line[count:]
        return count


class EarlyProbe:
    """The probe of one host started before the release id is known: the connection, the
    host's interpreter and the receiver start while the tree is hashed, and the receiver
    waits for the id on its stdin: `ask` gives it (`deploy_host` does, if not done yet);
    `abandon` gives none (the receiver then exits having looked at nothing)."""

    def __init__(self, session: Session, host: Host, verify: bool = False, switch: bool = True):
        self.started = time.monotonic()
        self.verify, self.switch = verify, switch
        self.round_trips_before = 0  # the transport's count before the probe, once it ran
        self._line = _ReleaseIdLine()

        def probe() -> ProbeAnswer:
            # opened in this thread: importing the paramiko client alone takes a while
            transport = session.transport(host)
            self.round_trips_before = transport.round_trips
            return _receiver(session, host, "probe", "-", _check(verify), _switching(switch), stdin=self._line)

        self._reply = ResultThread(f"{host.name}-probe", probe)
        self._reply.start()

    def wait_started(self, timeout: float) -> None:
        """Until the probe's command has started on its way to the host (or failed), at most
        `timeout` s: what this process does meanwhile (hashing, imports) holds the GIL that
        the probe's thread needs to get there."""
        deadline = time.monotonic() + timeout
        while not self._line.asked.wait(0.005) and self._reply.is_alive() and time.monotonic() < deadline:
            pass

    def ask(self, release_id: str) -> None:
        self._line.give(release_id)

    def reply(self, release_id: str) -> ProbeAnswer:
        self.ask(release_id)
        return self._reply.result()

    def abandon(self) -> None:
        self._line.give(None)
        try:
            self._reply.result()
        except DflashError:
            pass  # it was never asked anything


def start_probes(session: Session, hosts: list[Host], verify: bool, source_dir: Path | None,
                 allow_large: bool) -> tuple[release.SourceTree, release.Listing, dict[str, EarlyProbe]]:
    """`dflash deploy`'s first step: the tree listed (a release refused for its size
    contacts no host), then each host's probe started, for the release id once hashed."""
    # Meanwhile each host's transport is made and its options resolved (`ssh -G`), which
    # contacts no host either; a failure there is the probe's to meet and report.
    prepared = [ResultThread(f"{host.name}-prepare", session.transport(host).prepare) for host in hosts]
    for thread in prepared:
        thread.start()
    try:
        source, listing = listed_source(source_dir, allow_large)
    finally:
        for thread in prepared:
            thread.join()
    probes = {host.name: EarlyProbe(session, host, verify) for host in hosts}
    for probe in probes.values():
        probe.wait_started(_START_WAIT_S)
    return source, listing, probes


def _check(verify: bool) -> str:
    return "verify" if verify else "cheap"


def _switching(switch: bool) -> str:
    return "switch" if switch else "keep"


def deploy_host(session: Session, host: Host, tree: release.Release, bars: Progress | None = None,
                verify: bool = False, cancel: threading.Event | None = None, switch: bool = True,
                early: EarlyProbe | None = None) -> DeployResult:
    """Make `tree` the current release of `host`; one round trip when it already is intact.
    `bars`: where to draw the upload's progress (see `progress.transfer_bars`), if anywhere;
    `verify`: re-hash the host's files instead of comparing size, mtime and ctime;
    `cancel`: set by Ctrl-C (see `progress.cancel_on_ctrl_c`), stops the upload;
    `switch`: False installs the release and leaves `current` as it is (launch's deploy);
    `early`: this host's probe, already started (with the same `verify` and `switch`)."""
    assert early is None or (early.verify, early.switch) == (verify, switch)
    started = early.started if early else time.monotonic()
    transport = session.transport(host)
    trips_before = transport.round_trips
    release_id = tree.release_id
    check, switching = _check(verify), _switching(switch)
    pending = early

    def probe() -> ProbeAnswer:
        nonlocal pending
        if pending is None:  # no early probe, or it is made again after a dropped connection
            return _receiver(session, host, "probe", release_id, check, switching)
        started_probe, pending = pending, None
        return started_probe.reply(release_id)

    reply = retry_dropped(probe)
    if early is not None:
        trips_before = early.round_trips_before
    files_sent = bytes_sent = files_reused = 0
    modified = reply.modified or ()
    status = reply.status
    if status == ProbeAnswer.MISSING:
        if modified:
            console.warn(f"{host.name}: release {release_id} was modified on the host "
                         f"({_summary(modified)}); installing a fresh copy")
        have = reply.current_files or {}
        changed = {f.path for f in tree.files if have.get(f.path) != f.sha256}
        def stop_if_cancelled() -> None:
            if cancel is not None and cancel.is_set():
                raise DeployInterrupted(host.name)

        stop_if_cancelled()
        payload = tree.tar_stream(changed, stop_if_cancelled)
        upload = _Upload(host.name, payload, bars, cancel)
        installed = _receiver(session, host, "install", release_id, str(payload.length), switching, stdin=upload)
        files_sent, bytes_sent = len(changed), payload.length
        status, files_reused = installed.status, installed.files_reused
    return DeployResult(host.name, release_id, status, files_sent, files_reused,
                        bytes_sent, transport.round_trips - trips_before,
                        time.monotonic() - started, modified)


def check_host(session: Session, host: Host) -> list[str]:
    """What differs in the host's current release from its MANIFEST (cheap check)."""
    return list(retry_dropped(lambda: _receiver(session, host, "check", "cheap")).modified)


def _summary(problems: tuple[str, ...] | list[str], shown: int = 3) -> str:
    more = f", and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def _receiver_argv(host: Host, verb: str, *args: str) -> list[str]:
    # -S: the receiver is stdlib only; the interpreter's site-packages (and the .pth files
    # there) would only delay it
    return [host.python, "-S", "-c", host_scripts.source("deploy_receiver.py"), verb, host.workspace, *args]


def _receiver(session: Session, host: Host, verb: str, *args: str, stdin=None) -> Any:
    """The receiver's answer to `verb`, read as that verb's type; its error, or an answer
    that is not one, a DflashError."""
    done = session.transport(host).run(_receiver_argv(host, verb, *args), stdin=stdin)
    check_interpreter(host, done)
    reply = parse_reply(done.stdout)
    if reply is None:
        reply = {"status": "error", "error": f"exit {done.exit_code}: "
                 f"{done.stderr.decode(errors='replace').strip()[-1000:]}"}
    try:
        if reply.get("status") != "error":
            return _ANSWERS[verb].from_json(reply)
        error = ReceiverError.from_json(reply)
    except ProtocolError as exc:
        raise DflashError(f"host {host.name}: deploy {verb}: cannot read its answer: {exc}; "
                          "the previous release stays current", ExitCode.UNREACHABLE) from None
    if error.errno in NO_SPACE:
        # The host was reached; it cannot take the release until space is freed.
        raise DflashError(f"host {host.name}: no space left on device in {host.workspace}: deploy {verb} "
                          "failed; the previous release stays current", ExitCode.USAGE)
    raise DflashError(f"host {host.name}: deploy {verb} failed: {error.error}; "
                      "the previous release stays current", ExitCode.UNREACHABLE)


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
    return hashed_source(*listed_source(source_dir, allow_large))


def listed_source(source_dir: Path | None, allow_large: bool = False) -> tuple[release.SourceTree, release.Listing]:
    """`source_tree`'s first half: the tree chosen and its files listed, a release over the
    size threshold refused (unless `allow_large`); nothing read yet."""
    source = release.find_source(source_dir)
    listing = release.list_files(source.root)
    listing.check_size(allow_large)
    return source, listing


def hashed_source(source: release.SourceTree, listing: release.Listing) -> tuple[release.Release, ReleaseSource]:
    """`source_tree`'s second half: the release hashed and where it came from, said on stderr."""
    tree = listing.hashed()
    return tree, described_source(source, tree)


def described_source(source: release.SourceTree, tree: release.Release, *, kept: bool = True) -> ReleaseSource:
    """Where `tree` came from (provenance.describe), said on stderr; `kept`: the record is
    kept (run.json), so it names dflash's version even where the line does not."""
    record = provenance.describe(source, tree, version=kept)
    console.say(f"source: {provenance.summary(record)}")
    return record
