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
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dflash_files.compile_key import ARTIFACTS_FILE, ARTIFACTS_MANIFEST, compile_key
from dflash_train.compiling.cache import CORRUPT, LOADED, MISMATCH, bundle, compile_key_facts, load_artifacts
from dflash_train.compiling.stable_pickles import memory_format, stable_cache_keys
from dflash_train.compiling.precompiled import PRECOMPILED_DIR, unsupported_reason
from support.checkout import REPO
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
    if unsupported_reason() is None:  # the precompiled train step travels inside them, for the receiver's runs
        sent = {f.name: f.read_bytes() for f in (on_ct200 / PRECOMPILED_DIR).glob("*") if f.suffix in (".aot", ".json")}
        assert sent and {f.name: f.read_bytes() for f in (received / PRECOMPILED_DIR).iterdir()} == sent
        assert f"{len(sent)} file(s) of the precompiled train step" in message
    other = {**facts, "triton": "0.0.1"}
    plant(received, saved, {**manifest, "facts": other})
    status, message = load_artifacts(received, facts)
    assert status == MISMATCH and "not loaded" in message
    assert not (received / ARTIFACTS_FILE).exists() and (received / f"{ARTIFACTS_FILE}.mismatch").read_bytes() == saved


def bundled(folder: Path, files: dict[str, bytes], blob: bytes = b"") -> bytes:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return bundle(blob, folder)


def test_a_bundle_gives_the_receiver_the_precompiled_step_and_keeps_what_it_has(tmp_path):
    facts = compile_key_facts("cpu")
    step = {f"{PRECOMPILED_DIR}/{'a' * 16}.aot": b"graphs", f"{PRECOMPILED_DIR}/{'a' * 16}.json": b"{}",
            f"{PRECOMPILED_DIR}/{'b' * 16}.aot": b"other graphs", f"{PRECOMPILED_DIR}/{'b' * 16}.json": b"{}"}
    data = bundled(tmp_path / "sender", step)
    assert bundle(b"torch", tmp_path / "nothing") == b"torch"  # no precompiled step: torch's blob as it is
    receiver = tmp_path / "receiver"
    (receiver / PRECOMPILED_DIR).mkdir(parents=True)
    (receiver / PRECOMPILED_DIR / f"{'b' * 16}.aot").write_bytes(b"its own")  # a graph it has stays
    plant(receiver, data, {"facts": facts, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    status, message = load_artifacts(receiver, facts)
    assert status == LOADED and "4 file(s) of the precompiled train step" in message, message
    assert (receiver / PRECOMPILED_DIR / f"{'a' * 16}.aot").read_bytes() == b"graphs"
    assert (receiver / PRECOMPILED_DIR / f"{'b' * 16}.aot").read_bytes() == b"its own"


@pytest.mark.parametrize("damage,why", [
    (lambda data: data[:-3], "its bundle holds 27 bytes after the header, which names 30"),
    (lambda data: data[:30], "its bundle ends inside its header"),
    (lambda data: data.replace(b'"files"', b'"fi1es"'), "its bundle header is unreadable"),
    (lambda data: data.replace(PRECOMPILED_DIR.encode() + b"/", b"../x/"), "names files outside the precompiled"),
])
def test_a_bundle_not_whole_is_set_aside_and_writes_nothing(tmp_path, damage, why):
    facts = compile_key_facts("cpu")
    data = damage(bundled(tmp_path / "sender", {f"{PRECOMPILED_DIR}/{'a' * 16}.aot": b"x" * 28,
                                                f"{PRECOMPILED_DIR}/{'a' * 16}.json": b"{}"}))
    receiver = tmp_path / "receiver"
    plant(receiver, data, {"facts": facts, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    status, message = load_artifacts(receiver, facts)
    assert status == CORRUPT and why in message, message
    assert (receiver / f"{ARTIFACTS_FILE}.corrupt").read_bytes() == data and not (receiver / PRECOMPILED_DIR).exists()


# Inductor's cache key of a tensor's metadata, in a new interpreter: argv[1] "first" imports,
# before torch, a module that binds `torch` (as a module of the warm interpreter's imports
# may come before torch's own in sys.modules); argv[2] "stable" calls stable_cache_keys first.
METADATA_KEY = """
import sys, types
if sys.argv[1] == "first":
    first = types.ModuleType("a_module_before_torch")
    sys.modules[first.__name__] = first
import torch
if sys.argv[1] == "first":
    first.torch = torch
if sys.argv[2] == "stable":
    from dflash_train.compiling.stable_pickles import stable_cache_keys
    stable_cache_keys()
from torch._inductor.codecache import FxGraphCachePickler, extract_tensor_metadata_for_cache_key
pickler = FxGraphCachePickler(torch.fx.symbolic_trace(torch.nn.Identity()))
print(pickler.get_hash(extract_tensor_metadata_for_cache_key(torch.zeros(2, 3))))
"""


def metadata_key(imports: str, keys: str) -> str:
    done = subprocess.run([sys.executable, "-c", METADATA_KEY, imports, keys], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "remote")}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow(seconds=55, why="four new interpreters importing torch and Inductor")
def test_the_compile_caches_keys_do_not_depend_on_the_order_of_imports():
    # As torch has it, the key follows the import order: the forked trainer's misses.
    assert metadata_key("first", "as torch has it") != metadata_key("plain", "as torch has it")
    assert metadata_key("first", "stable") == metadata_key("plain", "stable")


def test_a_memory_format_pickled_for_stable_keys_loads_back():
    stable_cache_keys()
    for value in (torch.contiguous_format, torch.channels_last, torch.preserve_format):
        assert pickle.loads(pickle.dumps(value)) is value
    with pytest.raises(ValueError, match="torch.float32 is no memory format"):
        memory_format("float32")
    # and in another interpreter of the trainer's PYTHONPATH (a compile worker) that registered nothing
    done = subprocess.run([sys.executable, "-c", "import pickle, sys; print(pickle.loads(bytes.fromhex(sys.argv[1])))",
                           pickle.dumps(torch.channels_last).hex()], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "remote")})
    assert (done.returncode, done.stdout.strip()) == (0, "torch.channels_last"), done.stderr
