"""The tokenized-data cache: a training jsonl is tokenized once into a memory-mapped store
under the workspace; later loads open it, a change of what decides the tokens rebuilds it,
a damaged or half-built store is never trusted. Real tokenizer, real worker processes,
real files (and a real full filesystem)."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_files import procfs
from dflash_train.data import batches, tokenizing
from dflash_train.config import NO_TURN, DataConfig, SyntheticDataSpec, TinyTargetSpec
from dflash_train.data.batches import BatchPlan, _read_jsonl, load_samples, tokenize_sample
from dflash_train.data.tiny import _build_tokenizer, ensure_tiny_assets
from dflash_train.model.objective import anchor_candidates
from support.disk import tmpfs
from test_trainer_runs import launch  # noqa: F401 - the fixture that runs the real trainer

REPO = Path(__file__).resolve().parents[1]
MAX_LENGTH = 96


@pytest.fixture(scope="session")  # slow tests use it: they run apart from each other (conftest)
def tokenizer():
    return _build_tokenizer(TinyTargetSpec())


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(200)}" for _ in range(count))


def write_data(path: Path, rows: int, seed: int = 0, answer_words: int = 150) -> Path:
    """Chats (some longer than MAX_LENGTH, some with an empty answer: nothing to learn),
    plain texts, and blank lines."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            if i % 7 == 3:
                f.write(json.dumps({"text": words(rng, rng.randrange(2, 60))}) + "\n")
            else:
                f.write(json.dumps({"messages": [
                    {"role": "user", "content": words(rng, rng.randrange(1, 30))},
                    {"role": "assistant", "content": words(rng, rng.randrange(0, answer_words))}]}) + "\n")
            if i % 11 == 5:
                f.write("\n")
    return path


def uncached(path: Path, tokenizer, max_length: int = MAX_LENGTH) -> list:
    """The samples as tokenize_sample makes them, one by one, in memory (the trainer's way before the cache)."""
    samples = [tokenize_sample(row, tokenizer, max_length, f"{path}:{n}") for n, row in _read_jsonl(path)]
    return [s for s in samples if s is not None]


