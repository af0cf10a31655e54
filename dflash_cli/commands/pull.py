"""dflash pull: the run's export (and, with --checkpoint, its newest checkpoint) brought to
logs/<host>/<run>/export/ (and checkpoint/<step folder>/), every file verified by sha256.

The agent lists the files with size and sha256 (`artifacts`; the SHA256SUMS the trainer
writes spares the host hashing gigabytes) and sends one file's bytes from an offset
(`send-file`). A file is received into `<name>.<sha256 prefix>.part` beside its place,
fsynced, checked against its sha256 and only then renamed into place; a local copy that
matches is not sent again. A part left by a dropped connection, Ctrl-C or a killed pull
goes on from its length: the prefix names the version it belongs to, so bytes of two
versions are never joined. The run may still be training: a folder the trainer replaced
since the listing is refused by the host before a byte is sent, and listed again.

What a host lists decides nothing about where files go here: a folder is export or
checkpoints/step_NNNNNN, a file a plain relative path inside it with a sha256 of 64 hex
digits, and none leads through a symlink; anything else is refused before a byte is
written. pulled.json, beside the folders, lists every file pull put there (and every
part it began); the tidy-up after a pull removes only files it lists. A full local disk
ends the pull with an exit code of its own, the part being received removed. A folder is whole only
when every file its SHA256SUMS lists came with the bytes listed (a folder without
SHA256SUMS, or missing a file it lists, is refused once its files are here).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
from pathlib import Path

from rich.progress import Progress

from dflash_contract import requests
from dflash_contract.replies import ArtifactsReply, ErrorKind, ErrorReply
from dflash_files.atomic import fsync_path
from dflash_files.checkpoint_files import CHECKPOINTS_DIR, EXPORT_DIR, SHA256SUMS, STEP_FOLDER
from dflash_files.checksums import parse_sums
from dflash_files.diskspace import NO_SPACE

from .. import console
from ..agent_client import AgentClient
from ..host_replies import parse_reply
from ..errors import DflashError, ExitCode, UnreachableError, at_least
from ..local_state import RunLogs, RunRef, inside, local_disk_full, local_writes, write_atomic
from ..progress import PROGRESS_ABOVE_BYTES, transfer_bars
from ..retry import RETRY_FOR_S, Reconnects, retry_dropped
from ..session import Session
from ..transports import CommandFailed

PART_SUFFIX = ".part"
MANIFEST = "pulled.json"  # in logs/<host>/<run>/: {"files": [path under that folder, ...]}
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: listings made in one pull before giving up on a run that keeps replacing its export
LISTINGS = 5
_HASH_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    folder: str  # export, or checkpoints/step_000100
    path: str  # inside the folder, "/"-separated
    size: int
    sha256: str
    identity: str  # what send-file checks: the file listed is the file sent
    local: Path  # where it goes here: checked to stay inside the run's local folder


@dataclasses.dataclass(frozen=True)
class PullOptions:
    """What a pull was asked for, checked as it is made."""
    checkpoint: bool = False  # also the run's newest checkpoint
    retry_for: float = RETRY_FOR_S  # seconds to keep reconnecting after a dropped connection

    def __post_init__(self) -> None:
        at_least("retry_for", self.retry_for, 0)


@dataclasses.dataclass(frozen=True)
class PullResult:
    run_id: str
    host: str
    folders: tuple[Path, ...]  # the local folders, export first
    pulled: int  # files received (whole or the rest of a part)
    bytes_received: int  # file bytes that came over the connection
    skipped: int  # files whose local copy already matched
    removed: int  # local files no longer in the host's folder


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def local_name(host: str, folder: str) -> str:
    """Where a listed folder goes, under logs/<host>/<run>/: export -> export,
    checkpoints/step_X -> checkpoint/step_X; any other name `host` lists is refused."""
    parts = folder.split("/")
    if parts == [EXPORT_DIR]:
        return EXPORT_DIR
    if len(parts) == 2 and parts[0] == CHECKPOINTS_DIR and STEP_FOLDER.fullmatch(parts[1]):
        return f"checkpoint/{parts[1]}"
    raise DflashError(f"host {host}: refusing the listed folder {folder!r}: expected {EXPORT_DIR} or "
                      f"{CHECKPOINTS_DIR}/step_NNNNNN", ExitCode.UNREACHABLE)


def local_folder(logs: RunLogs, folder: str) -> Path:
    """The local folder of a listed folder (`local_name`), checked as a path of the host's."""
    return inside(logs.dir, local_name(logs.ref.host, folder), logs.ref.host)


