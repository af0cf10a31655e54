"""logs/: what the CLI fetched, per host and run (docs/cli.md "Local state").

logs/<host>/<run-id>/ holds train.log (as streamed; train.log.seg1, .seg2, ... for the
content after each truncation or replacement on the host), events.jsonl (the run's
events but heartbeats), TensorBoard event files made from them, trackers.json (what
the trackers of dflash.yaml hold: trackers/hub.py), traceback.txt,
errors.jsonl, cursor.json and watch.lock, hosts.json for a run on several hosts, and what `pull` brought: export/ and checkpoint/<step folder>/, listed in pulled.json; logs/latest.json names the run `watch`, `fetch-traceback`,
`status` and `stop` use by default. Everything read by another command is written
atomically.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from pathlib import Path, PurePosixPath
from typing import Iterator, Sequence

from dflash_contract.names import ERRORS_JSONL, EVENTS_JSONL, TRAIN_LOG
from dflash_contract.records import ErrorRecord, parse_json_line
from dflash_files import atomic, diskspace

from .errors import DflashError, ExitCode
from .project_tree import STATE_MARKERS, state_root


HOSTS_FILE = "hosts.json"  # logs/<host>/<run>/: the hosts of a run on several hosts
LATEST_FILE = "latest.json"  # logs/: the latest run launched or resumed with this logs/
RELEASES_DIR = "releases"  # logs/: the release store's (release_store.py), not a host's


def is_name(name: str) -> bool:
    """Whether `name` is one folder or file name: what a host name, a run id or a name a
    host lists must be before it becomes part of a path under logs/."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def inside(root: Path, relative: str, host: str) -> Path:
    """root/relative, for a relative path that `host` sent (a file of its listing):
    refused (exit 3, naming the host) when it is empty, absolute, not in its plain form
    (`a//b`, `./a`), holds `..`, or leads through a symlink under root, so that nothing a
    host names is read, written or removed outside root."""
    path = PurePosixPath(relative)
    if path.is_absolute() or not path.parts or path.as_posix() != relative or not all(map(is_name, path.parts)):
        raise DflashError(f"host {host}: refusing the path {relative!r}: not a plain relative path inside {root}",
                          ExitCode.UNREACHABLE)
    full = root
    for part in path.parts:
        full = full / part
        if full.is_symlink():
            raise DflashError(f"host {host}: refusing the path {relative!r}: {full} is a symlink, which could "
                              f"lead out of {root}", ExitCode.UNREACHABLE)
    return full


def local_disk_full(path: Path) -> DflashError:
    """The error for a write under logs/ that failed for want of space: this machine's
    disk, not the run's, with an exit code of its own (docs/cli.md "CLI exit codes")."""
    where = str(path)
    return DflashError(f"the local disk is full: cannot write {path} ({diskspace.free_bytes(where)} bytes free on "
                       f"{diskspace.mount_point(where)}); the run on its host is not affected",
                       ExitCode.LOCAL_DISK_FULL,
                       hint="make room there (or give --logs-dir on another disk) and run the command again: "
                            "it goes on from what is kept")


@contextlib.contextmanager
def local_writes(folder: Path) -> Iterator[None]:
    """A write under `folder` that fails for want of space raises `local_disk_full`,
    naming the file when the failure names one."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in diskspace.NO_SPACE:
            raise
        raise local_disk_full(Path(exc.filename) if exc.filename else folder) from exc


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one (the agent's and the trainer's
    helper), in a folder made first if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_atomic(str(path), data)


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where a follow stream stopped: the segment of the remote log (0, then one more
    per truncation or replacement seen), its inode, the byte offset in it, the
    fingerprint of the bytes just before that offset (a resume on a log that was cut and
    grew back past the offset must not go on mid-line), and how many error records were
    received. The segment's mirror holds the remote bytes [mirror_start, offset); a
    mirror found longer than that (the CLI died between writing it and saving the
    cursor) is cut back, so a resume duplicates nothing. Likewise for the events: the
    host's events.jsonl was received up to byte events_offset, and the local
    events.jsonl's first events_mirrored bytes hold them (it is cut back to that)."""
    segment: int = 0
    inode: int | None = None
    offset: int = 0
    fingerprint: str | None = None
    errors_seen: int = 0
    mirror_start: int = 0
    events_offset: int = 0
    events_mirrored: int = 0


@dataclasses.dataclass(frozen=True)
class RunRef:
    host: str  # for a run on several hosts: the first (rank 0, which writes the export)
    run_id: str
    hosts: tuple[str, ...] = ()  # a run on several hosts: all of them, in rank order

    @classmethod
    def from_json(cls, data: dict) -> "RunRef":
        return cls(data["host"], data["run_id"], tuple(data.get("hosts") or ()))

    @property
    def members(self) -> list["RunRef"]:
        """One reference per host of the run: its own part there."""
        return [RunRef(host, self.run_id) for host in self.hosts] or [self]

    @property
    def multihost(self) -> bool:
        return len(self.hosts) > 1


