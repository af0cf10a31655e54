"""SHA256SUMS: what makes a checkpoint or an export folder whole (docs/layout.md).

The trainer writes it last into every such folder (`sha256sum -c` lines, `<sha256>  <path>`,
sorted); `verify` is the one check of a folder against it: the agent's before a resume or
a restart starts from a checkpoint, and `status`'s; the trainer's before it loads a
checkpoint the config names. A folder is intact only when SHA256SUMS is there and well
formed, lists every file the caller requires, and every file it lists has those bytes.

Files are hashed at the disk's speed: read into one buffer in large chunks (no copy per
chunk), several files at once in threads (hashlib releases the GIL while it hashes), and
the others stop at their next chunk once one file is found wrong.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from .checkpoint_files import SHA256SUMS

CHUNK = 8 << 20
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What `verify` found: `problem` is None for an intact folder, else one line naming
    the file and what is wrong with it."""
    folder: str
    problem: Optional[str]
    hashed_bytes: int  # what was read to find it out

    @property
    def intact(self) -> bool:
        return self.problem is None


def sha256_file(path: str, stop: Optional[threading.Event] = None) -> Tuple[Optional[str], int]:
    """(hex sha256 of the file at `path`, its size); (None, bytes read) when `stop` was set
    before the end."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            if stop is not None and stop.is_set():
                return None, size
            count = handle.readinto(buffer)
            if not count:
                return digest.hexdigest(), size
            digest.update(view[:count])
            size += count


def sums_text(folder: str, names: Sequence[str]) -> str:
    """SHA256SUMS's text for the files `names` (paths under `folder`, "/"-separated)."""
    return "".join("%s  %s\n" % (sha256_file(os.path.join(folder, name))[0], name) for name in sorted(names))


def parse_sums(text: str) -> Dict[str, str]:
    """{path: sha256} of SHA256SUMS's text; ValueError naming the first line that is not
    `<sha256>  <path>` with a path inside the folder, or a path listed twice."""
    sums = {}  # type: Dict[str, str]
    for number, line in enumerate(text.splitlines(), 1):
        match = _LINE.match(line)
        path = os.path.normpath(match.group(2)) if match else ""
        if match is None or os.path.isabs(path) or path == "." or path.split(os.sep)[0] == "..":
            raise ValueError("%s line %d is not `<sha256>  <path in the folder>`: %r"
                             % (SHA256SUMS, number, line[:200]))
        if path in sums:
            raise ValueError("%s lists %s twice" % (SHA256SUMS, path))
        sums[path] = match.group(1)
    return sums


def read_sums(folder: str) -> Dict[str, str]:
    """{path: sha256} from `folder`'s SHA256SUMS; FileNotFoundError without one,
    ValueError when it is not well formed."""
    with open(os.path.join(folder, SHA256SUMS), "rb") as handle:
        return parse_sums(handle.read().decode("utf-8", "replace"))


def verify(folder: str, required: Sequence[str] = ()) -> Verdict:
    """`folder` checked against its SHA256SUMS: every file it lists (and every one of
    `required`, which it must list) has the bytes listed."""
    try:
        sums = read_sums(folder)
    except FileNotFoundError:
        return Verdict(folder, "%s is missing: nothing says what its files should hold" % SHA256SUMS, 0)
    except (OSError, ValueError) as exc:
        return Verdict(folder, str(exc), 0)
    unlisted = [name for name in required if name not in sums]
    if unlisted:
        return Verdict(folder, "%s does not list %s" % (SHA256SUMS, ", ".join(unlisted)), 0)
    for name in sorted(sums):
        if not os.path.isfile(os.path.join(folder, name)):
            return Verdict(folder, "%s is missing (%s lists it)" % (name, SHA256SUMS), 0)
    problems, hashed = _hash_all(folder, sums)
    return Verdict(folder, problems[0] if problems else None, hashed)


def _hash_all(folder: str, sums: Dict[str, str]) -> Tuple[List[str], int]:
    """(what is wrong, in the files' order; the bytes read), the files hashed in threads
    (as many as the host has cores, at most one a file); the first wrong file stops the rest."""
    names = sorted(sums, key=lambda name: -_size(os.path.join(folder, name)))  # the largest first
    stop = threading.Event()
    found = {}  # type: Dict[str, str]
    hashed = [0]
    lock = threading.Lock()
    pending = list(names)

    def work() -> None:
        while not stop.is_set():
            with lock:
                if not pending:
                    return
                name = pending.pop(0)
            problem, size = _check_one(folder, name, sums[name], stop)
            with lock:
                hashed[0] += size
                if problem is not None:
                    found[name] = problem
                    stop.set()

    threads = [threading.Thread(target=work, name="sha256-%d" % i, daemon=True)
               for i in range(min(len(names), os.cpu_count() or 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [found[name] for name in sorted(found)], hashed[0]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # gone since: its read says so


def _check_one(folder: str, name: str, expected: str, stop: threading.Event) -> Tuple[Optional[str], int]:
    try:
        digest, size = sha256_file(os.path.join(folder, name), stop)
    except OSError as exc:
        return "%s cannot be read: %s" % (name, exc.strerror or exc), 0
    if digest is None or digest == expected:
        return None, size
    return ("%s (%d bytes) does not hold what %s lists: sha256 %s, not %s"
            % (name, size, SHA256SUMS, digest[:16] + "…", expected[:16] + "…"), size)
