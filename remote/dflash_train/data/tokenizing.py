"""A training jsonl's lines as token ids and turn ids, in the trainer or in the worker
processes that tokenize a large file in parallel (batches.py builds the store from them).

This module and chat.py import neither torch nor the model code: the server the workers
are forked from imports them, numpy and the tokenizer's class, and nothing more than
that class brings (which with some transformers releases is torch). Arrays are numpy;
batches.py makes tensors of them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dflash_files import procfs

from ..config import NO_TURN
from .chat import tokenize_chat

# jsonl bytes per tokenizing task, at most: about a thousand conversations of the recipe's
# length, which bounds each task's memory and its result's size.
MAX_CHUNK_BYTES = 4 << 20
# At least: a task of fewer bytes would cost more in the pool than it saves.
MIN_CHUNK_BYTES = 128 << 10
# A file of at most this many bytes is tokenized in the trainer. Workers come from a
# server that first imports the tokenizer's class: 4-5 s on a GPU host, where the trainer
# tokenized 0.2 MiB in 0.1 s (bench/RESULTS-h200.md).
IN_PROCESS_BYTES = 1 << 20
# Tasks per worker a file is cut into, so workers that finish early take more and none
# is left with a long tail.
TASKS_PER_WORKER = 4


def chunk_bytes_for(file_bytes: int, workers: int) -> int:
    """The size of a tokenizing task for a file of `file_bytes` and that many workers."""
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, -(-file_bytes // (workers * TASKS_PER_WORKER))))


def default_workers(file_bytes: int) -> int:
    """Tokenizing processes for a file: one per core this process may run on, or none
    (1: the trainer tokenizes it) for a file of at most IN_PROCESS_BYTES."""
    return 1 if file_bytes <= IN_PROCESS_BYTES else len(os.sched_getaffinity(0))


def parse_line(line: bytes, where: str) -> dict[str, Any] | None:
    """One jsonl line as its object, or None for a blank line."""
    try:
        text = line.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 ({exc})") from exc
    if not text:
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def tokenize_row(row: dict[str, Any], tokenizer, where: str,
                 template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """The row's token ids and their turns (tokenize_chat), before the cut at max_length."""
    truncated = row.get("truncated", False)
    if not isinstance(truncated, bool):
        raise ValueError(f"{where}: 'truncated' must be true or false, not {truncated!r}")
    if "messages" in row:
        return tokenize_chat(tokenizer, row["messages"], where, truncated, template_kwargs)
    if "text" in row:  # no template closes a text, truncated or not
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        return ids, [0] * len(ids)
    raise ValueError(f"{where}: expected a 'text' or a 'messages' key")


def has_anchor(turn_ids: np.ndarray) -> bool:
    """Whether a sequence (L,) has a position that may anchor a block: objective.py's
    anchor_candidates, non-empty (a token of a turn, not the first, followed by one of
    the same turn)."""
    middle = turn_ids[1:-1]
    return bool(np.any((middle != NO_TURN) & (middle == turn_ids[2:])))


def learnable(ids: list[int], turn_ids: list[int], max_length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, turn_ids), int32, cut to `max_length` tokens, or None when what is left has
    no anchor.

    A cut at max_length drops the end-of-turn with the rest, so nothing closes the
    answer inside the loss either way."""
    turns = np.asarray(turn_ids[:max_length], dtype=np.int32)
    return (np.asarray(ids[:max_length], dtype=np.int32), turns) if has_anchor(turns) else None


@dataclasses.dataclass
class RowCounts:
    """What the rows of a file were, for the message of a file that gives no sample."""
    rows: int = 0  # non-blank lines
    cut_out: int = 0  # rows with a learnable token only beyond max_length
    longest: int = 0  # tokens of the longest row, before the cut

    def add(self, other: RowCounts) -> None:
        self.rows += other.rows
        self.cut_out += other.cut_out
        self.longest = max(self.longest, other.longest)

    def nothing_learnable(self, path: Path, max_length: int) -> ValueError:
        if not self.rows:
            return ValueError(f"{path}: the file holds no conversation (it is empty)")
        over = (f"{self.cut_out} of {self.rows} conversations are longer than data.max_length {max_length} "
                f"(the longest {self.longest} tokens)")
        if self.cut_out == self.rows:
            return ValueError(f"{path}: {over}: cut there, none keeps a learnable token; raise "
                              "data.max_length or shorten them")
        return ValueError(f"{path}: no sample has a learnable (assistant or text) token followed by another of "
                          f"its turn, to anchor a block on" + (f"; {over}" if self.cut_out else ""))


def read_chunks(path: Path, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(whole lines of about chunk_bytes, the number of their first line), in file order."""
    with open(path, "rb") as f:
        first_line = 1
        while chunk := f.read(chunk_bytes):
            chunk += f.readline()  # on to the end of the line
            yield chunk, first_line
            first_line += chunk.count(b"\n")


