"""Training data: jsonl -> token ids with assistant-turn ids -> token-budget micro-batches.

A line holds either {"text": ...} (every token is learnt) or {"messages": [...]} (the
tokenizer's chat template; only assistant tokens are learnt, each turn on its own: a
block never learns across a user turn, see objective.py). `"truncated": true` says the
final assistant answer was cut (at max_new_tokens when it was generated): the
end-of-turn the template closes it with, and all it renders after, is never learnt, as
the target never produced it. The batch plan is fixed by
the seed: every epoch shuffles the samples with its own seed and packs them greedily into
micro-batches of at most `token_budget` padded tokens. Step s of replica r uses plan entry
(s-1)*replicas + r, so a resumed run reads exactly what the uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from .config import DataConfig, DrafterConfig, padded_length
from .objective import NO_TURN, anchor_candidates, anchor_seed, block_labels, position_weights, sample_anchors


@dataclasses.dataclass(frozen=True)
class Sample:
    ids: torch.Tensor  # (L,) int32: half the memory of long for a dataset held whole
    turn_ids: torch.Tensor  # (L,) int32: the assistant turn a token is learnt in, NO_TURN if none


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append((number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
    return rows


def _render(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _answer_end(tokenizer, messages: list[dict[str, Any]], text: str, where: str) -> int:
    """Character offset in `text` (the rendered conversation) where the final assistant
    message's content ends: what the template appends from there on (its end-of-turn
    token, a newline) is not the model's.

    The content is rendered again with a probe character appended; the renderings agree
    up to the content's end. Two probes, so a template whose text after the content
    starts with one of them still gives the exact end."""
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise ValueError(f"{where}: 'truncated' needs the last message's content to be a string")
    ends = []
    for probe in ("\x01", "\x02"):
        probed = _render(tokenizer, messages[:-1] + [{**messages[-1], "content": content + probe}], False)
        if probed == text:
            raise ValueError(f"{where}: the chat template does not render the last message's content, so "
                             "where the truncated answer ends cannot be located")
        ends.append(len(os.path.commonprefix([text, probed])))
    return min(ends)


def tokenize_chat(tokenizer, messages: list[dict[str, Any]], where: str,
                  truncated: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and, per token, the index of the assistant
    turn that wrote it (NO_TURN for every other token).

    An assistant turn spans from the end of the conversation before it (rendered with
    the generation prompt) to the end of the conversation including it -- or, for the
    final answer when `truncated`, to the end of its content; tokens are assigned to
    spans by their character offsets."""
    text = _render(tokenizer, messages, False)
    if truncated and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError(f"{where}: 'truncated' is true but the last message is not the assistant's")
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[:i + 1], False)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(f"{where}: the chat template does not render turn {i} as a prefix of the "
                             "whole conversation, so its assistant tokens cannot be located")
        end = _answer_end(tokenizer, messages, text, where) if truncated and i == len(messages) - 1 else len(through)
        spans.append((len(before), end))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    turn_ids = [next((turn for turn, (lo, hi) in enumerate(spans) if lo <= start < hi), NO_TURN)
                for start, _ in encoded["offset_mapping"]]
    return encoded["input_ids"], turn_ids


def tokenize_sample(row: dict[str, Any], tokenizer, max_length: int, where: str) -> Sample | None:
    """One jsonl row as a training sample, cut to `max_length` tokens; None when it has
    no anchor (nothing it could teach).

    A cut at max_length drops the end-of-turn with the rest, so nothing closes the
    answer inside the loss either way."""
    truncated = row.get("truncated", False)
    if not isinstance(truncated, bool):
        raise ValueError(f"{where}: 'truncated' must be true or false, not {truncated!r}")
    if "messages" in row:
        ids, turn_ids = tokenize_chat(tokenizer, row["messages"], where, truncated)
    elif "text" in row:  # no template closes a text, truncated or not
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        turn_ids = [0] * len(ids)
    else:
        raise ValueError(f"{where}: expected a 'text' or a 'messages' key")
    sample = Sample(torch.tensor(ids[:max_length], dtype=torch.int32),
                    torch.tensor(turn_ids[:max_length], dtype=torch.int32))
    return sample if anchor_candidates(sample.turn_ids).numel() else None


def load_samples(path: Path, tokenizer, max_length: int) -> list[Sample]:
    samples = []
    for number, row in _read_jsonl(path):
        sample = tokenize_sample(row, tokenizer, max_length, f"{path}:{number}")
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ValueError(f"{path}: no sample has a learnable (assistant or text) token followed by "
                         "another of its turn, to anchor a block on")
    return samples


def load_prompts(path: Path, tokenizer, limit: int) -> list[list[int]]:
    """Held-out prompts: "text", or "messages" (a final assistant turn is dropped)."""
    prompts = []
    for number, row in _read_jsonl(path)[:limit]:
        if "messages" in row:
            messages = row["messages"]
            if messages and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            text = _render(tokenizer, messages, True)
        elif "text" in row:
            text = row["text"]
        else:
            raise ValueError(f"{path}:{number}: expected a 'text' or a 'messages' key")
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def blocks_per_row(most_anchors: int, num_anchors: int) -> int:
    """Blocks every row of a micro-batch gets: the most anchors a row has, rounded up to 8
    so few distinct shapes occur, never past drafter.num_anchors."""
    return min(num_anchors, padded_length(most_anchors, 8))


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    epoch: int
    index: int  # micro-batch index within the epoch
    samples: tuple[int, ...]


class BatchPlan:
    def __init__(self, samples: list[Sample], data: DataConfig, replicas: int, epochs: int,
                 max_steps: int | None, seed: int):
        self.replicas = replicas
        self.entries: list[PlanEntry] = []
        for epoch in range(epochs):
            order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
            batches = _pack([int(i) for i in order], samples, data)
            usable = len(batches) - len(batches) % replicas  # every step feeds every replica
            self.entries += [PlanEntry(epoch, i, batch) for i, batch in enumerate(batches[:usable])]
        self.total_steps = len(self.entries) // replicas
        if max_steps is not None:
            self.total_steps = min(self.total_steps, max_steps)
        if self.total_steps == 0:
            raise ValueError(f"{len(samples)} samples make fewer micro-batches than the {replicas} "
                             "drafters need for one step; add data or lower data.token_budget")

    def entry(self, step: int, replica: int) -> PlanEntry:
        return self.entries[(step - 1) * self.replicas + replica]

    def last_entry(self, step: int) -> PlanEntry:
        """The last micro-batch `step` uses: the data cursor a checkpoint of that step records."""
        return self.entry(step, self.replicas - 1)


def _pack(order: list[int], samples: list[Sample], data: DataConfig) -> list[tuple[int, ...]]:
    batches, current, widest = [], [], 0
    for index in order:
        width = padded_length(len(samples[index].ids), data.pad_multiple)
        if current and (len(current) + 1) * max(widest, width) > data.token_budget:
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

    def pin(self) -> "HostBatch":
        fields = ("input_ids", "anchors", "anchor_valid", "labels", "weights")
        return dataclasses.replace(self, **{f: getattr(self, f).pin_memory() for f in fields})


def collate(samples: list[Sample], entry: PlanEntry, step: int, replica: int, data: DataConfig,
            drafter: DrafterConfig, pad_id: int, seed: int) -> HostBatch:
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
                     num_tokens=sum(len(s.ids) for s in chosen), num_samples=len(chosen))