def part_path(local: Path, sha256: str) -> Path:
    return local.with_name(f"{local.name}.{sha256[:16]}{PART_SUFFIX}")


def remote_files(logs: RunLogs, reply: ArtifactsReply) -> list[tuple[str, list[RemoteFile]]]:
    """The listing, checked before anything is read or written here: a host names
    folders and files, it does not choose where they go (`local_name`, `inside`)."""
    host = logs.ref.host
    folders = []
    for entry in reply.folders:
        folder = local_name(host, entry.folder)
        files = []
        for item in entry.files:
            if not _SHA256.fullmatch(item.sha256):
                raise DflashError(f"host {host}: refusing {entry.folder}/{item.path!r}: its sha256 "
                                  f"{item.sha256!r} is not 64 hex digits", ExitCode.UNREACHABLE)
            local = inside(logs.dir, f"{folder}/{item.path}", host)
            files.append(RemoteFile(entry.folder, item.path, item.size, item.sha256, item.identity, local))
        if len({f.path for f in files}) != len(files):
            raise DflashError(f"host {host}: refusing the listing of {entry.folder}: it names a file twice",
                              ExitCode.UNREACHABLE)
        folders.append((entry.folder, files))
    if len({entry.folder for entry in reply.folders}) != len(reply.folders):
        raise DflashError(f"host {host}: refusing the listing: it names a folder twice", ExitCode.UNREACHABLE)
    return folders


class Pulled:
    """pulled.json: the files (and parts) pull put under logs/<host>/<run>/, as paths
    relative to it. Written atomically before a file is begun, so that a pull killed
    anywhere leaves nothing of its own unlisted."""

    def __init__(self, logs: RunLogs):
        self.root = logs.dir
        self.path = logs.dir / MANIFEST
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            data = {"files": []}
        except (OSError, ValueError) as exc:
            raise DflashError(f"cannot read {self.path}: {exc}", ExitCode.USAGE,
                              hint="remove it: pull then removes none of the files it brought before") from exc
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise DflashError(f"{self.path}: expected {{\"files\": [paths]}}", ExitCode.USAGE,
                              hint="remove it: pull then removes none of the files it brought before")
        self.files = set(files)

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def add(self, paths: set[Path]) -> None:
        new = {self.relative(path) for path in paths} - self.files
        if new:
            self.files |= new
            self.save()

    def save(self) -> None:
        write_atomic(self.path, json.dumps({"files": sorted(self.files)}, indent=1).encode())

    def remove_others(self, folder: Path, keep: set[Path], host: str) -> int:
        """Delete the files of `folder` this list holds and `keep` lacks (an older
        export's, parts of another version), then the subfolders that left empty; a
        file it lists that is gone or no longer a plain file is dropped from it, not
        touched. How many were deleted."""
        prefix = self.relative(folder) + "/"
        kept = {self.relative(path) for path in keep}
        removed, emptied = 0, set()
        for name in sorted(f for f in self.files if f.startswith(prefix) and f not in kept):
            self.files.discard(name)
            try:
                path = inside(self.root, name, host)
            except DflashError:  # a symlink on its way now: not a file of pull's any more
                continue
            try:
                regular = stat.S_ISREG(path.lstat().st_mode)
            except FileNotFoundError:
                continue
            if regular:
                path.unlink()
                removed += 1
                emptied.add(path.parent)
        self.save()
        for parent in sorted(emptied, key=lambda p: -len(p.parts)):
            while parent != folder and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent
        return removed


