"""Training data: jsonl -> token ids with assistant-turn ids -> token-budget micro-batches.

A line holds either {"text": ...} (every token is learnt) or {"messages": [...]} (the
tokenizer's chat template; only assistant tokens are learnt, each turn on its own: a
block never learns across a user turn, see model/objective.py; chat.py finds them). `"truncated": true` says the
final assistant answer was cut (at max_new_tokens when it was generated): the
end-of-turn the template closes it with, and all it renders after, is never learnt, as
the target never produced it. The training file is tokenized once, by worker
processes, into a memory-mapped store cached on the host (tokstore.py); later runs and
resumes open it in seconds and read samples as batches need them. The store holds
whatever `tokenize_sample` returns, array by array. The batch plan is fixed by
the seed: every epoch shuffles the samples with its own seed and packs them greedily into
micro-batches of at most `config.rows_per_micro_batch` rows (`token_budget` padded tokens,
and `block_token_budget` drafter block tokens). `BatchPlan` maps each (step, micro-batch,
replica) to one plan entry (docs/trainer.md, "Gradient accumulation"), so a resumed run
reads exactly what the uninterrupted one would.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tokenizers
import torch
import transformers

from dflash_files import procfs

from ..config import NO_TURN, DataConfig, DrafterConfig, blocks_per_row, padded_length, rows_per_micro_batch
from ..model.objective import (DrafterInputs, anchor_candidates, anchor_seed, block_labels, position_weights,
                               sample_anchors)
from ..runlog import say
from . import chat, tokenizing
from .chat import render, require_template
from .tokenizing import learnable, parse_line, tokenize_row
from .tokstore import StoreWriter, TokenStore, file_sha256, open_or_build, sha256_hex

# A build of the recipe's data takes minutes: it says how far it is this often, and the
# event it emits meanwhile keeps a starting run from looking stalled.
PROGRESS_EVERY_S = 30.0


@dataclasses.dataclass(frozen=True)
class Sample:
    ids: torch.Tensor  # (L,) int32: half the memory of long for a dataset held whole
    turn_ids: torch.Tensor  # (L,) int32: the assistant turn a token is learnt in, NO_TURN if none


@dataclasses.dataclass(frozen=True, order=True)
class BatchShape:
    """A bucket: micro-batches of at most `rows` sequences of `length` tokens, `blocks` anchors."""

    rows: int
    length: int
    blocks: int

    @property
    def tokens(self) -> int:
        return self.rows * self.length

    def holds(self, inputs: DrafterInputs) -> bool:
        rows, length = inputs.input_ids.shape
        return rows <= self.rows and length <= self.length and inputs.anchors.shape[1] <= self.blocks

    def __str__(self) -> str:
        return f"{self.rows}x{self.length} ({self.blocks} blocks)"


def first_chat_row(path: Path) -> tuple[int, list[Any]] | None:
    """(line number, messages) of the file's first row when it is a chat, else None."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            row = parse_line(line, f"{path}:{number}")
            if row is not None:
                messages = row.get("messages")
                return (number, messages) if isinstance(messages, list) else None
    return None


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    with open(path, "rb") as f:
        rows = [(number, parse_line(line, f"{path}:{number}")) for number, line in enumerate(f, 1)]
    return [(number, row) for number, row in rows if row is not None]


def tokenize_sample(row: dict[str, Any], tokenizer, max_length: int, where: str,
                    template_kwargs: Mapping[str, Any] | None = None) -> Sample | None:
    """One jsonl row as a training sample, cut to `max_length` tokens; None when it has
    no anchor (nothing it could teach)."""
    arrays = learnable(*tokenize_row(row, tokenizer, where, template_kwargs), max_length)
    return Sample(*map(torch.from_numpy, arrays)) if arrays is not None else None


class StoredSamples(Sequence):
    """The training samples, read lazily from a memory-mapped TokenStore: a sample's
    tensors are views of the mapped files, so resident memory does not grow with the data."""

    def __init__(self, store: TokenStore):
        self.store = store
        self.lengths = store.lengths  # tokens per sample: enough to plan the batches

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self.store):
            raise IndexError(f"sample {index} of {len(self.store)}")
        return Sample(**{name: torch.from_numpy(values) for name, values in self.store.row(index).items()})


