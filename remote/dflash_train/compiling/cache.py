"""The persistent compile cache of a host: `<workspace>/cache/compile/<key>/`, outside
releases/, so a relaunch (a new release included) finds Inductor's and Triton's compiled
kernels of earlier runs instead of compiling again.

`<key>` names what compiled code depends on: the GPU model, torch, Triton, CUDA and Python
versions, as a readable slug plus the first 16 hex of the sha256 of their JSON; key.json
beside the caches holds those facts. A change of any of them is another folder, so code
compiled for another GPU or toolchain is never loaded.

Portable artifacts: after a run's first compile (its first drafter's train step built),
PyTorch's cache artifacts (`torch.compiler.save_cache_artifacts`: every Inductor/Triton
entry the process compiled or loaded, as one blob) go to artifacts.bin in the key folder,
with artifacts.json {facts, size, sha256, torch, saved_at} beside it, once per key folder
(by the first run that finds none valid). Where the key folder holds the train step's
precompiled graphs (precompiled.py: train_step/<16 hex>.aot and .json), artifacts.bin
bundles them with torch's blob (`bundle`), so the host that receives it loads the step
without a trace too: torch's ahead-of-time compile does not read Inductor's caches. A run
whose key folder is cold loads them before anything compiles; another host of the same
facts receives them from the agent (`dflash cache copy`, or `dflash launch` seeding the
hosts of a run), so it starts warm. Before
loading: the manifest's facts must equal this process's and the file its size and sha256;
a file that fails (truncated, corrupt, another toolchain's) is moved aside
(`artifacts.bin.corrupt` / `.mismatch`), said in the log and the `compile cache` start-up
event, and the run compiles as if cold: a bad file never fails a run.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import tempfile
import threading
import time
from pathlib import Path

import torch

from dflash_files.atomic import write_atomic
from dflash_files.compile_key import ARTIFACTS_FILE, ARTIFACTS_MANIFEST, COMPILE_DIR, KEY_FILE, compile_key

from ..config import cache_root
from .precompiled import PRECOMPILED_DIR
from ..runlog import say
from ..startup_phases import phase

# What artifacts_status says, and which of them leave the key folder without valid artifacts
# (then the run saves its own after its first compile).
LOADED, PRESENT, ABSENT, CORRUPT, MISMATCH, UNSUPPORTED = "loaded", "present", "absent", "corrupt", "mismatch", "unsupported"
NEEDS_SAVE = (ABSENT, CORRUPT, MISMATCH)


def compile_key_facts(device: str) -> dict[str, str]:
    """What compiled code depends on, for `device` ("cpu" or "cuda:N")."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton, "cuda": torch.version.cuda or "none",
            "python": platform.python_version()}