class RunLogs:
    def __init__(self, logs_dir: Path, ref: RunRef):
        # Checked before any path is made of them: `/tmp/x` or `../x` would put the run's
        # files (watch.lock, cursor.json, a pull) outside logs/.
        for what, name in (("host", ref.host), ("run id", ref.run_id)):
            if not is_name(name):
                raise DflashError(f"run {ref.run_id!r} on host {ref.host!r}: its {what} cannot name a folder under "
                                  f"{logs_dir} (one path component, without '/', not '.' or '..'); nothing was "
                                  "written", ExitCode.USAGE)
        self.ref = ref
        self.dir = logs_dir / ref.host / ref.run_id

    @property
    def export(self) -> Path:
        """Where `pull` puts the run's export."""
        return self.dir / "export"

    def checkpoint(self, step_folder: str) -> Path:
        """Where `pull --checkpoint` puts the checkpoint of that step (e.g. step_000100)."""
        return self.dir / "checkpoint" / step_folder

    def segment_log(self, segment: int) -> Path:
        """The mirror of one segment of the remote train.log: a truncation or replacement
        there starts a new file here, so old and new content are never spliced."""
        return self.dir / (TRAIN_LOG if segment == 0 else f"{TRAIN_LOG}.seg{segment}")

    def claim(self):
        """This run's local state for one `watch` at a time: an open file holding an
        exclusive lock (released when the process ends, however it ends), or None when
        another watch holds it. A second watch must not resume at the first one's cursor
        (the lines before it were shown on another terminal) nor append to its mirror."""
        self.dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.dir / "watch.lock", "ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        return handle

    def load_cursor(self) -> Cursor:
        try:
            return Cursor(**json.loads((self.dir / "cursor.json").read_text()))
        except (OSError, ValueError, TypeError):
            return Cursor()

    def save_cursor(self, cursor: Cursor) -> None:
        write_atomic(self.dir / "cursor.json", json.dumps(dataclasses.asdict(cursor)).encode())

    def open_mirror(self, cursor: Cursor):
        """The cursor's segment mirror, cut back to what the cursor accounts for, open for
        append."""
        return self._open_cut_back(self.segment_log(cursor.segment), cursor.offset - cursor.mirror_start)

    @property
    def events(self) -> Path:
        """The run's events as received (every type but heartbeat), one JSON per line."""
        return self.dir / EVENTS_JSONL

    def open_events_mirror(self, cursor: Cursor):
        """The local events.jsonl, cut back to what the cursor accounts for, open for append."""
        return self._open_cut_back(self.events, cursor.events_mirrored)

    def _open_cut_back(self, path: Path, expected: int):
        self.dir.mkdir(parents=True, exist_ok=True)
        fh = open(path, "ab")
        if fh.tell() != expected:
            fh.truncate(min(fh.tell(), expected))
            fh.seek(0, os.SEEK_END)
        return fh

    def recent_events(self, cursor: Cursor, limit: int = 256 * 1024) -> list[dict]:
        """The last events the cursor accounts for (those in the last `limit` bytes of
        the local events.jsonl): where a run was when its watch resumes."""
        try:
            with open(self.events, "rb") as fh:
                start = max(0, cursor.events_mirrored - limit)
                fh.seek(start)
                lines = fh.read(cursor.events_mirrored - start).split(b"\n")
        except FileNotFoundError:
            return []
        records = map(parse_json_line, lines[1:] if start else lines)  # the first may be cut
        return [record for record in records if isinstance(record, dict)]

    def mirrored_events(self, cursor: Cursor) -> list[dict]:
        """Every event the cursor accounts for (the first events_mirrored bytes of the
        local events.jsonl), in order."""
        try:
            with open(self.events, "rb") as fh:
                lines = fh.read(cursor.events_mirrored).split(b"\n")
        except FileNotFoundError:
            return []
        records = map(parse_json_line, lines)
        return [record for record in records if isinstance(record, dict)]

    def load_events(self) -> list[dict]:
        """The mirrored events (for `plot`); a last line cut short is left out."""
        with open(self.events, "rb") as fh:
            lines = fh.read().split(b"\n")
        return [json.loads(line) for line in lines[:-1] if line.strip()]

    def load_errors(self) -> list[ErrorRecord]:
        try:
            lines = (self.dir / ERRORS_JSONL).read_text().splitlines()
        except OSError:
            return []
        return [ErrorRecord.of_line(line) for line in lines if line.strip()]

    def save_errors(self, records: Sequence[ErrorRecord]) -> None:
        text = "".join(json.dumps(r.to_json()) + "\n" for r in records)
        write_atomic(self.dir / ERRORS_JSONL, text.encode())

    def save_traceback(self, text: str) -> Path:
        path = self.dir / "traceback.txt"
        write_atomic(path, text.encode("utf-8", "surrogateescape"))
        return path


