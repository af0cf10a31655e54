"""The host side of `dflash deploy`. Standard library only.

This file is not imported on the host: the CLI sends its source as `python3 -S -c SOURCE
VERB WORKSPACE RELEASE_ID [ARG] [SWITCH]`, so deploy works before anything is installed
there. It prints one JSON object on stdout.

A release folder is never written after it is installed: its files are 0444 (0555 if
executable), its folders 0555, and INSTALLED (written before the folder is renamed
into releases/) records every file's size, mtime and ctime as installed, so that a
later edit is seen without hashing (`check`; `verify` re-hashes instead).

probe    ARG: "cheap" or "verify". RELEASE_ID "-": the id is the first line of stdin
         (the CLI starts the probe before it has hashed the tree); stdin ending without
         one answers {"status": "abandoned"}, nothing looked at or changed. If
         releases/<id> exists, its MANIFEST hashes to <id> and its files pass the check,
         point `current` at it and answer {"status": "unchanged" | "switched"};
         otherwise answer {"status": "missing", "current": id or null, "current_files":
         {path: sha256} (only files of the current release that pass the check),
         "modified": [problems of releases/<id>, if it exists]} so the CLI sends only
         what the host lacks an intact copy of.
install  ARG: the byte length of the payload. Installs take turns (.deploy.lock in the
         workspace) and first remove what killed ones left. Read a tar (gzipped or not) on stdin
         (MANIFEST + the changed files) into a private folder; a stream shorter than
         ARG (the CLI was interrupted, the connection dropped) is discarded. Copy the
         other files from the current release (copies, never hard links: releases share
         no inode, so an edit of one cannot reach another), verify every file's size and
         sha256 against MANIFEST and that nothing else is there, make it read-only,
         rename it to releases/<id>, then switch `current` with one atomic rename. A
         modified releases/<id> is swapped for the new copy (one atomic exchange where
         the filesystem can) and kept as releases/.modified-<id>-<time>. Anything that
         fails before the switch leaves `current` untouched. Answers {"status":
         "installed" | "repaired", ...}.
check    ARG: "cheap" or "verify". The current release's problems, read-only:
         {"current": id or null, "modified": [...]}.

SWITCH, for probe and install: "switch" (the default) points `current` at the release
as said above; "keep" leaves `current` as it is (`dflash launch`, whose run's start
makes its release current): probe answers {"status": "present"} for an intact release
that is not current, install installs without the switch.
"""
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import time

INSTALLED = "INSTALLED"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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


def _read_manifest(folder, release_id):
    """MANIFEST of `folder` parsed, or None unless it hashes to `release_id`."""
    try:
        with open(os.path.join(folder, "MANIFEST"), "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest()[:16] != release_id:
        return None
    return _manifest(data.decode())


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


def _remove_tree(path):
    """shutil.rmtree that also works on a read-only release for a user who is not root."""
    def writable_again(function, failed, _exc):
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IMODE(os.stat(parent).st_mode) | stat.S_IWUSR)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IMODE(os.stat(failed).st_mode) | stat.S_IWUSR)
        function(failed)
    shutil.rmtree(path, onerror=writable_again)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def _clean_stale_incoming(releases):
    """Remove what killed deploys left: .incoming-<id>-<pid> of a process that is gone,
    or older than an hour (the pid may have been reused). Never touches releases."""
    for name in os.listdir(releases):
        path = os.path.join(releases, name)
        if not name.startswith(".incoming-"):
            continue
        pid = name.rsplit("-", 1)[-1]
        if (pid.isdigit() and not _pid_alive(int(pid))) or time.time() - os.path.getmtime(path) > 3600:
            _remove_tree(path)


def _release_mode(mode):
    return 0o555 if mode & 0o111 else 0o444