ChunkResult = tuple[dict[str, np.ndarray], np.ndarray, RowCounts]
SAMPLE_ARRAYS = ("ids", "turn_ids")  # what a stored sample holds, in batches.Sample's order


@dataclasses.dataclass(frozen=True)
class ChunkTokenizer:
    """Tokenizes a chunk of jsonl lines into the store's form: per array, the samples'
    values concatenated, and the samples' lengths."""

    tokenizer: Any
    max_length: int
    path: str  # for messages
    template_kwargs: dict[str, Any]

    def __call__(self, chunk: tuple[bytes, int]) -> ChunkResult:
        data, first_line = chunk
        parts: dict[str, list[np.ndarray]] = {name: [] for name in SAMPLE_ARRAYS}
        lengths = []
        counts = RowCounts()
        for number, line in enumerate(data.split(b"\n"), first_line):
            where = f"{self.path}:{number}"
            row = parse_line(line, where)
            if row is None:
                continue
            ids, turn_ids = tokenize_row(row, self.tokenizer, where, self.template_kwargs)
            counts.rows, counts.longest = counts.rows + 1, max(counts.longest, len(ids))
            sample = learnable(ids, turn_ids, self.max_length)
            if sample is None:
                if len(ids) > self.max_length and has_anchor(np.asarray(turn_ids, dtype=np.int32)):
                    counts.cut_out += 1  # it had something to teach, past the cut
                continue
            for name, values in zip(SAMPLE_ARRAYS, sample):
                parts[name].append(values)
            lengths.append(len(sample[0]))
        if not lengths:
            return {}, np.zeros(0, dtype=np.int64), counts
        return ({name: np.concatenate(values) for name, values in parts.items()}, np.array(lengths, dtype=np.int64),
                counts)


_worker_tokenize: ChunkTokenizer | None = None  # set in each tokenizing process by start_worker


def start_worker(tokenize: ChunkTokenizer, trainer_pid: int, trainer_start: int | None) -> None:
    """A worker's start: the task object, and a watch on the trainer (its pid and its
    start time in /proc). A worker waits for tasks on a queue whose writing end it holds
    itself, so a trainer killed outright (SIGKILL, the OOM killer) would leave it waiting
    for ever: it ends when the trainer does."""
    global _worker_tokenize
    _worker_tokenize = tokenize
    watch = threading.Thread(target=_end_with, args=(trainer_pid, trainer_start), name="trainer-watch", daemon=True)
    watch.start()


def _end_with(trainer_pid: int, trainer_start: int | None) -> None:
    try:
        trainer = os.pidfd_open(trainer_pid)
    except ProcessLookupError:  # ended already
        os._exit(1)
    except OSError:  # no pidfd (Linux before 5.3): look once a second
        # By pid and start time, not kill(pid, 0): a killed trainer stays a zombie until
        # its parent reaps it, and its pid may then go to another process.
        while procfs.identity_alive(trainer_pid, trainer_start):
            time.sleep(1.0)
        os._exit(1)
    # The pidfd is of whatever process has that pid now: the trainer's only if it still
    # runs (neither a zombie nor gone, its pid then another's).
    if procfs.identity_alive(trainer_pid, trainer_start):
        select.select([trainer], [], [])  # readable once that process has ended
    os._exit(1)


def tokenize_in_worker(chunk: tuple[bytes, int]) -> ChunkResult:
    assert _worker_tokenize is not None
    return _worker_tokenize(chunk)
