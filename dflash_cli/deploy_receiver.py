"""The host side of `dflash deploy`. Standard library only.

This file is not imported on the host: the CLI sends its source as `python3 -c SOURCE
VERB WORKSPACE RELEASE_ID`, so deploy works before anything is installed there. It
prints one JSON object on stdout.

probe    If releases/<id> exists (and its MANIFEST hashes to <id>), point `current` at it
         and answer {"status": "unchanged" | "switched"}; otherwise answer
         {"status": "missing", "current": id or null, "current_files": {path: sha256}} so
         the CLI sends only what the current release lacks.
install  Read a tar (gzipped or not) on stdin (MANIFEST + the changed files) into a private
         folder, take unchanged files from the current release (hard links where the mode
         is unchanged, copies where it changed: releases are immutable), verify every
         file's size and sha256 against MANIFEST and that nothing else is there, rename the
         folder to releases/<id>, then switch `current` with one atomic rename. Anything
         that fails before the switch leaves `current` untouched.
"""
import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import time


def _manifest(text):
    files = {}
    for line in text.splitlines():
        sha, size, mode, path = line.split("  ", 3)
        files[path] = (sha, int(size), int(mode, 8))
    return files


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _release_ok(folder, release_id):
    try:
        with open(os.path.join(folder, "MANIFEST"), "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:16] == release_id
    except OSError:
        return False


def _current_id(workspace):
    try:
        return os.path.basename(os.readlink(os.path.join(workspace, "current")))
    except OSError:
        return None


def _switch(workspace, release_id):
    tmp = os.path.join(workspace, ".current.%d" % os.getpid())
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", release_id), tmp)
    os.replace(tmp, os.path.join(workspace, "current"))


def _clean_stale_incoming(releases):
    # Left by deploys that were interrupted over an hour ago; never touches releases.
    for name in os.listdir(releases):
        path = os.path.join(releases, name)
        if name.startswith(".incoming-") and time.time() - os.path.getmtime(path) > 3600:
            shutil.rmtree(path, ignore_errors=True)


def _release_mode(mode):
    return 0o555 if mode & 0o111 else 0o444


def _reuse(source, dest, mode):
    """Take an unchanged file from the current release: a hard link when its mode stays
    the same, else a copy, because a link shares the inode and setting the new mode on
    it would change the older release too."""
    if stat.S_IMODE(os.stat(source).st_mode) == mode:
        try:
            os.link(source, dest)
            return
        except OSError:  # e.g. a filesystem without hard links
            pass
    shutil.copyfile(source, dest)


def probe(workspace, release_id):
    target = os.path.join(workspace, "releases", release_id)
    current = _current_id(workspace)
    if _release_ok(target, release_id):
        if current == release_id:
            return {"status": "unchanged", "release_id": release_id}
        _switch(workspace, release_id)
        return {"status": "switched", "release_id": release_id, "previous": current}
    current_files = {}
    if current:
        try:
            with open(os.path.join(workspace, "current", "MANIFEST")) as fh:
                current_files = {p: v[0] for p, v in _manifest(fh.read()).items()}
        except OSError:
            current = None
    return {"status": "missing", "current": current, "current_files": current_files}


def install(workspace, release_id):
    releases = os.path.join(workspace, "releases")
    os.makedirs(releases, exist_ok=True)
    _clean_stale_incoming(releases)
    incoming = os.path.join(releases, ".incoming-%s-%d" % (release_id, os.getpid()))
    os.makedirs(incoming)
    try:
        received = 0
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|*") as tar:
            for member in tar:
                name = os.path.normpath(member.name)
                if not member.isfile() or name.startswith(("/", "..")):
                    raise ValueError("unexpected tar member %r" % member.name)
                dest = os.path.join(incoming, name)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with tar.extractfile(member) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)
                received += 1
        with open(os.path.join(incoming, "MANIFEST")) as fh:
            manifest_text = fh.read()
        if hashlib.sha256(manifest_text.encode()).hexdigest()[:16] != release_id:
            raise ValueError("MANIFEST does not hash to release id %s" % release_id)
        files = _manifest(manifest_text)
        current = os.path.join(workspace, "current")
        reused = 0
        for path, (_, _, mode) in files.items():
            dest = os.path.join(incoming, path)
            if not os.path.exists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                _reuse(os.path.join(current, path), dest, _release_mode(mode))
                reused += 1
        for path, (sha, size, mode) in files.items():
            dest = os.path.join(incoming, path)
            if os.path.getsize(dest) != size or _sha256(dest) != sha:
                raise ValueError("verification failed for %s" % path)
            os.chmod(dest, _release_mode(mode))
        present = set()
        for dirpath, _, filenames in os.walk(incoming):
            for name in filenames:
                present.add(os.path.relpath(os.path.join(dirpath, name), incoming))
        extra = present - set(files) - {"MANIFEST"}
        if extra:
            raise ValueError("files not in MANIFEST: %s" % sorted(extra)[:5])
        target = os.path.join(releases, release_id)
        try:
            os.rename(incoming, target)
        except OSError:
            # A concurrent deploy of the same tree won; its copy is verified the same way.
            if not _release_ok(target, release_id):
                raise
            shutil.rmtree(incoming)
        previous = _current_id(workspace)
        _switch(workspace, release_id)
        return {"status": "installed", "release_id": release_id, "previous": previous,
                "files_received": received - 1, "files_reused": reused}
    except BaseException:
        if os.path.isdir(incoming):
            shutil.rmtree(incoming, ignore_errors=True)
        raise


def main(argv):
    verb, workspace, release_id = argv
    workspace = os.path.expanduser(workspace)
    os.makedirs(workspace, exist_ok=True)
    try:
        result = {"probe": probe, "install": install}[verb](workspace, release_id)
    except Exception as exc:  # reported to the CLI as data, with the exact cause
        print(json.dumps({"status": "error", "error": "%s: %s" % (type(exc).__name__, exc),
                          "errno": getattr(exc, "errno", None)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