def _stamp(st):
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _installed_stamps(folder):
    """INSTALLED's record {path: [size, mtime_ns, ctime_ns]} of `folder`, or None without a
    readable one."""
    try:
        with open(os.path.join(folder, INSTALLED), "rb") as fh:
            return json.loads(fh.read().decode())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _problems(folder, release_id, files, verify):
    """What differs in `folder` (release `release_id`) from its MANIFEST `files`: ["path:
    why", ...], sorted. Cheap by default: size, mtime and ctime against INSTALLED (a file
    edited, even with its mtime put back, has a new ctime); a release without INSTALLED, or
    `verify`, re-hashes every file."""
    problems, found = [], {}
    for path, (sha, size, mode) in files.items():
        try:
            st = os.lstat(os.path.join(folder, path))
        except OSError:
            problems.append("%s: missing" % path)
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append("%s: not a regular file" % path)
        elif stat.S_IMODE(st.st_mode) != _release_mode(mode):
            problems.append("%s: mode %o" % (path, stat.S_IMODE(st.st_mode)))
        else:
            found[path] = _stamp(st)
    installed = None if verify else _installed_stamps(folder)
    for path, stamp in found.items():
        sha, size, _ = files[path]
        if installed is not None:
            if installed.get(path) != stamp:
                problems.append("%s: changed since install" % path)
        elif stamp[0] != size or _sha256(os.path.join(folder, path)) != sha:
            problems.append("%s: content differs from MANIFEST" % path)
    expected = set(files) | {"MANIFEST", INSTALLED}
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = os.path.relpath(os.path.join(dirpath, name), folder)
            if path not in expected:  # e.g. __pycache__/*.pyc: Python would load it
                problems.append("%s: not in MANIFEST" % path)
    return sorted(problems)


def _intact_files(folder, release_id, verify):
    """{path: sha256} of the files of `folder` that pass the check."""
    files = _read_manifest(folder, release_id)
    if files is None:
        return {}
    bad = {problem.split(": ", 1)[0] for problem in _problems(folder, release_id, files, verify)}
    return {path: value[0] for path, value in files.items() if path not in bad}