def load_samples(path: Path, tokenizer, max_length: int, cache_dir: Path, chunk_bytes: int | None = None,
                 workers: int | None = None, progress: Callable[[float, int], None] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> StoredSamples:
    """The samples of a training jsonl, from the store under `cache_dir` keyed by what
    decides them: the file's bytes, the tokenizer, its chat template and what it is
    rendered with (`template_kwargs`), max_length and the code that tokenizes (this
    module, tokenizing.py and chat.py: a change of the tokenization rebuilds). Built first
    if absent or damaged, by `workers` processes (default: tokenizing.default_workers) over tasks of
    `chunk_bytes` (default: tokenizing.chunk_bytes_for the file and the workers); while it
    is built, `progress(fraction of the file done, samples so far)` is called every
    PROGRESS_EVERY_S."""
    template_kwargs = dict(template_kwargs or {})
    code = b"".join(Path(source).read_bytes() for source in (__file__, tokenizing.__file__, chat.__file__))
    key = {"data_sha256": file_sha256(path, cache_dir / "hashes"),
           "tokenizer_sha256": _tokenizer_sha256(tokenizer),
           "chat_template_sha256": sha256_hex(json.dumps(tokenizer.chat_template, sort_keys=True).encode()),
           "chat_template_kwargs": template_kwargs,
           "max_length": max_length,
           "tokenization_sha256": sha256_hex(code),
           "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    return StoredSamples(open_or_build(
        cache_dir, key,
        lambda writer: _tokenize_into(writer, path, tokenizer, max_length, chunk_bytes, workers, progress,
                                      template_kwargs)))


def _tokenizer_sha256(tokenizer) -> str:
    """What decides the ids besides the template: the fast tokenizer's whole pipeline
    (vocabulary, merges, normalizer, pre-tokenizer, added tokens) and the special tokens
    a chat template may name."""
    if not tokenizer.is_fast:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer (no tokenizer.json): the chat "
                         "loss mask needs token offsets, which only fast tokenizers give")
    return sha256_hex(json.dumps({"class": type(tokenizer).__name__, "pipeline": tokenizer.backend_tokenizer.to_str(),
                                  "special_tokens": tokenizer.special_tokens_map}, sort_keys=True).encode())


