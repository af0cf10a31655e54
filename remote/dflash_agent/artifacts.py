"""The `artifacts` and `send-file` verbs: what `dflash pull` brings home, and its bytes.

A run's export/ and each checkpoint are folders the trainer replaces whole (a staging
folder renamed into place), so a listing reads one folder through one open descriptor:
it describes one version even when a new export takes the name meanwhile. A file's
sha256 comes from the folder's SHA256SUMS (written by the trainer after the other
files), else it is computed here. Each file also carries an `identity` (device, inode,
size, mtime); `send-file` refuses a file whose identity changed since the listing,
before sending a byte, so a client resuming at an offset never splices two versions.

`send-file --run-id ID --folder F --path P --identity I [--offset N]` writes F/P's bytes
from N to its end on stdout, nothing else. Refused before any byte, the error reply the
one line on stderr: kind "conflict" when the file is gone or its identity is no longer I
(list again); "usage" for F other than export or checkpoints/step_NNNNNN, a P leading
out of F, or N past the end.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import sys
from typing import Dict, List

from dflash_contract.replies import ArtifactFile, ArtifactFolder, ArtifactsReply
from dflash_contract.states import RunState
from dflash_files.checkpoint_files import CHECKPOINTS_DIR, EXPORT_DIR, LATEST, SHA256SUMS, STEP_FOLDER

from .jsonio import AgentError
from .layout import RunDir
from .state import derive_state, observe, read_record

CHUNK = 1 << 20
_SUM_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def artifacts(run: RunDir, checkpoint: bool) -> ArtifactsReply:
    state = derive_state(observe(run, read_record(run)))
    folders = [_listing(run, EXPORT_DIR, state)]
    if checkpoint:
        folders.append(_listing(run, _latest_checkpoint(run, state), state))
    return ArtifactsReply(run_id=run.run_id, state=state, folders=tuple(folders))


def _latest_checkpoint(run: RunDir, state: RunState) -> str:
    """checkpoints/<step folder> that `latest` names now. The trainer makes `latest` a
    link to a step folder's bare name beside it; anything else (`..`, a path, a file
    that is no link) would have a listing of some other folder sent as the checkpoint."""
    link = os.path.join(CHECKPOINTS_DIR, LATEST)
    try:
        name = os.readlink(run.file(link))
    except FileNotFoundError:
        raise AgentError("run %r has no checkpoint yet (state %s)" % (run.run_id, state), "not_found")
    except OSError:
        raise AgentError("run %r: %s is not a link to a checkpoint folder" % (run.run_id, link), "host")
    if not STEP_FOLDER.fullmatch(name):
        raise AgentError("run %r: %s points to %r, which is not a checkpoint folder of the run (step_NNNNNN)"
                         % (run.run_id, link, name), "host")
    return CHECKPOINTS_DIR + "/" + name


def _listing(run: RunDir, folder: str, state: RunState) -> ArtifactFolder:
    # A step folder (or export/) that is a link would have another folder listed as it.
    if os.path.islink(run.file(folder)):
        raise AgentError("run %r: %s is a link, not a folder of the run" % (run.run_id, folder), "host")
    try:
        # O_NOFOLLOW: a link put there since is not followed either (it fails as not a folder)
        fd = os.open(run.file(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        # export/ appears when training ends; a checkpoint only vanishes when pruned
        missing = "has no export yet" if folder == EXPORT_DIR else "lost %s meanwhile (pruned)" % folder
        raise AgentError("run %r %s (state %s)" % (run.run_id, missing, state), "not_found")
    try:
        sums = _read_sums(fd)
        files: List[ArtifactFile] = []
        hashed: List[str] = []
        for top, dirs, names, dir_fd in os.fwalk(".", dir_fd=fd):
            dirs.sort()
            for name in sorted(names):
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    continue  # the trainer writes regular files only
                path = os.path.normpath(os.path.join(top, name))
                digest = sums.get(path) if path != SHA256SUMS else None
                if digest is None:
                    digest = _hash(name, dir_fd)
                    if path != SHA256SUMS:
                        hashed.append(path)
                files.append(ArtifactFile(path=path, size=info.st_size, sha256=digest, identity=identity(info)))
    finally:
        os.close(fd)
    return ArtifactFolder(folder=folder, files=tuple(files), hashed_on_host=tuple(hashed))


def _read_sums(dir_fd: int) -> Dict[str, str]:
    """{path: sha256} from SHA256SUMS; {} when there is none (an export written before
    the trainer wrote one): every file is hashed then."""
    try:
        fd = os.open(SHA256SUMS, os.O_RDONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as handle:
        text = handle.read().decode("utf-8", "replace")
    sums = {}
    for line in text.splitlines():
        match = _SUM_LINE.match(line)
        if match:
            sums[os.path.normpath(match.group(2))] = match.group(1)
    return sums


def _hash(name: str, dir_fd: int) -> str:
    digest = hashlib.sha256()
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def identity(info: os.stat_result) -> str:
    return "%d:%d:%d:%d" % (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _check_folder(folder: str) -> None:
    parts = folder.split("/")
    if not (parts == [EXPORT_DIR] or (len(parts) == 2 and parts[0] == CHECKPOINTS_DIR
                                  and STEP_FOLDER.fullmatch(parts[1]))):
        raise AgentError("--folder: expected %s or %s/<step folder>, got %r" % (EXPORT_DIR, CHECKPOINTS_DIR, folder),
                         "usage")


def send_file(run: RunDir, folder: str, path: str, offset: int, expected: str) -> None:
    """The bytes of `folder`/`path` from `offset` to its end, raw on stdout. Refused
    (kind conflict) before a byte is sent when the file is gone or is not the one
    listed with identity `expected`."""
    _check_folder(folder)
    if not path or os.path.isabs(path) or ".." in path.split("/"):
        raise AgentError("--path: expected a path inside %s, got %r" % (folder, path), "usage")
    root = os.path.realpath(run.file(folder))
    full = os.path.join(run.file(folder), path)
    if not os.path.realpath(full).startswith(root + os.sep):
        raise AgentError("--path: %r leads out of %s" % (path, folder), "usage")
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise AgentError("%s/%s is gone since it was listed" % (folder, path), "conflict")
    # Read through this descriptor only: a folder replaced while the bytes flow leaves
    # the file opened here whole (it is unlinked, not overwritten).
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if identity(info) != expected:
            raise AgentError("%s/%s changed since it was listed" % (folder, path), "conflict")
        if offset > info.st_size:
            raise AgentError("--offset %d is past the end of %s/%s (%d bytes)"
                             % (offset, folder, path, info.st_size), "usage")
        handle.seek(offset)
        out = sys.stdout.buffer
        for block in iter(lambda: handle.read(CHUNK), b""):
            out.write(block)
        out.flush()
