"""The `release-files`, `run-config` and `gc` verbs: what `dflash diff`, `dflash runs` and
`dflash gc` read from and remove in <workspace>/releases/ (docs/releases.md "Releases on a host")."""
from __future__ import annotations

import base64
import errno
import fcntl
import os
import re
import shutil
import stat
from typing import Dict, List, Sequence


from dflash_contract.replies import GcReply, KeptRelease, ReleaseFilesReply, RemovedRelease, RunConfigReply

from .jsonio import AgentError, decode_bytes, read_json
from .layout import RunDir, Workspace

#: A file above this is named in "too_large" instead of being sent inline in the JSON reply.
INLINE_MAX_BYTES = 8 * 1024 * 1024
_RELEASE_ID = re.compile(r"^[0-9a-f]{16}$")


def release_dir(ws: Workspace, release_id: str) -> str:
    """releases/<release_id>, which must be installed (its MANIFEST there)."""
    if not _RELEASE_ID.match(release_id):
        raise AgentError("invalid release id %r: 16 hex digits" % release_id, "usage")
    folder = os.path.join(ws.root, "releases", release_id)
    if not os.path.isfile(os.path.join(folder, "MANIFEST")):
        raise AgentError("no release %s in %s (removed by `dflash gc`, or never deployed here)"
                         % (release_id, os.path.join(ws.root, "releases")), "not_found")
    return folder


def _manifest_paths(text: str) -> Dict[str, int]:
    """{path: size} of a MANIFEST's lines `sha256  size  mode  path`."""
    paths = {}
    for line in text.splitlines():
        _, size, _, path = line.split("  ", 3)
        paths[path] = int(size)
    return paths


def release_files(ws: Workspace, release_id: str, paths: Sequence[str]) -> ReleaseFilesReply:
    """The release's MANIFEST and the named files' bytes (base64); files above
    INLINE_MAX_BYTES are listed in "too_large" instead. Only paths MANIFEST lists."""
    folder = release_dir(ws, release_id)
    with open(os.path.join(folder, "MANIFEST"), "rb") as fh:
        manifest = fh.read().decode()
    listed = _manifest_paths(manifest)
    files, too_large = {}, []
    for path in paths:
        if path not in listed:
            raise AgentError("%s is not a file of release %s" % (path, release_id), "usage")
        if listed[path] > INLINE_MAX_BYTES:
            too_large.append(path)
            continue
        with open(os.path.join(folder, path), "rb") as fh:
            files[path] = base64.b64encode(fh.read()).decode("ascii")
    return ReleaseFilesReply(release_id=release_id, manifest=manifest, files=files, too_large=tuple(too_large))


def run_config(run: RunDir) -> RunConfigReply:
    """The run's config.yaml as the trainer read it."""
    try:
        with open(run.config, "rb") as fh:
            return RunConfigReply(run_id=run.run_id, config=decode_bytes(fh.read()))
    except FileNotFoundError:
        raise AgentError("run %s has no config.yaml" % run.run_id, "not_found")


def _used_releases(ws: Workspace) -> Dict[str, List[str]]:
    """{release id: [run ids]} of every run recorded in runs/ (started or not ended:
    any run may be diffed, resumed or inspected later)."""
    used: Dict[str, List[str]] = {}
    try:
        names = sorted(os.listdir(ws.runs))
    except FileNotFoundError:
        return used
    for name in names:
        record = read_json(RunDir(name, os.path.join(ws.runs, name)).run_json)
        if isinstance(record, dict) and record.get("release_id"):
            used.setdefault(record["release_id"], []).append(name)
    return used


def _size(folder: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _remove_read_only(folder: str) -> None:
    """Releases are read-only (files 0444/0555, folders 0555): make each folder writable
    again, then remove the tree (root could without; another user cannot)."""
    for dirpath, _, _ in os.walk(folder):
        os.chmod(dirpath, stat.S_IMODE(os.stat(dirpath).st_mode) | stat.S_IWUSR)
    shutil.rmtree(folder)


def gc(ws: Workspace, keep: int) -> GcReply:
    """Remove the releases no recorded run uses, that are not `current`, beyond the
    `keep` newest of them. Refused (kind "conflict") while a deploy holds .deploy.lock;
    the lock is held meanwhile, so no deploy reuses a release being removed."""
    releases = os.path.join(ws.root, "releases")
    lock = os.open(os.path.join(ws.root, ".deploy.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise AgentError("a deploy is installing a release in %s: run gc again when it is done"
                             % ws.root, "conflict")
        used = _used_releases(ws)
        current = os.path.basename(os.path.realpath(ws.current)) if os.path.islink(ws.current) else None
        try:
            names = [n for n in os.listdir(releases) if _RELEASE_ID.match(n)]
        except FileNotFoundError:
            names = []
        kept: List[KeptRelease] = []
        unused = []
        for name in names:
            if name == current:
                kept.append(KeptRelease(release_id=name, reason="current"))
            elif name in used:
                kept.append(KeptRelease(release_id=name, reason="used by run %s" % ", ".join(used[name])))
            else:
                unused.append(name)
        unused.sort(key=lambda n: os.stat(os.path.join(releases, n)).st_mtime, reverse=True)
        kept += [KeptRelease(release_id=name, reason="among the %d newest unused" % keep) for name in unused[:keep]]
        removed = []
        for name in unused[keep:]:
            folder = os.path.join(releases, name)
            size = _size(folder)
            _remove_read_only(folder)
            removed.append(RemovedRelease(release_id=name, bytes=size))
        return GcReply(removed=tuple(removed), kept=tuple(sorted(kept, key=lambda k: k.release_id)),
                       freed_bytes=sum(r.bytes for r in removed))
    finally:
        os.close(lock)
