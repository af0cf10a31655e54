"""Where a host's compile cache lives and what its key folders hold (docs/layout.md,
cache/compile/<key>/): the trainer (dflash_train/compiling/cache.py) compiles into a key
folder and saves its portable artifacts there; the agent (dflash_agent/
compile_artifacts.py) lists them, sends them, and checks what it receives by the same rule.

<key> is `compile_key(facts)`; key.json holds the facts, artifacts.bin the artifacts and
artifacts.json {facts, size, sha256, torch, saved_at} describes them.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Dict

CACHE_DIR = "cache"  # the trainer's caches, in the workspace (or the run directory of a run without one)
COMPILE_DIR = "compile"  # the key folders, in CACHE_DIR
KEY_FILE = "key.json"
ARTIFACTS_FILE = "artifacts.bin"
ARTIFACTS_MANIFEST = "artifacts.json"
FACT_NAMES = ("gpu", "torch", "triton", "cuda", "python")  # what compiled code depends on


def compile_key(facts: Dict[str, str]) -> str:
    """The key folder's name: a readable slug of GPU model and torch version + the first 16
    hex of the sha256 of the facts' JSON (sorted keys)."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", "%s-torch%s" % (facts["gpu"], facts["torch"])).strip("-")
    return "%s-%s" % (slug, digest)
