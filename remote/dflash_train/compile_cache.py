"""The persistent compile cache of a host: `<workspace>/cache/compile/<key>/`, outside
releases/, so a relaunch (a new release included) finds Inductor's and Triton's compiled
kernels of earlier runs instead of compiling again.

`<key>` names what compiled code depends on: the GPU model, torch, Triton, CUDA and Python
versions, as a readable slug plus the first 16 hex of the sha256 of their JSON; key.json
beside the caches holds those facts. A change of any of them is another folder, so code
compiled for another GPU or toolchain is never loaded.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import tempfile
from pathlib import Path

import torch

from .runlog import say
from .tiny import cache_root

KEY_FILE = "key.json"


def compile_key_facts(device: str) -> dict[str, str]:
    """What compiled code depends on, for `device` ("cpu" or "cuda:N")."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton, "cuda": torch.version.cuda or "none",
            "python": platform.python_version()}


def compile_key(facts: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{facts['gpu']}-torch{facts['torch']}").strip("-")
    return f"{slug}-{digest}"


def use_compile_cache(run_dir: Path, facts: dict[str, str]) -> Path:
    """Point Inductor and Triton at this key's folder (before anything compiles); its path.
    Always set: importing torch's compiler already sets TORCHINDUCTOR_CACHE_DIR to its
    default under /tmp, so an inherited value cannot be told from that one."""
    folder = cache_root(run_dir) / "compile" / compile_key(facts)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / KEY_FILE).exists():
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{KEY_FILE}-")
        with os.fdopen(fd, "w") as f:
            json.dump(facts, f, sort_keys=True)
        os.replace(tmp, folder / KEY_FILE)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    warm = any((folder / "inductor").glob("*")) if (folder / "inductor").exists() else False
    say(f"compile cache: {folder} ({'warm' if warm else 'cold'})")
    return folder