def use_compile_cache(run_dir: Path, facts: dict[str, str]) -> Path:
    """Point Inductor and Triton at this key's folder (before anything compiles); its path.
    Always set: importing torch's compiler already sets TORCHINDUCTOR_CACHE_DIR to its
    default under /tmp, so an inherited value cannot be told from that one."""
    folder = cache_root(run_dir) / COMPILE_DIR / compile_key(facts)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / KEY_FILE).exists():
        write_atomic(str(folder / KEY_FILE), json.dumps(facts, sort_keys=True).encode())
    reached = without_whitespace(folder)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(reached / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(reached / "triton")
    say(f"compile cache: {folder} ({'warm' if is_warm(folder) else 'cold'})"
        + (f" through {reached}" if reached != folder else ""))
    return folder


def without_whitespace(folder: Path) -> Path:
    """`folder`, or where a path holding whitespace is reached without: Inductor's C++
    compile command does not quote its paths (g++ then reads one path as several), so such
    a folder is reached through a symlink in the temp folder named after it, made with a
    rename (runs may make it at once)."""
    if not any(c.isspace() for c in str(folder)):
        return folder
    link = Path(tempfile.gettempdir()) / f"dflash-compile-{hashlib.sha256(str(folder).encode()).hexdigest()[:16]}"
    if not (link.is_symlink() and os.readlink(link) == str(folder)):
        tmp = link.with_name(f"{link.name}.{os.getpid()}.{threading.get_ident()}")
        os.symlink(folder, tmp)
        os.replace(tmp, link)
    return link


def is_warm(folder: Path) -> bool:
    """Inductor's cache in `folder` holds entries (of an earlier compile or loaded artifacts)."""
    return (folder / "inductor").is_dir() and any((folder / "inductor").iterdir())


def load_artifacts(folder: Path, facts: dict[str, str]) -> tuple[str, str]:
    """Load the key folder's portable artifacts into its (cold) caches, before anything
    compiles: (status, what happened in words). Never raises for a bad file: it is moved
    aside and the run compiles as if cold."""
    path = folder / ARTIFACTS_FILE
    if not hasattr(torch.compiler, "load_cache_artifacts"):
        return UNSUPPORTED, f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts"
    if not path.exists():
        return ABSENT, "no compile artifacts"
    try:
        manifest = json.loads((folder / ARTIFACTS_MANIFEST).read_text())
        if not isinstance(manifest, dict):
            raise ValueError(f"{ARTIFACTS_MANIFEST} is not a JSON object")
    except (OSError, ValueError) as exc:
        return _set_aside(path, CORRUPT, f"its manifest is unreadable ({exc})")
    if manifest.get("facts") != facts:
        return _set_aside(path, MISMATCH, f"made for {manifest.get('facts')}, this process is {facts}")
    data = path.read_bytes()
    if len(data) != manifest.get("size") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        return _set_aside(path, CORRUPT, f"{len(data)} bytes of sha256 {hashlib.sha256(data).hexdigest()[:16]}, "
                                         f"its manifest says {manifest.get('size')} of {str(manifest.get('sha256'))[:16]}")
    try:
        blob, files = unbundle(data)
    except ValueError as exc:
        return _set_aside(path, CORRUPT, str(exc))
    if blob:
        try:
            # None: torch could not unpickle them (it logs a warning and loads nothing)
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as exc:  # noqa: BLE001 - whatever torch makes of a bad blob, the run compiles instead
            return _set_aside(path, CORRUPT, f"torch could not load them ({type(exc).__name__}: {exc})")
        if info is None:
            return _set_aside(path, CORRUPT, "torch could not load them (not cache artifacts of this torch)")
    for name, content in files.items():  # a graph of the step this host already has stays
        if not (folder / name).exists():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(str(folder / name), content)
    step = f", {len(files)} file(s) of the precompiled train step" if files else ""
    return LOADED, f"compile artifacts loaded ({len(data):,} bytes{step})"


# artifacts.bin holding precompiled graphs too: this line, then a JSON line {"torch": size of
# torch's blob, "files": [[name in the key folder, size], ...]}, then torch's blob, then
# each file's bytes in that order. Any other artifacts.bin is torch's blob alone.
_BUNDLE_MAGIC = b"dflash compile artifacts 1\n"
_BUNDLED_NAME = re.compile(rf"^{PRECOMPILED_DIR}/[0-9a-f]{{16}}\.(aot|json)$")


def bundle(blob: bytes, folder: Path) -> bytes:
    """What artifacts.bin holds: torch's `blob`, with the key folder's precompiled train-step
    files when it has any (each .aot with its manifest; a .aot without one is not whole)."""
    names = [f"{PRECOMPILED_DIR}/{aot.name}" for aot in sorted((folder / PRECOMPILED_DIR).glob("*.aot"))
             if aot.with_suffix(".json").exists()]
    names = [n for name in names for n in (name, name[:-len(".aot")] + ".json")]
    if not names:
        return blob
    contents = [(folder / name).read_bytes() for name in names]
    header = {"torch": len(blob), "files": [[name, len(content)] for name, content in zip(names, contents)]}
    return b"".join([_BUNDLE_MAGIC, json.dumps(header).encode() + b"\n", blob, *contents])


def unbundle(data: bytes) -> tuple[bytes, dict[str, bytes]]:
    """(torch's blob, {name in the key folder: bytes}) of an artifacts.bin; ValueError
    naming what is wrong with a bundle that is not whole."""
    if not data.startswith(_BUNDLE_MAGIC):
        return data, {}
    header_end = data.find(b"\n", len(_BUNDLE_MAGIC))
    if header_end < 0:
        raise ValueError("its bundle ends inside its header")
    try:
        header = json.loads(data[len(_BUNDLE_MAGIC):header_end])
        sizes = [int(header["torch"])] + [int(size) for _, size in header["files"]]
        names = [str(name) for name, _ in header["files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"its bundle header is unreadable ({exc})") from exc
    bad = [name for name in names if not _BUNDLED_NAME.match(name)]
    if bad:
        raise ValueError(f"its bundle names files outside the precompiled train step: {', '.join(bad)}")
    body = data[header_end + 1:]
    if len(body) != sum(sizes):
        raise ValueError(f"its bundle holds {len(body)} bytes after the header, which names {sum(sizes)}")
    parts, offset = [], 0
    for size in sizes:
        parts.append(body[offset:offset + size])
        offset += size
    return parts[0], dict(zip(names, parts[1:]))


def _set_aside(path: Path, status: str, why: str) -> tuple[str, str]:
    aside = path.with_name(f"{path.name}.{status}")
    os.replace(path, aside)
    message = f"compile artifacts {path} not loaded: {why}; moved to {aside.name}, compiling as if cold"
    say(message)
    return status, message


def save_artifacts(folder: Path, facts: dict[str, str]) -> int | None:
    """Save what this process compiled, with the key folder's precompiled train step
    (`bundle`), as the key folder's portable artifacts; their size, or None when there is
    nothing (or no API) to save. Raises OSError when the write fails (no space, say): the
    caller logs it, the run goes on."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return None
    saved = torch.compiler.save_cache_artifacts()
    data = bundle(saved[0] if saved is not None else b"", folder)
    if not data:
        return None
    write_atomic(str(folder / ARTIFACTS_FILE), data)
    # The manifest last: until it names these bytes a reader finds a mismatch and compiles.
    manifest = {"facts": facts, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "torch": torch.__version__, "saved_at": time.time()}
    write_atomic(str(folder / ARTIFACTS_MANIFEST), json.dumps(manifest, sort_keys=True).encode())
    return len(data)


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """The key folder a run compiles into, and what it found there at start."""
    folder: Path
    facts: dict[str, str]
    warm: bool  # entries were there, or the artifacts were loaded
    artifacts: str  # LOADED, PRESENT, ABSENT, CORRUPT, MISMATCH or UNSUPPORTED


def open_compile_cache(run_dir: Path, facts: dict[str, str]) -> CompileCache:
    """The `compile cache` start-up phase: point the compiler at the key folder and, when
    its caches are cold, load the folder's artifacts."""
    with phase("compile cache") as detail:
        folder = use_compile_cache(run_dir, facts)
        warm = is_warm(folder)
        if warm:  # nothing to load: the entries are there already
            status = PRESENT if (folder / ARTIFACTS_FILE).exists() else ABSENT
            message = f"warm; artifacts {status}"
        else:
            status, message = load_artifacts(folder, facts)
            if status == LOADED:
                say(f"compile cache: {message}")
        detail.update(key=folder.name, folder=str(folder), cache="warm" if warm else "cold", artifacts=status,
                      message=message)
    return CompileCache(folder, facts, warm or status == LOADED, status)


def save_after_first_compile(cache: CompileCache) -> None:
    """Once the first train step is built: save the artifacts when the key folder has no
    valid ones. A failed write (disk full) is said and recorded; the run goes on."""
    if cache.artifacts not in NEEDS_SAVE:
        return
    with phase("save compile artifacts", key=cache.folder.name) as detail:
        try:
            size = save_artifacts(cache.folder, cache.facts)
        except OSError as exc:
            say(f"compile artifacts not saved to {cache.folder}: {exc}")
            detail["error"] = str(exc)
        else:
            detail["bytes"] = size
            if size is not None:
                say(f"compile artifacts saved: {cache.folder / ARTIFACTS_FILE} ({size:,} bytes)")