def set_latest(logs_dir: Path, ref: RunRef) -> None:
    """`ref` becomes the latest run. Every run launched or resumed here gets its folder
    logs/<host>/<run>/ (the record that lets a prefix or a name find it later,
    run_names.py); a run on several hosts is also recorded in each host's
    logs/<host>/<run>/hosts.json, so that the run id alone finds all of them."""
    for member in ref.members:
        if ref.multihost:
            write_atomic(RunLogs(logs_dir, member).dir / HOSTS_FILE, json.dumps({"hosts": list(ref.hosts)}).encode())
        else:
            RunLogs(logs_dir, member).dir.mkdir(parents=True, exist_ok=True)
    write_atomic(logs_dir / LATEST_FILE, json.dumps(dataclasses.asdict(ref)).encode())


def latest_run(logs_dir: Path) -> RunRef | None:
    """The latest run this checkout launched, or None when none is recorded. One whose
    names cannot be folders under logs/ is refused naming the file."""
    try:
        ref = RunRef.from_json(json.loads((logs_dir / LATEST_FILE).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    hosts = ref.hosts or (ref.host,)
    if not all(isinstance(name, str) and is_name(name) for name in (ref.run_id, ref.host, *hosts)):
        raise DflashError(f"{logs_dir / LATEST_FILE} names run {ref.run_id!r} on {', '.join(map(repr, hosts))}, "
                          f"which cannot name folders under {logs_dir}", ExitCode.USAGE,
                          hint=f"remove {logs_dir / LATEST_FILE} and name the run: RUN --host HOST")
    return ref


def _recorded(logs_dir: Path, ref: RunRef) -> RunRef:
    """The whole run when `ref`'s host holds a record of a run on several hosts."""
    try:
        hosts = tuple(json.loads((RunLogs(logs_dir, ref).dir / HOSTS_FILE).read_text())["hosts"])
    except (OSError, ValueError, TypeError, KeyError):
        return ref
    return RunRef(hosts[0], ref.run_id, hosts) if ref.host in hosts else ref


def latest_host(logs_dir: Path) -> str:
    """The host of the latest run this checkout launched, else `local`."""
    latest = latest_run(logs_dir)
    return latest.host if latest else "local"


def check_run_text(run_id: str) -> None:
    """A RUN the command line gave: refused when no run could be named so."""
    if not run_id or run_id.startswith("-"):
        # `dflash launch` makes no such id; the agent would read one as an option.
        raise DflashError(f"{run_id!r} is not a run id (run ids start with the run's name)", ExitCode.USAGE)


def latest_or_refuse(logs_dir: Path, host: str | None, naming: str | None) -> RunRef:
    """The latest run (of `host`, when given), or the error saying that none was named
    and none is recorded."""
    latest = latest_run(logs_dir)
    if latest is not None and host and host in latest.hosts:
        return RunRef(host, latest.run_id)
    if latest is None or (host and latest.host != host):
        no_root = "" if state_root() else (f" (no project root above {os.getcwd()}: no folder there holds "
                                           f"{', '.join(STATE_MARKERS)})")
        raise DflashError("no run given and no latest run recorded in "
                          f"{logs_dir / LATEST_FILE}{no_root}", ExitCode.USAGE,
                          hint=f"name the run: {naming or 'RUN and --host HOST'}")
    return latest


def recorded_run(logs_dir: Path, run_id: str, host: str | None) -> RunRef | None:
    """The run of this exact id that logs/ records (on `host`, when given: that host's
    part of a run on several), or None when none does."""
    if host:
        recorded = (logs_dir / host / run_id).is_dir() if is_name(host) and is_name(run_id) else False
        latest = latest_run(logs_dir)
        known = recorded or (latest is not None and latest.run_id == run_id and host in (latest.hosts or (latest.host,)))
        return RunRef(host, run_id) if known else None  # one host's part, also of a run on several hosts
    latest = latest_run(logs_dir)
    if latest and latest.run_id == run_id:
        return latest
    matches = sorted(p.parent.name for p in logs_dir.glob(f"*/{_glob_escape(run_id)}") if p.is_dir())
    found = {_recorded(logs_dir, RunRef(match, run_id)) for match in matches}
    if len(found) == 1:
        return found.pop()
    if not matches:
        return None
    raise DflashError(f"run {run_id!r} exists on several hosts ({', '.join(matches)})",
                      ExitCode.USAGE, hint="pick one with --host")


def recorded_runs(logs_dir: Path, host: str | None = None) -> list[RunRef]:
    """Every run logs/ records (of `host`, when given): the latest run and each folder
    logs/<host>/<run>/, a run on several hosts once, by its rank 0."""
    found: set[RunRef] = set()
    latest = latest_run(logs_dir)
    if latest is not None and (host is None or host in (latest.hosts or (latest.host,))):
        found.add(latest if host is None else RunRef(host, latest.run_id))
    try:
        hosts = [host] if host else [entry.name for entry in logs_dir.iterdir()
                                     if entry.is_dir() and entry.name != RELEASES_DIR]
    except OSError:
        hosts = []
    for name in hosts:
        if not is_name(name):
            continue
        try:
            runs = [entry.name for entry in (logs_dir / name).iterdir() if entry.is_dir()]
        except OSError:
            continue
        for run_id in runs:
            ref = RunRef(name, run_id)
            found.add(ref if host else _recorded(logs_dir, ref))
    return sorted(found, key=lambda ref: (ref.run_id, ref.host))


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