def assert_same_samples(loaded, expected) -> None:
    assert len(loaded) == len(expected)
    for got, want in zip(loaded, expected):
        for name in ("ids", "turn_ids"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


def stores(cache: Path) -> list[Path]:
    return sorted(p.parent for p in cache.glob("*/header.json"))


def builds(output: str) -> tuple[int, int]:
    """(cache hits, builds) a log reports."""
    return output.count("tokenized data cache hit"), output.count("tokenizing ")


class CountingTokenizeRow:
    """Counts the per-sample tokenizations (the in-process build calls tokenizing.tokenize_row)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = tokenizing.tokenize_row

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(tokenizing, "tokenize_row", counted)


def test_a_second_load_is_a_cache_hit_that_tokenizes_nothing(tmp_path, tokenizer, monkeypatch, capsys):
    path, cache = write_data(tmp_path / "train.jsonl", 60), tmp_path / "cache"
    counter = CountingTokenizeRow(monkeypatch)
    first = load_samples(path, tokenizer, MAX_LENGTH, cache)
    assert counter.calls == 60 and "tokenized data cache hit" not in capsys.readouterr().out
    [store] = stores(cache)
    inode, header = store.stat().st_ino, (store / "header.json").read_text()

    second = load_samples(path, tokenizer, MAX_LENGTH, cache)
    out = capsys.readouterr().out
    assert counter.calls == 60, "the second load tokenized again"
    assert f"tokenized data cache hit: {store} ({len(first)} samples" in out and "tokenizing" not in out
    assert stores(cache) == [store] and store.stat().st_ino == inode and (store / "header.json").read_text() == header
    assert_same_samples(second, uncached(path, tokenizer))


def test_worker_processes_give_exactly_the_uncached_samples_and_batches(tmp_path, tokenizer, capsys, monkeypatch):
    path = write_data(tmp_path / "train.jsonl", 300)
    monkeypatch.setattr(batches, "PROGRESS_EVERY_S", 0.0)  # a report after every chunk
    reports = []
    # small chunks: many tasks over two spawned workers, results written in file order
    loaded = load_samples(path, tokenizer, MAX_LENGTH, tmp_path / "cache", chunk_bytes=4096, workers=2,
                          progress=lambda fraction, count: reports.append((fraction, count)))
    assert "with 2 processes" in capsys.readouterr().out
    assert len(reports) > 5 and reports == sorted(reports) and reports[-1] == (1.0, len(loaded))
    expected = uncached(path, tokenizer)
    assert 200 < len(expected) < 300  # some rows had nothing to learn and are left out, as before
    assert max(len(s.ids) for s in expected) == MAX_LENGTH  # some were cut
    assert_same_samples(loaded, expected)
    config = DataConfig(train=str(path), max_length=MAX_LENGTH, token_budget=400, pad_multiple=16)
    plans = [BatchPlan(samples, config, replicas=2, epochs=3, max_steps=None, seed=5) for samples in (loaded, expected)]
    assert plans[0].entries == plans[1].entries and plans[0].total_steps == plans[1].total_steps


WORKER = """
import importlib, os, pickle, sys
importlib.import_module(sys.argv[2])  # the tokenizer's class, which the workers' server imports too
before = set(sys.modules)
from dflash_files import procfs
from dflash_train.data import tokenizing
# What a worker's initializer gets: the task, the trainer's pid and its start time.
tokenizing.start_worker(pickle.loads(sys.stdin.buffer.read()), os.getppid(), procfs.start_time(os.getppid()))
result = tokenizing.tokenize_in_worker((open(sys.argv[1], "rb").read(), 1))
added = sorted(name for name in set(sys.modules) - before
               if name.split(".")[0] == "torch" or name.startswith("dflash_train.model"))
sys.stdout.buffer.write(pickle.dumps((result, added)))
"""


def test_a_tokenizing_worker_imports_no_torch_and_tokenizes_as_the_trainer_does(tmp_path, tokenizer):
    """What a worker runs, in a fresh interpreter: the task object unpickled, one chunk
    tokenized. The server the workers are forked from imports tokenizing.py and the
    tokenizer's class at every build that starts workers, so our code must add neither
    torch nor the model code (seconds on a GPU host) to what that class imports: with some
    transformers releases the class imports torch itself (5.17 does, 5.24 does not)."""
    path = write_data(tmp_path / "train.jsonl", 40)
    task = tokenizing.ChunkTokenizer(tokenizer, MAX_LENGTH, str(path), {})
    env = {**os.environ, "PYTHONPATH": str(REPO / "remote")}
    done = subprocess.run([sys.executable, "-c", WORKER, str(path), type(tokenizer).__module__],
                          input=pickle.dumps(task), capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    (arrays, lengths, counts), added = pickle.loads(done.stdout)
    assert added == []
    want_arrays, want_lengths, want_counts = task((path.read_bytes(), 1))
    assert counts == want_counts and counts.rows == 40 and lengths.tolist() == want_lengths.tolist()
    assert arrays.keys() == want_arrays.keys() and all((arrays[k] == want_arrays[k]).all() for k in arrays)


def test_the_workers_anchor_rule_is_the_objectives():
    """tokenizing.has_anchor (numpy, in the workers) decides which samples are stored;
    objective.anchor_candidates (torch) draws their anchors in training: a stored sample
    must have one."""
    rng = random.Random(3)
    for _ in range(2000):
        turns = [rng.choice([NO_TURN, NO_TURN, 0, 1, 2]) for _ in range(rng.randrange(0, 9))]
        assert tokenizing.has_anchor(np.array(turns, dtype=np.int32)) == bool(
            anchor_candidates(torch.tensor(turns, dtype=torch.int32)).numel()), turns


@pytest.mark.parametrize("file_mib, workers, tasks", [(6.7, 16, 54), (0.1, 16, 1), (0.5, 2, 4), (400, 16, 100)])
def test_a_file_is_cut_into_tasks_for_every_worker_within_the_bounds(file_mib, workers, tasks):
    """6.7 MiB over 16 cores was 2 tasks of 4 MiB, so 2 of the 16 worked; a task is never
    so small that the pool costs more than it saves, nor larger than MAX_CHUNK_BYTES."""
    size = int(file_mib * 2**20)
    chunk = tokenizing.chunk_bytes_for(size, workers)
    assert tokenizing.MIN_CHUNK_BYTES <= chunk <= tokenizing.MAX_CHUNK_BYTES
    assert -(-size // chunk) == tasks


def test_a_small_file_is_tokenized_in_the_trainer_and_a_large_one_by_every_core(tmp_path, tokenizer, capsys):
    path = write_data(tmp_path / "train.jsonl", 600)
    assert path.stat().st_size > tokenizing.MIN_CHUNK_BYTES  # more than one task, yet no worker started
    load_samples(path, tokenizer, MAX_LENGTH, tmp_path / "cache")
    assert "with 1 process" in capsys.readouterr().out
    assert tokenizing.default_workers(tokenizing.IN_PROCESS_BYTES) == 1
    assert tokenizing.default_workers(tokenizing.IN_PROCESS_BYTES + 1) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("change", ["content", "max_length", "chat_template"])
def test_a_change_of_what_decides_the_tokens_rebuilds(tmp_path, tokenizer, change, capsys):
    path, cache = write_data(tmp_path / "train.jsonl", 40), tmp_path / "cache"
    load_samples(path, tokenizer, MAX_LENGTH, cache)
    capsys.readouterr()
    max_length = MAX_LENGTH
    if change == "content":
        # the same size and mtime: only the bytes (and the ctime no one can set back) differ
        stat, text = path.stat(), path.read_text()
        path.write_text(text.replace("w1 ", "w2 ", 1))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.stat().st_size == stat.st_size and path.read_text() != text
    elif change == "max_length":
        max_length = MAX_LENGTH // 2
    else:
        tokenizer = _build_tokenizer(TinyTargetSpec())
        tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|> ", "<|im_end|> <|endoftext|> ")
    loaded = load_samples(path, tokenizer, max_length, cache)
    out = capsys.readouterr().out
    assert builds(out) == (0, 1), out
    assert len(stores(cache)) == 2
    assert_same_samples(loaded, uncached(path, tokenizer, max_length))


@pytest.mark.parametrize("damage", ["truncated tokens", "changed index", "cut header", "deleted mask"])
def test_a_damaged_store_is_rebuilt_not_trusted(tmp_path, tokenizer, damage, capsys):
    path, cache = write_data(tmp_path / "train.jsonl", 40), tmp_path / "cache"
    load_samples(path, tokenizer, MAX_LENGTH, cache)
    [store] = stores(cache)
    if damage == "truncated tokens":
        with open(store / "ids.bin", "r+b") as f:
            f.truncate(store.joinpath("ids.bin").stat().st_size - 4)
    elif damage == "changed index":
        index = bytearray((store / "offsets.bin").read_bytes())
        index[8] ^= 1  # sample 0 one token longer: the sizes still agree
        (store / "offsets.bin").write_bytes(bytes(index))
    elif damage == "cut header":
        header = (store / "header.json").read_bytes()
        (store / "header.json").write_bytes(header[:len(header) // 2])
    else:
        (store / "turn_ids.bin").unlink()
    capsys.readouterr()
    loaded = load_samples(path, tokenizer, MAX_LENGTH, cache)
    out = capsys.readouterr().out
    assert f"tokenized data cache {store} is damaged (" in out and "rebuilding it" in out
    assert builds(out) == (0, 1), out
    assert stores(cache) == [store] and not [p for p in cache.iterdir() if ".damaged-" in p.name]
    assert_same_samples(loaded, uncached(path, tokenizer))


LOADER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dflash_train.config import TinyTargetSpec
    from dflash_train.data.batches import load_samples
    from dflash_train.data.tiny import _build_tokenizer
    path, cache, chunk_bytes, workers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    samples = load_samples(path, _build_tokenizer(TinyTargetSpec()), %d, cache, chunk_bytes=chunk_bytes,
                           workers=workers)
    print("loaded", len(samples), flush=True)
""" % MAX_LENGTH)


