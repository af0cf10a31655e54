"""The `compile-artifacts`, `send-compile-artifacts` and `receive-compile-artifacts` verbs:
a host's portable compile artifacts (docs/layout.md, cache/compile/<key>/), listed
and moved to another host of the same GPU model and toolchain, so it starts warm.

The trainer (dflash_train/compiling/cache.py) writes artifacts.bin and then artifacts.json
into the key folder; the folder names, the file names and the key rule are
dflash_files.compile_key's, which both take.

`send-compile-artifacts --key K --sha256 S` writes key K's artifacts.bin raw on stdout,
nothing else; refused before any byte, the error reply the one line on stderr: kind
"not_found" when K has no listed artifacts, "conflict" when their manifest names other
bytes than S (list again). `receive-compile-artifacts` writes the bytes to a temp file in
the key folder, fsyncs it, checks it, renames it to artifacts.bin, then writes the
manifest atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from dflash_contract.replies import CompileArtifact, ReceiveCompileArtifactsReply
from dflash_files.atomic import write_json_atomic
from dflash_files.compile_key import (ARTIFACTS_FILE, ARTIFACTS_MANIFEST, CACHE_DIR, COMPILE_DIR, FACT_NAMES, KEY_FILE,
                                      compile_key)

from .jsonio import AgentError

CHUNK = 1 << 20
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")


def cpu_model() -> Optional[str]:
    """/proc/cpuinfo's first `model name` (CPU artifacts hold code for one instruction set)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _folder(root: str, key: str) -> str:
    if not _KEY.match(key):
        raise AgentError("bad compile cache key %r" % key, "usage")
    return os.path.join(root, CACHE_DIR, COMPILE_DIR, key)


def _manifest(folder: str) -> Optional[Dict[str, Any]]:
    """The key folder's manifest when it describes an artifacts file of its size, else None."""
    try:
        with open(os.path.join(folder, ARTIFACTS_MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
        size = os.stat(os.path.join(folder, ARTIFACTS_FILE)).st_size
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("size") != size:
        return None
    return manifest


def list_artifacts(root: str) -> Tuple[CompileArtifact, ...]:
    """The key folders holding artifacts whose manifest matches their size (sha256 as the
    manifest says; a receiver checks the bytes), sorted by key."""
    found: List[CompileArtifact] = []
    base = os.path.join(root, CACHE_DIR, COMPILE_DIR)
    for key in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        manifest = _manifest(os.path.join(base, key)) if _KEY.match(key) else None
        if manifest is not None:
            found.append(CompileArtifact(key=key, facts=manifest.get("facts"), size=manifest["size"],
                                         sha256=manifest.get("sha256"), torch=manifest.get("torch"),
                                         saved_at=manifest.get("saved_at")))
    return tuple(found)


def send_artifacts(root: str, key: str, sha256: str) -> None:
    """The artifacts file's raw bytes on stdout; refused (AgentError, nothing written) when
    the key has none or its manifest names other bytes than `sha256` (replaced since the
    listing: list again)."""
    folder = _folder(root, key)
    manifest = _manifest(folder)
    if manifest is None:
        raise AgentError("no compile artifacts for %s" % key, "not_found")
    if manifest.get("sha256") != sha256:
        raise AgentError("the compile artifacts of %s changed since they were listed" % key, "conflict")
    out = sys.stdout.buffer
    with open(os.path.join(folder, ARTIFACTS_FILE), "rb") as handle:
        while True:
            chunk = handle.read(CHUNK)
            if not chunk:
                break
            out.write(chunk)
    out.flush()


def receive_artifacts(root: str, key: str, manifest: Dict[str, Any]) -> ReceiveCompileArtifactsReply:
    """Store the artifacts arriving on stdin in key folder `key`, all or nothing: refused
    (kind "usage") when the manifest's facts do not make `key` or the bytes are not its
    size and sha256; kind "conflict" when the folder's key.json holds other facts."""
    facts = manifest.get("facts")
    if not isinstance(facts, dict) or set(facts) != set(FACT_NAMES) or compile_key(facts) != key:
        raise AgentError("the manifest's facts %r do not make compile cache key %s" % (facts, key), "usage")
    folder = _folder(root, key)
    os.makedirs(folder, exist_ok=True)
    key_file = os.path.join(folder, KEY_FILE)
    if os.path.exists(key_file):
        with open(key_file, encoding="utf-8") as handle:
            if json.load(handle) != facts:
                raise AgentError("%s holds other facts than the artifacts' manifest" % key_file, "conflict")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + ARTIFACTS_FILE + "-")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as handle:
            while True:
                chunk = sys.stdin.buffer.read(CHUNK)
                if not chunk:
                    break
                digest.update(chunk)
                size += len(chunk)
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        if size != manifest.get("size") or digest.hexdigest() != manifest.get("sha256"):
            raise AgentError("received %d bytes of sha256 %s for %s, the manifest says %s bytes of %s" % (
                size, digest.hexdigest(), key, manifest.get("size"), manifest.get("sha256")), "usage")
        if not os.path.exists(key_file):
            write_json_atomic(key_file, facts)
        os.replace(tmp, os.path.join(folder, ARTIFACTS_FILE))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # The manifest last: until it names the new bytes, a trainer finds a mismatch and compiles.
    write_json_atomic(os.path.join(folder, ARTIFACTS_MANIFEST), manifest)
    return ReceiveCompileArtifactsReply(key=key, size=size, sha256=digest.hexdigest(), received=True)
