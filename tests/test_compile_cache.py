"""The host's persistent compile cache: where it is and what keys it."""
from __future__ import annotations

import json
import os

from dflash_train.compile_cache import compile_key_facts, use_compile_cache


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
