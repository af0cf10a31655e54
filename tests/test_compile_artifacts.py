"""Start-up as progress and compile artifacts shared between hosts, on the test bed (ct200 +
ct202 behind the fake pct, each its own filesystem): one real CPU compile (`compile:
default`) whose start-up phases `watch` shows, which falls back from a truncated artifacts
file and saves fresh ones; those bytes then go to the other host (`dflash cache copy`, and a
run on both hosts seeding the one that lacks them) and are loaded, or refused when their
manifest names another toolchain."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dflash_files.compile_key import ARTIFACTS_FILE, ARTIFACTS_MANIFEST, compile_key
from dflash_train.compiling.cache import CORRUPT, LOADED, MISMATCH, compile_key_facts, load_artifacts
from support.train_configs import small_config
from test_multihost import Pair, pair_config

pytestmark = pytest.mark.timeout(1200)

PHASES = ["import", "find sources", "build data", "load target", "drafter weights", "plan shapes", "compile cache",
          "set up", "build train step", "save compile artifacts"]


@pytest.fixture
def pair(make_inventory, ssh_node, fake_pve, tmp_path):
    pair = Pair(make_inventory, ssh_node, fake_pve, tmp_path)
    yield pair
    # The containers' workspace path holds a space, so the trainers reached its compile cache
    # through links in the temp folder (compiling.cache.without_whitespace): this test's go.
    for link in Path(tempfile.gettempdir()).glob("dflash-compile-*"):
        if link.is_symlink() and os.readlink(link).startswith(f"{pair.workspace}/"):
            link.unlink()


def plant(folder: Path, data: bytes, manifest: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ARTIFACTS_FILE).write_bytes(data)
    (folder / ARTIFACTS_MANIFEST).write_text(json.dumps(manifest))


def startup_events(path: Path) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["type"] == "startup"]


@pytest.mark.slow(seconds=122, why="compiles the train step with Inductor on CPU, then a run on two hosts")
def test_start_up_phases_corrupt_fallback_and_artifacts_copied_to_another_host(pair, tmp_path, monkeypatch):
    facts = compile_key_facts("cpu")
    key = compile_key(facts)
    on_ct200, on_ct202 = (pair.on_node(vmid, f"cache/compile/{key}") for vmid in (200, 202))
    # A file cut short (as by a full disk during a copy): its manifest names more bytes.
    plant(on_ct200, b"cut short", {"facts": facts, "size": 4096, "sha256": "0" * 64, "torch": facts["torch"]})
    config = small_config(tmp_path / "compiled.yaml", compile="default", devices={"drafters": ["cpu"]},
                          optim={"max_steps": 2}, eval={"num_prompts": 0})
    launched = pair.dflash("launch", "ct200", "--config", str(config))
    assert launched.returncode == 0, launched.stderr
    (run_id,) = launched.stdout.splitlines()
    watch = pair.dflash("watch", run_id)  # a cold CPU compile: minutes on a loaded machine (the timeout mark)
    assert watch.returncode == 0, watch.stdout[-3000:] + watch.stderr
    for shown in ("start-up: import ", "start-up: build data ", "start-up: load target ", "start-up: drafter weights ",
                  "start-up: compile cache (cold) ", "start-up: set up drafter 0 ",
                  "start-up: build train step drafter 0 (cold) ",
                  f"compile artifacts {pair.workspace}/cache/compile/{key}/{ARTIFACTS_FILE} not loaded: ",
                  "moved to artifacts.bin.corrupt, compiling as if cold", "compile artifacts saved: "):
        assert shown in watch.stdout, shown
    # events.jsonl: each phase once, started then done, in order, with a duration
    events = startup_events(pair.on_node(200, f"runs/{run_id}") / "events.jsonl")
    done = [e for e in events if e["state"] == "done"]
    assert [e["phase"] for e in done] == PHASES
    assert all(e["duration_s"] >= 0 for e in done)
    assert [e["phase"] for e in events if e["state"] == "started"] == PHASES[1:]  # import is measured after it
    cache = done[PHASES.index("compile cache")]
    assert (cache["key"], cache["cache"], cache["artifacts"]) == (key, "cold", CORRUPT)
    assert done[PHASES.index("build train step")]["drafter"] == 0
    assert (on_ct200 / f"{ARTIFACTS_FILE}.corrupt").read_bytes() == b"cut short"
    saved = (on_ct200 / ARTIFACTS_FILE).read_bytes()
    manifest = json.loads((on_ct200 / ARTIFACTS_MANIFEST).read_text())
    assert manifest["facts"] == facts and manifest["size"] == len(saved) > 0
    assert manifest["sha256"] == hashlib.sha256(saved).hexdigest()
    assert done[-1]["bytes"] == len(saved)

    # dflash cache copy: the bytes arrive whole, once
    assert pair.dflash("deploy", "ct202").returncode == 0
    copied = pair.dflash("cache", "copy", "ct200", "ct202")
    assert copied.returncode == 0, copied.stderr
    assert f"compile artifacts for {key} copied ct200 → ct202 ({len(saved) / 1e6:.1f} MB)" in copied.stderr
    assert (on_ct202 / ARTIFACTS_FILE).read_bytes() == saved
    assert json.loads((on_ct202 / ARTIFACTS_MANIFEST).read_text()) == manifest
    again = pair.dflash("cache", "copy", "ct200", "ct202")
    assert again.returncode == 0 and "not copied to ct202: it has them already" in again.stderr

    # a run on both hosts first seeds the one that lacks them
    for name in (ARTIFACTS_FILE, ARTIFACTS_MANIFEST):
        (on_ct202 / name).unlink()
    config = pair_config(tmp_path / "pair.yaml", optim={"max_steps": 2}, eval={"num_prompts": 0})
    launched = pair.dflash("launch", "ct200", "ct202", "--config", str(config))
    assert launched.returncode == 0, launched.stderr
    assert f"compile artifacts for {key} copied ct200 → ct202" in launched.stderr
    assert (on_ct202 / ARTIFACTS_FILE).read_bytes() == saved
    assert pair.dflash("watch", launched.stdout.strip()).returncode == 0

    # what ct202 received loads into its cold cache; a manifest of another toolchain is never loaded
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    received = tmp_path / "received"
    shutil.copytree(on_ct202, received)
    status, message = load_artifacts(received, facts)
    assert status == LOADED, message
    assert any((tmp_path / "inductor").iterdir())
    other = {**facts, "triton": "0.0.1"}
    plant(received, saved, {**manifest, "facts": other})
    status, message = load_artifacts(received, facts)
    assert status == MISMATCH and "not loaded" in message
    assert not (received / ARTIFACTS_FILE).exists() and (received / f"{ARTIFACTS_FILE}.mismatch").read_bytes() == saved