def start_loader(path: Path, cache: Path, chunk_bytes: int, workers: int = 1,
                 new_session: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'remote'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", LOADER, str(path), str(cache), str(chunk_bytes), str(workers)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)


def wait_until_the_build_writes(loader: subprocess.Popen, cache: Path) -> None:
    deadline = time.monotonic() + 200
    while not [p for p in cache.glob(".*.build-*/ids.bin") if p.stat().st_size > 0]:
        assert loader.poll() is None, loader.stdout.read()
        assert time.monotonic() < deadline, "the build never started writing"
        time.sleep(0.05)


@pytest.mark.timeout(240)
@pytest.mark.slow(seconds=7, why="a tokenizing process killed midway, then another build")
def test_a_build_killed_midway_leaves_no_store_and_the_next_load_builds_it(tmp_path, tokenizer, capsys):
    path, cache = write_data(tmp_path / "train.jsonl", 3000, answer_words=60), tmp_path / "cache"
    loader = start_loader(path, cache, chunk_bytes=2048)  # in-process, written chunk by chunk
    try:
        wait_until_the_build_writes(loader, cache)
        loader.send_signal(signal.SIGKILL)
    finally:
        loader.kill()
        loader.wait()
    assert loader.returncode == -signal.SIGKILL
    assert stores(cache) == [] and list(cache.glob(".*.build-*"))  # half a build, never in place

    assert_same_samples(load_samples(path, tokenizer, MAX_LENGTH, cache), uncached(path, tokenizer))
    assert len(stores(cache)) == 1 and not list(cache.glob(".*.build-*"))  # the leftover is cleaned up


@pytest.mark.timeout(240)
def test_a_trainer_killed_while_workers_tokenize_leaves_no_process_behind(tmp_path):
    """SIGKILL (the OOM killer's way) gives the trainer no chance to stop its pool: the
    workers and the server they were forked from end by themselves."""
    path, cache = write_data(tmp_path / "train.jsonl", 3000, answer_words=60), tmp_path / "cache"
    loader = start_loader(path, cache, chunk_bytes=2048, workers=2, new_session=True)
    try:
        wait_until_the_build_writes(loader, cache)
        assert len(procfs.group_members(loader.pid)) >= 4  # the loader, the server, two workers
        loader.send_signal(signal.SIGKILL)
        loader.wait()
        deadline = time.monotonic() + 20
        while (left := [p.pid for p in procfs.group_members(loader.pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], [(Path(f"/proc/{pid}/cmdline").read_bytes()[:120]) for pid in left]
    finally:
        loader.kill()
        for member in procfs.group_members(loader.pid):  # only this test's group: never another's process
            os.kill(member.pid, signal.SIGKILL)


WATCHER = """
import os, sys
from dflash_train.data import tokenizing
def no_pidfd(pid):
    raise OSError(38, "Function not implemented")  # what Linux before 5.3 answers
if sys.argv[3] == "no-pidfds":
    os.pidfd_open = no_pidfd
tokenizing._end_with(int(sys.argv[1]), int(sys.argv[2]))
"""


def watch(pid: int, start_time: int, kernel: str) -> subprocess.Popen:
    """A worker's watch on the trainer `pid` that started at `start_time`, in a process of
    its own; kernel "no-pidfds": os.pidfd_open fails as Linux before 5.3 makes it."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "remote")}
    return subprocess.Popen([sys.executable, "-c", WATCHER, str(pid), str(start_time), kernel], env=env)


@pytest.mark.parametrize("kernel", ["pidfds", "no-pidfds"])
def test_a_worker_ends_once_the_trainer_has_exited_though_not_yet_reaped(kernel):
    """A trainer killed outright stays a zombie until its parent reaps it, and has ended
    all the same: kill(pid, 0), the check without pidfds, takes a zombie for alive."""
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = watch(trainer.pid, procfs.start_time(trainer.pid), kernel)
    try:
        time.sleep(1.5)
        assert watcher.poll() is None  # watches while the trainer runs
        trainer.kill()  # not waited for: a zombie until the end of this test
        assert watcher.wait(timeout=20) == 1
        assert procfs.read_stat(trainer.pid).state == "Z"  # what the watch saw through
    finally:
        watcher.kill()
        trainer.kill()
        trainer.wait()
        watcher.wait()


@pytest.mark.parametrize("kernel", ["pidfds", "no-pidfds"])
def test_a_worker_ends_when_the_trainers_pid_belongs_to_another_process(kernel):
    """The trainer's pid, reused: a live process whose start time is not the trainer's."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = watch(other.pid, procfs.start_time(other.pid) - 1, kernel)
    try:
        assert watcher.wait(timeout=20) == 1
        assert other.poll() is None  # it ended though that pid's process runs on
    finally:
        watcher.kill()
        other.kill()
        other.wait()
        watcher.wait()


@pytest.mark.timeout(240)
@pytest.mark.slow(seconds=13, why="two processes importing transformers build one store at once")
def test_concurrent_loads_of_one_key_build_it_once(tmp_path):
    path, cache = write_data(tmp_path / "train.jsonl", 1500), tmp_path / "cache"
    loaders = [start_loader(path, cache, chunk_bytes=4096) for _ in range(2)]
    outputs = [loader.communicate(timeout=220)[0] for loader in loaders]
    assert [loader.returncode for loader in loaders] == [0, 0], outputs
    assert sorted(builds(out) for out in outputs) == [(0, 1), (1, 0)], outputs  # one built, the other opened it
    assert len({out.splitlines()[-1] for out in outputs}) == 1 and len(stores(cache)) == 1


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_behind(tmp_path, tokenizer):
    path = write_data(tmp_path / "train.jsonl", 3000)
    with tmpfs(tmp_path / "small", size_mib=1) as small:
        cache = small / "tokenized"
        with pytest.raises(OSError, match=re.escape(f"no space left to cache the tokenized data in {cache} ")):
            load_samples(path, tokenizer, MAX_LENGTH, cache)
        assert stores(cache) == [] and not list(cache.glob(".*.build-*"))


def test_an_unchanged_files_hash_is_remembered_a_changed_ones_is_not(tmp_path, tokenizer):
    path, cache = write_data(tmp_path / "train.jsonl", 20), tmp_path / "cache"
    time.sleep(2.1)  # a memo is trusted only for a file last changed well before its hashing
    load_samples(path, tokenizer, MAX_LENGTH, cache)
    [memo] = (cache / "hashes").iterdir()
    record = json.loads(memo.read_text())
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    load_samples(path, tokenizer, MAX_LENGTH, cache)
    assert json.loads(memo.read_text()) == record  # not hashed again

    path.write_bytes(path.read_bytes().replace(b"w1 ", b"w2 ", 1))
    load_samples(path, tokenizer, MAX_LENGTH, cache)
    assert json.loads(memo.read_text())["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() != record["sha256"]


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=11, why="two trainer runs on CPU: a run and its resume")
def test_the_trainer_tokenizes_data_train_once_and_a_resume_reuses_it(launch, workspace, tmp_path):  # noqa: F811
    assets = ensure_tiny_assets(TinyTargetSpec(), SyntheticDataSpec(num_train=64, num_eval=2), workspace / "cache")
    path = write_data(tmp_path / "chats.jsonl", 80, seed=3)
    base = textwrap.dedent(f"""
        target: {{path: {assets.target_dir}}}
        data: {{train: {path}, max_length: 96, token_budget: 384, pad_multiple: 16}}
        drafter: {{num_layers: 1, block_size: 4, num_anchors: 8, num_target_features: 2}}
        devices: {{target: [cpu], drafters: [cpu]}}
        runtime: {{heartbeat_s: 0.5, torch_threads: 1}}
        optim: {{max_steps: 6}}
        eval: {{num_prompts: 0}}
        """)
    run_dir = tmp_path / "run"
    # Stopped while hung at step 5 rather than crashed there: a crash could come before the
    # background write of step 3's checkpoint is done; a stop's exit waits for it.
    first = launch(base + "checkpoint: {every: 3}\nfaults: [{thread: drafter-0, at: 'step:5', kind: hang}]\n", run_dir)
    first.wait_for("the hang", lambda: "injecting fault: hang" in first.log(), 150)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(100) == 143
    assert builds(first.log()) == (0, 1)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    [store] = [s for s in stores(workspace / "cache" / "tokenized")
               if json.loads((s / "header.json").read_text())["key"]["data_sha256"] == digest]
    inode, log_length = store.stat().st_ino, len(first.log())

    second = launch(base + "checkpoint: {every: 3, resume: latest}\n", run_dir)
    assert second.wait(200) == 0, second.log()[-3000:]
    resumed_log = second.log()[log_length:]  # the same train.log, appended to
    assert f"tokenized data cache hit: {store}" in resumed_log and builds(resumed_log) == (1, 0)
    assert "resuming from" in resumed_log and store.stat().st_ino == inode
    assert [e["step"] for e in second.events("step")][-3:] == [4, 5, 6]
