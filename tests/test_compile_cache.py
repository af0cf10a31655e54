"""The host's persistent compile cache: where it is and what keys it."""
from __future__ import annotations

import hashlib
import json
import os

from dflash_train.compiling.cache import compile_key_facts, use_compile_cache


def test_compile_cache_lives_under_the_workspace_keyed_by_gpu_and_toolchain(tmp_path, monkeypatch):
    workspace = tmp_path / "ws"
    monkeypatch.setenv("DFLASH_WORKSPACE", str(workspace))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    facts = compile_key_facts("cpu")
    assert facts["gpu"] == "cpu" and set(facts) == {"gpu", "torch", "triton", "cuda", "python"}
    folder = use_compile_cache(tmp_path / "run", facts)
    assert folder.parent == workspace / "cache" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert json.loads((folder / "key.json").read_text()) == facts
    # another GPU model or toolchain is another folder: its compiled code is never loaded here
    for name, other in (("gpu", "NVIDIA H200"), ("torch", "0.0.1"), ("triton", "0.0.1"), ("cuda", "0.1")):
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
        assert use_compile_cache(tmp_path / "run", {**facts, name: other}) != folder


def test_artifacts_that_match_their_manifest_but_torch_cannot_read_are_moved_aside(tmp_path, monkeypatch):
    from dflash_files.compile_key import ARTIFACTS_FILE, ARTIFACTS_MANIFEST
    from dflash_train.compiling.cache import CORRUPT, load_artifacts

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    facts = compile_key_facts("cpu")
    garbage = b"\x80\x04 not a pickle of cache artifacts"
    (tmp_path / ARTIFACTS_FILE).write_bytes(garbage)
    (tmp_path / ARTIFACTS_MANIFEST).write_text(json.dumps(
        {"facts": facts, "size": len(garbage), "sha256": hashlib.sha256(garbage).hexdigest()}))
    status, message = load_artifacts(tmp_path, facts)
    assert status == CORRUPT and "torch could not load them" in message and "compiling as if cold" in message
    assert not (tmp_path / ARTIFACTS_FILE).exists()
    assert (tmp_path / f"{ARTIFACTS_FILE}.corrupt").read_bytes() == garbage