class Puller:
    """One pull of one run: the connection, the progress bar and what came so far."""

    def __init__(self, agent: AgentClient, logs: RunLogs, bars: Progress | None, retry_for: float):
        self.agent = agent
        self.ref = logs.ref
        self.logs = logs
        self.bars = bars
        self.task = None
        self.retry_for = retry_for
        self.reconnects = Reconnects(retry_for)
        self.bytes_received = 0
        self.received: dict[Path, str] = {}  # local path -> sha256 this pull put there
        self.pulled = Pulled(logs)

    def list(self, checkpoint: bool) -> list[tuple[str, list[RemoteFile]]]:
        request = requests.Artifacts(self.ref.run_id, checkpoint)
        try:
            reply = retry_dropped(lambda: self.agent.call(request), self.retry_for)
        except DflashError as exc:
            if "invalid choice: 'artifacts'" in exc.message:  # the agent's argparse, before pull existed
                exc.hint = f"the host's current release predates pull: dflash deploy {self.ref.host}"
            raise
        if not reply.state.terminal:
            console.say(f"run {self.ref.run_id} is {reply.state}: pulling what it wrote so far")
        return remote_files(self.logs, reply)

    def is_current(self, local: Path, remote: RemoteFile) -> bool:
        """The local copy is the listed file (a size check first spares hashing most
        changed files)."""
        if self.received.get(local) == remote.sha256:
            return True
        try:
            return local.stat().st_size == remote.size and sha256_file(local) == remote.sha256
        except FileNotFoundError:
            return False

    def part(self, local: Path, remote: RemoteFile) -> Path:
        """The part `remote` is received into, beside `local`, checked as `local` was."""
        return inside(self.logs.dir, self.pulled.relative(part_path(local, remote.sha256)), self.ref.host)

    def sync(self, checkpoint: bool) -> PullResult:
        """Pull what the host lists now (listing again while it replaces a folder). A full
        local disk ends it (`local_disk_full`), the part being received removed."""
        with local_writes(self.logs.dir):
            return self._sync(checkpoint)

    def _sync(self, checkpoint: bool) -> PullResult:
        for _ in range(LISTINGS):
            listing = self.list(checkpoint)
            wanted = [(f.local, f) for _, files in listing for f in files]
            missing = [(local, f) for local, f in wanted if not self.is_current(local, f)]
            # Listed before a byte is written: every file this pull may make, final or part.
            self.pulled.add({local for local, _ in wanted} | {self.part(local, f) for local, f in missing})
            self._show_progress(missing)
            if all(self.fetch(local, f) for local, f in missing):
                for folder, files in listing:
                    self.check_whole(folder, files)
                folders = tuple(local_folder(self.logs, folder) for folder, _ in listing)
                keep = {local for local, _ in wanted}
                removed = sum(self.pulled.remove_others(folder, keep, self.ref.host) for folder in folders)
                skipped = sum(1 for local, f in wanted if self.received.get(local) != f.sha256)
                return PullResult(self.ref.run_id, self.ref.host, folders, len(wanted) - skipped,
                                  self.bytes_received, skipped, removed)
            console.say(f"run {self.ref.run_id}: a folder was replaced on {self.ref.host} while it was "
                        "pulled; listing it again")
        raise DflashError(f"run {self.ref.run_id}: its files kept changing on {self.ref.host} during "
                          f"{LISTINGS} listings; try again when the run has written them",
                          ExitCode.UNREACHABLE)

    def check_whole(self, folder: str, files: list[RemoteFile]) -> None:
        """Every file `folder`'s SHA256SUMS (as pulled) lists came, with the sha256 it
        lists; DflashError (exit 2) naming the first that did not."""
        local = local_folder(self.logs, folder)
        came = {f.path: f.sha256 for f in files}
        where = f"host {self.ref.host}: {folder} of run {self.ref.run_id}"
        if SHA256SUMS not in came:
            raise DflashError(f"{where} has no {SHA256SUMS}: nothing says which files it must hold, so the copy "
                              f"in {local} cannot be verified", ExitCode.USAGE)
        try:
            sums = parse_sums((local / SHA256SUMS).read_text(encoding="utf-8", errors="replace"))
        except ValueError as exc:
            raise DflashError(f"{where}: {exc}", ExitCode.USAGE) from exc
        for path, digest in sorted(sums.items()):
            if path not in came:
                raise DflashError(f"{where} lacks {path}, which its {SHA256SUMS} lists: the copy in {local} is not "
                                  "the whole folder the trainer wrote", ExitCode.USAGE)
            if came[path] != digest:
                raise DflashError(f"{where}: {path} came with sha256 {came[path]}, not the {digest} its "
                                  f"{SHA256SUMS} lists", ExitCode.USAGE)

    def _show_progress(self, missing: list[tuple[Path, RemoteFile]]) -> None:
        rest = sum(f.size - _part_length(part_path(local, f.sha256), f.size) for local, f in missing)
        if self.bars is None or rest <= PROGRESS_ABOVE_BYTES:
            return
        if self.task is None:
            self.task = self.bars.add_task(f"pull {self.ref.run_id}", total=rest)
        else:  # listed again: what is left now
            self.bars.reset(self.task, total=rest)

    def fetch(self, local: Path, remote: RemoteFile) -> bool:
        """Receive `remote` into its part, verify it and move it into place. False when
        the host's folder was replaced since it was listed."""
        part = self.part(local, remote)
        self.pulled.add({local, part})  # listed already when sync asks: no write then
        local.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(2):
            try:
                received = self.receive(remote, part)
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                part.unlink(missing_ok=True)  # its bytes would only hold the disk full
                raise local_disk_full(part) from exc
            if not received:
                return False
            digest = sha256_file(part)
            if digest == remote.sha256:
                os.replace(part, local)
                fsync_path(local.parent)
                self.received[local] = remote.sha256
                return True
            part.unlink()
            if attempt == 0:  # a part spoiled here (disk, a hand edit): once more from byte 0
                console.warn(f"{remote.folder}/{remote.path}: sha256 {digest[:16]}... is not the "
                             f"listed {remote.sha256[:16]}...; receiving it again from its start")
        raise DflashError(f"host {self.ref.host}: {remote.folder}/{remote.path} does not match the "
                          f"sha256 listed for it ({remote.sha256}), twice: the host's copy differs "
                          "from its SHA256SUMS", ExitCode.USAGE)

    def receive(self, remote: RemoteFile, part: Path) -> bool:
        """Append to `part` until it holds `remote.size` bytes, resuming at its length
        after a dropped connection. False when the host refused (the folder was
        replaced since the listing)."""
        while True:
            have = _part_length(part, remote.size)
            if have == remote.size:
                return True
            before = self.bytes_received
            try:
                self._send_file(remote, part, have)
            except CommandFailed as exc:
                obj = parse_reply(exc.stderr)
                if obj is None:
                    raise
                with self.agent.reading():
                    refusal = ErrorReply.from_json(obj)
                if refusal.kind == ErrorKind.CONFLICT:
                    return False
                raise DflashError(f"host {self.ref.host}: {refusal.error}", ExitCode.USAGE) from exc
            except UnreachableError as exc:
                # The listing reached the host: anything unreachable now is a drop.
                if self.bytes_received > before:
                    self.reconnects.progressed()
                self.reconnects.wait(exc, f"{part} keeps what came; dflash pull resumes it")
                continue
            if _part_length(part, remote.size) != remote.size:
                return False  # the file ended early: it changed under its identity; list again

    def _send_file(self, remote: RemoteFile, part: Path, have: int) -> None:
        chunks = self.agent.chunks(requests.SendFile(self.ref.run_id, remote.folder, remote.path, have,
                                                     remote.identity))
        with open(part, "ab") as out, contextlib.closing(chunks):  # closed: a write that fails ends the command
            try:
                for chunk in chunks:
                    out.write(chunk)
                    self.bytes_received += len(chunk)
                    if self.task is not None:
                        self.bars.advance(self.task, len(chunk))
            except CommandFailed:
                # The agent sends nothing before refusing; what a failing command printed
                # anyway (a missing release's message) is not the file's.
                out.truncate(have)
                raise
            finally:
                out.flush()
                os.fsync(out.fileno())


def _part_length(part: Path, size: int) -> int:
    """How much of the file its part holds; a part longer than the file is no part of it."""
    try:
        have = part.stat().st_size
    except FileNotFoundError:
        return 0
    if have > size:
        part.unlink()
        return 0
    return have


def pull(session: Session, ref: RunRef, options: PullOptions = PullOptions()) -> PullResult:
    """The run's export (and with `options.checkpoint` its newest checkpoint) brought to
    logs/<host>/<run>/, its progress drawn on stderr. Ctrl-C keeps what came (said on
    stderr) and is raised on: the next pull goes on from it."""
    try:
        with transfer_bars() as bars:
            return Puller(session.agent(ref.host), RunLogs(session.logs_dir, ref), bars,
                          options.retry_for).sync(options.checkpoint)
    except KeyboardInterrupt:
        console.say(f"interrupted: what came is kept; dflash pull {ref.run_id} resumes it")
        raise