def _deploy_lock(workspace):
    """Serializes the installs into one workspace."""
    fd = os.open(os.path.join(workspace, ".deploy.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _exchange(a, b):
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); False where the kernel,
    libc or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return renameat2(_AT_FDCWD, a.encode(), _AT_FDCWD, b.encode(), _RENAME_EXCHANGE) == 0


def _put_in_place(incoming, target, release_id):
    """Rename the verified `incoming` to `target`; returns where a modified copy that was
    there went, or None. A modified copy is kept aside, not deleted: runs that started
    from it may still have it open; at the path they resolved, they find the new copy."""
    try:
        os.rename(incoming, target)
        return None
    except OSError:
        if not os.path.isdir(target):
            raise
    # in nanoseconds: a second repair within the same second must not meet the first one's copy
    aside = os.path.join(os.path.dirname(target), ".modified-%s-%d" % (release_id, time.time_ns()))
    if _exchange(incoming, target):
        os.rename(incoming, aside)
    else:
        os.rename(target, aside)
        os.rename(incoming, target)
    return aside


class _CountingReader(object):
    """stdin, counting the bytes read from it."""

    def __init__(self, raw):
        self.raw, self.count = raw, 0

    def read(self, size=-1):
        data = self.raw.read(size)
        self.count += len(data)
        return data


def _receive(incoming, expected_bytes):
    """Unpack the tar on stdin into `incoming`; the number of files received. Raises
    unless exactly `expected_bytes` arrived."""
    stdin = _CountingReader(sys.stdin.buffer)
    received = 0
    with tarfile.open(fileobj=stdin, mode="r|*") as tar:
        for member in tar:
            name = os.path.normpath(member.name)
            if not member.isfile() or name.startswith(("/", "..")):
                raise ValueError("unexpected tar member %r" % member.name)
            dest = os.path.join(incoming, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with tar.extractfile(member) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            received += 1
    while stdin.read(1 << 16):  # the tar's end may come before the stream's
        pass
    if stdin.count != expected_bytes:
        # A tar cut at a member boundary reads as a complete, shorter one.
        raise ValueError("received %d of %d bytes: upload cut short" % (stdin.count, expected_bytes))
    return received


def _check_id(release_id):
    if len(release_id) != 16 or release_id.strip("0123456789abcdef"):
        raise ValueError("a release id is 16 hex digits, not %r" % release_id[:40])


def _switching(switch):
    if switch not in ("switch", "keep"):
        raise ValueError("SWITCH is switch or keep, not %r" % switch)
    return switch == "switch"


def probe(workspace, release_id, mode, switch="switch"):
    if release_id == "-":
        release_id = sys.stdin.readline().strip()
        if not release_id:
            return {"status": "abandoned"}
    _check_id(release_id)
    verify = mode == "verify"
    target = os.path.join(workspace, "releases", release_id)
    current = _current_id(workspace)
    files = _read_manifest(target, release_id)
    modified = _problems(target, release_id, files, verify) if files is not None else []
    if files is not None and not modified:
        if current == release_id:
            return {"status": "unchanged", "release_id": release_id}
        if not _switching(switch):
            return {"status": "present", "release_id": release_id, "current": current}
        _switch(workspace, release_id)
        return {"status": "switched", "release_id": release_id, "previous": current}
    current_files = _intact_files(os.path.join(workspace, "current"), current, verify) if current else {}
    return {"status": "missing", "current": current, "current_files": current_files,
            "modified": modified}


def check(workspace, mode):
    current = _current_id(workspace)
    if current is None:
        return {"current": None, "modified": []}
    folder = os.path.join(workspace, "releases", current)
    files = _read_manifest(folder, current)
    if files is None:
        return {"current": current, "modified": ["MANIFEST: missing or does not hash to %s" % current]}
    return {"current": current, "modified": _problems(folder, current, files, mode == "verify")}


def install(workspace, release_id, expected_bytes, switch="switch"):
    _check_id(release_id)
    switching = _switching(switch)
    releases = os.path.join(workspace, "releases")
    os.makedirs(releases, exist_ok=True)
    lock = _deploy_lock(workspace)
    _clean_stale_incoming(releases)
    incoming = os.path.join(releases, ".incoming-%s-%d" % (release_id, os.getpid()))
    os.makedirs(incoming)
    try:
        received = _receive(incoming, int(expected_bytes))
        with open(os.path.join(incoming, "MANIFEST")) as fh:
            manifest_text = fh.read()
        if hashlib.sha256(manifest_text.encode()).hexdigest()[:16] != release_id:
            raise ValueError("MANIFEST does not hash to release id %s" % release_id)
        files = _manifest(manifest_text)
        current_id = _current_id(workspace)
        reused = 0
        for path in files:
            dest = os.path.join(incoming, path)
            if not os.path.exists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copyfile(os.path.join(workspace, "current", path), dest)
                reused += 1
        for path, (sha, size, mode) in files.items():
            dest = os.path.join(incoming, path)
            if os.path.getsize(dest) != size or _sha256(dest) != sha:
                source = "sent" if reused == 0 else "sent or copied from release %s" % current_id
                raise ValueError("verification failed for %s (%s; `dflash deploy --verify` "
                                 "re-hashes the host's releases)" % (path, source))
            os.chmod(dest, _release_mode(mode))
        present = set()
        for dirpath, _, filenames in os.walk(incoming):
            for name in filenames:
                present.add(os.path.relpath(os.path.join(dirpath, name), incoming))
        extra = present - set(files) - {"MANIFEST"}
        if extra:
            raise ValueError("files not in MANIFEST: %s" % sorted(extra)[:5])
        os.chmod(os.path.join(incoming, "MANIFEST"), 0o444)
        stamps = {path: _stamp(os.stat(os.path.join(incoming, path))) for path in files}
        with open(os.path.join(incoming, INSTALLED), "w") as fh:
            json.dump({"release_id": release_id, "files": stamps}, fh, sort_keys=True)
        os.chmod(os.path.join(incoming, INSTALLED), 0o444)
        for dirpath, _, _ in os.walk(incoming, topdown=False):
            os.chmod(dirpath, 0o555)
        target = os.path.join(releases, release_id)
        existing = _read_manifest(target, release_id)
        # Re-hashed: the probe found this copy modified, perhaps only by hashing (--verify);
        # intact, it was installed meanwhile by a concurrent deploy of the same tree.
        if existing is not None and not _problems(target, release_id, existing, verify=True):
            _remove_tree(incoming)
            aside = None
        else:
            aside = _put_in_place(incoming, target, release_id)
        previous = _current_id(workspace)
        if switching:
            _switch(workspace, release_id)
        result = {"status": "repaired" if aside else "installed", "release_id": release_id,
                  "previous": previous, "files_received": received - 1, "files_reused": reused}
        if aside:
            result["set_aside"] = aside
        return result
    except BaseException:
        if os.path.isdir(incoming):
            _remove_tree(incoming)
        raise
    finally:
        os.close(lock)


def main(argv):
    verb, workspace, arg = argv[0], argv[1], argv[2:]
    workspace = os.path.expanduser(workspace)
    try:
        result = {"probe": probe, "install": install, "check": check}[verb](workspace, *arg)
    except Exception as exc:  # reported to the CLI as data, with the exact cause
        print(json.dumps({"status": "error", "error": "%s: %s" % (type(exc).__name__, exc),
                          "errno": getattr(exc, "errno", None)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