def _tokenize_into(writer: StoreWriter, path: Path, tokenizer, max_length: int, chunk_bytes: int | None,
                   workers: int | None, progress: Callable[[float, int], None] | None,
                   template_kwargs: dict[str, Any]) -> None:
    started = last_report = time.perf_counter()
    size, done = path.stat().st_size, 0
    # Processes, not threads: the template rendering and the masks are Python.
    workers = workers or tokenizing.default_workers(size)
    chunk_bytes = chunk_bytes or tokenizing.chunk_bytes_for(size, workers)
    workers = max(1, min(workers, -(-size // chunk_bytes)))
    say(f"tokenizing {path} ({size / 2**20:.1f} MiB) with {workers} process{'es' if workers > 1 else ''}")

    counts = tokenizing.RowCounts()

    def write(result: tokenizing.ChunkResult, chunk_size: int) -> None:
        nonlocal done, last_report
        arrays, lengths, chunk_counts = result
        writer.append(arrays, lengths)
        counts.add(chunk_counts)
        done += chunk_size
        if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
            last_report = time.perf_counter()
            say(f"tokenizing: {done / size:.0%} of the file, {writer.num_samples} samples, "
                f"{last_report - started:.0f}s")
            if progress is not None:
                progress(done / size, writer.num_samples)

    tokenize = tokenizing.ChunkTokenizer(tokenizer, max_length, str(path), template_kwargs)
    chunks = tokenizing.read_chunks(path, chunk_bytes)
    if workers == 1:
        for chunk in chunks:
            write(tokenize(chunk), len(chunk[0]))
    else:
        executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=_worker_context(tokenizer), initializer=tokenizing.start_worker,
            initargs=(tokenize, os.getpid(), procfs.start_time(os.getpid())))
        try:
            pending: collections.deque = collections.deque()
            for chunk in chunks:  # a window of tasks in flight: the file is never held whole
                pending.append((executor.submit(tokenizing.tokenize_in_worker, chunk), len(chunk[0])))
                if len(pending) >= 2 * workers:
                    future, chunk_size = pending.popleft()
                    write(future.result(), chunk_size)
            while pending:
                future, chunk_size = pending.popleft()
                write(future.result(), chunk_size)
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
    if writer.num_samples == 0:
        raise counts.nothing_learnable(path, max_length)
    say(f"tokenized {writer.num_samples} samples ({writer.num_tokens} tokens) in {time.perf_counter() - started:.1f}s")


def _worker_context(tokenizer) -> multiprocessing.context.BaseContext:
    """Where the tokenizing workers come from: forked from one server process that has
    imported tokenizing.py and the tokenizer's class, once for all of them. Not forked
    from the trainer, which has threads (and OpenMP pools) by now that a fork would copy
    half-held; nor spawned, since every spawned worker imports for itself: on a GPU host
    16 of them had done 2% of a 6.7 MiB file 46 s in (bench/RESULTS-h200.md). The server
    ends with this process."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([tokenizing.__name__, type(tokenizer).__module__])
    return context


def load_prompts(path: Path, tokenizer, limit: int,
                 template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Held-out prompts: "text", or "messages" (a final assistant turn is dropped)."""
    prompts = []
    for number, row in _read_jsonl(path)[:limit]:
        if "messages" in row:
            messages = row["messages"]
            if messages and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            require_template(tokenizer, f"{path}:{number}")
            text = render(tokenizer, messages, True, template_kwargs or {}, f"{path}:{number}")
        elif "text" in row:
            text = row["text"]
        else:
            raise ValueError(f"{path}:{number}: expected a 'text' or a 'messages' key")
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


# Tokens a pass of anchor_counts reads from the store at once: its masks stay small.
_COUNT_CHUNK_TOKENS = 16 << 20


def anchor_counts(samples: Sequence[Sample]) -> np.ndarray:
    """(num samples,) int64: how many positions of each sample may anchor a block
    (objective.anchor_candidates), before drafter.num_anchors caps them. From a store,
    whole runs of samples at a time: the flat turn ids are read once, never sample by sample."""
    if not isinstance(samples, StoredSamples):
        return np.array([anchor_candidates(sample.turn_ids).numel() for sample in samples], dtype=np.int64)
    offsets, turn_ids = samples.store.offsets, samples.store.arrays["turn_ids"]
    counts = np.zeros(len(samples), dtype=np.int64)
    first = 0
    while first < len(samples):
        last = max(first + 1, int(np.searchsorted(offsets, offsets[first] + _COUNT_CHUNK_TOKENS, side="right")) - 1)
        last = min(last, len(samples))
        start = int(offsets[first])
        turns = np.asarray(turn_ids[start:int(offsets[last])])
        # pairs[p]: token p may anchor (learnt, and the next token is of its turn); the first
        # token of a sample and its last two never do (no context before, nothing after).
        pairs = (turns[:-1] != NO_TURN) & (turns[:-1] == turns[1:])
        running = np.concatenate([[0], np.cumsum(pairs, dtype=np.int64)])
        lo, hi = offsets[first:last] - start + 1, offsets[first + 1:last + 1] - start - 1
        counts[first:last] = np.where(hi > lo, running[np.maximum(hi, lo)] - running[lo], 0)
        first = last
    return counts


def micro_batch_shapes(plan: BatchPlan, entries: Iterator[PlanEntry], counts: np.ndarray, data: DataConfig,
                       drafter: DrafterConfig) -> tuple[BatchShape, ...]:
    """Every distinct (rows, padded length, blocks) that `collate` makes of `entries`,
    largest first: what a drafter's step must be ready for before it trains."""
    shapes = {BatchShape(len(entry.samples), padded_length(max(plan.lengths[i] for i in entry.samples), data.pad_multiple),
                         blocks_per_row(min(drafter.num_anchors, int(max(counts[i] for i in entry.samples))),
                                        drafter.num_anchors))
              for entry in entries}
    return tuple(sorted(shapes, key=lambda shape: (shape.tokens, shape), reverse=True))


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    epoch: int
    index: int  # micro-batch index within the epoch
    samples: tuple[int, ...]


class BatchPlan:
    """Which micro-batch every (step, micro-batch, replica) trains on.

    A step takes replicas x accumulate consecutive micro-batches of the epoch's packed
    order: micro-batch m of replica g of step s is entry ((s-1)*accumulate + m)*replicas + g,
    so every entry is used once, none skipped, and with accumulate 1 it is (s-1)*replicas + g.
    An epoch's tail that cannot fill a whole step (replicas x accumulate entries) is dropped."""

    def __init__(self, samples: Sequence[Sample], data: DataConfig, replicas: int, epochs: int,
                 max_steps: int | None, seed: int, accumulate: int = 1, drafter: DrafterConfig = DrafterConfig()):
        self.replicas, self.accumulate = replicas, accumulate
        per_step = replicas * accumulate
        self.entries: list[PlanEntry] = []
        # A store's lengths plan the batches without reading a token.
        lengths = self.lengths = (samples.lengths.tolist() if isinstance(samples, StoredSamples)
                                  else [len(sample.ids) for sample in samples])
        for epoch in range(epochs):
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
            batches = _pack(order.tolist(), lengths, data, drafter)
            usable = len(batches) - len(batches) % per_step  # every step feeds every replica every micro-batch
            self.entries += [PlanEntry(epoch, i, batch) for i, batch in enumerate(batches[:usable])]
        self.total_steps = len(self.entries) // per_step
        if max_steps is not None:
            self.total_steps = min(self.total_steps, max_steps)
        if self.total_steps == 0:
            raise ValueError(f"{len(samples)} samples make fewer micro-batches than the {replicas} drafters x "
                             f"{accumulate} accumulated need for one step; add data or lower data.token_budget")

    def entry(self, step: int, replica: int, micro: int = 0) -> PlanEntry:
        return self.entries[((step - 1) * self.accumulate + micro) * self.replicas + replica]

    def step_entries(self, step: int) -> list[PlanEntry]:
        """Every micro-batch of `step`, of every replica of the run."""
        start = (step - 1) * self.accumulate * self.replicas
        return self.entries[start:start + self.accumulate * self.replicas]

    def tokens(self, entry: PlanEntry) -> int:
        """The real (unpadded) tokens of a micro-batch, as its HostBatch counts them."""
        return sum(self.lengths[i] for i in entry.samples)

    def last_entry(self, step: int) -> PlanEntry:
        """The last micro-batch `step` uses: the data cursor a checkpoint of that step records."""
        return self.entry(step, self.replicas - 1, self.accumulate - 1)


def _pack(order: list[int], lengths: list[int], data: DataConfig, drafter: DrafterConfig) -> list[tuple[int, ...]]:
    batches, current, widest = [], [], 0
    for index in order:
        width = padded_length(lengths[index], data.pad_multiple)
        if current and len(current) + 1 > rows_per_micro_batch(data, drafter, max(widest, width)):
            batches.append(tuple(current))
            current, widest = [], 0
        current.append(index)
        widest = max(widest, width)
    if current:
        batches.append(tuple(current))
    return batches


@dataclasses.dataclass
class HostBatch:
    """One micro-batch as the prefetch thread hands it on (CPU, pinned for CUDA)."""

    step: int
    replica: int
    epoch: int
    input_ids: torch.Tensor  # (B, S) long, right-padded
    anchors: torch.Tensor  # (B, N) long
    anchor_valid: torch.Tensor  # (B, N) bool
    labels: torch.Tensor  # (B, N, bs-1) long
    weights: torch.Tensor  # (B, N, bs-1) float
    num_tokens: int  # real (unpadded) tokens
    num_samples: int
    micro: int = 0  # which of the step's optim.accumulate micro-batches of its replica

    def pin(self) -> "HostBatch":
        fields = ("input_ids", "anchors", "anchor_valid", "labels", "weights")
        return dataclasses.replace(self, **{f: getattr(self, f).pin_memory() for f in fields})


def collate(samples: Sequence[Sample], entry: PlanEntry, step: int, replica: int, data: DataConfig,
            drafter: DrafterConfig, pad_id: int, seed: int, micro: int = 0) -> HostBatch:
    chosen = [samples[i] for i in entry.samples]
    seq_len = padded_length(max(len(s.ids) for s in chosen), data.pad_multiple)
    input_ids = torch.full((len(chosen), seq_len), pad_id, dtype=torch.long)
    turn_ids = torch.full((len(chosen), seq_len), NO_TURN, dtype=torch.long)
    anchor_lists = []
    for row, (index, sample) in enumerate(zip(entry.samples, chosen)):
        input_ids[row, :len(sample.ids)] = sample.ids
        turn_ids[row, :len(sample.ids)] = sample.turn_ids
        generator = torch.Generator().manual_seed(anchor_seed(seed, entry.epoch, index))
        anchor_lists.append(sample_anchors(sample.turn_ids, drafter.num_anchors, generator))
    num_blocks = blocks_per_row(max(a.numel() for a in anchor_lists), drafter.num_anchors)
    anchors = torch.zeros((len(chosen), num_blocks), dtype=torch.long)
    anchor_valid = torch.zeros((len(chosen), num_blocks), dtype=torch.bool)
    for row, chosen_anchors in enumerate(anchor_lists):
        anchors[row, :chosen_anchors.numel()] = chosen_anchors
        anchor_valid[row, :chosen_anchors.numel()] = True
    # Labels and weights are made here, on the host: the compiled (and graphed) step only
    # ever sees the weights, so turns cost it no input.
    labels, weights = block_labels(input_ids, turn_ids, anchors, anchor_valid,
                                   position_weights(drafter.block_size, drafter.loss_gamma))
    return HostBatch(step=step, replica=replica, epoch=entry.epoch, input_ids=input_ids,
                     anchors=anchors, anchor_valid=anchor_valid, labels=labels, weights=weights,
                     num_tokens=sum(len(s.ids) for s in chosen), num_samples=len(chosen), micro=micro)
