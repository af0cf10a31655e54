"""The evaluator's decode at the hardware's speed: speculative and target-alone, greedy.

`FastDecoder` decodes one prompt at a time into buffers allocated once for `capacity`
positions (prompt + new tokens + a block):

* the target verifies a block through a static KV cache (model/static_target.py): one
  shape at every step, the rejected positions cut back by moving the next write position;
* the drafter keeps its context's keys and values (`drafter_cache`, the default): each
  verified block's target features are projected into every layer's keys and values
  once (modeling_dflash `extend_context`), at the positions just verified; the ones past
  the accepted length are overwritten by the next block's own keys, which a drafted block
  writes at its positions before attending to context and block (`draft_cached`); both
  run as functions of the drafter's fused weights (model/fast_drafter.py). Without
  the drafter cache the drafter re-projects the whole context at every block, as
  training's forward does (the comparison the tests make);
* a step's state stays on the device: the verify step computes the accepted length and
  moves the anchor position and token itself, so the host reads one small tensor a step
  (the drafts and the target's verdict: the tokens gained), and on CUDA it reads it a
  step late (`Readback`): the next step is launched first and runs while the host reads
  and acts on this one (on_step's reports included), so the GPU waits for no host work.
  The step launched past the decode's end (an end token, or max_new_tokens reached) is
  wasted, and moves state the next prefill sets anew; without the drafter cache the
  draft needs the host's context, so that decode reads each step before the next;
* with `compile_steps` (evaluate.compile / eval.compile, on CUDA), the steps' target layers
  (model/static_target.py) and the drafter's context extension and block
  (model/fast_drafter.py) run through `torch.compile`, compiled at their first run (the
  capture's warm-up): fused kernels make a step faster, for a compile in start-up
  (bench/RESULTS-h200.md, "Evaluation at the hardware's speed");
* on CUDA, with `cuda_graphs`, the draft step and the verify step (and the target-alone
  step) are CUDA graphs (model/decode_graphs.py), captured by `capture` (a training
  run's evaluator, in start-up) or at the first decode; the prefill, whose length
  varies, runs eagerly. Elsewhere the same functions run eagerly.

Stale entries in the buffers (a previous prompt's, a capture's warm-up runs') are never
read: every position a step attends to was written for the prompt being decoded. They
stay finite (the buffers start zeroed), which matters: SDPA adds its mask to the scores,
so a masked NaN key would still poison a row.

`decode` is lossless: the tokens are the target's greedy decode, and the acceptance is
the reference path's (model/speculative.py `speculative_decode`), which the tests check.
`decode_alone` is the baseline of the speed-up: the target alone through the same static
cache (and graphs), one token a forward, its token read a step late as `decode`'s
report is. Both time the decode from the prefill's end, the device synchronised, to the
host's read of the last token, as the reference benchmark does.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .decode_graphs import graphed
from .drafter import DFlashDrafter
from .fast_drafter import FastDrafter
from .objective import dense_block_mask
from .static_target import StaticTarget
from .target import FeatureTap


Probe = Callable[[str, Callable[[], None]], None]


@dataclasses.dataclass(frozen=True)
class Decoded:
    tokens: list[int]  # the new tokens
    accepted: list[int]  # tokens gained per verify forward (1 = only the bonus token); empty for the target alone
    seconds: float = 0.0  # from the prefill's end (device synchronised) to the host's read of the last token


class Readback:
    """A small device tensor read on the host without waiting for later work: `send(slot)`
    queues its copy into one of two host buffers behind the work launched so far,
    `receive(slot)` waits for that copy alone (on CUDA: pinned buffers and an event each;
    elsewhere the copy is made at once)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, cuda = tensor, tensor.device.type == "cuda"
        self.buffers = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None

    def send(self, slot: int) -> None:
        self.buffers[slot].copy_(self.tensor, non_blocking=self.events is not None)
        if self.events is not None:  # on the tensor's device's stream, whichever device is current
            self.events[slot].record(torch.cuda.current_stream(self.tensor.device))

    def receive(self, slot: int) -> list[int]:
        if self.events is not None:
            self.events[slot].synchronize()
        return self.buffers[slot].tolist()


def synchronize(device: torch.device) -> None:
    """Wait for the device's work (on CUDA), so that a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def draft_tokens(drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 features: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The drafter's training forward on one block (1, block_size) = [anchor, MASK...] whose
    context is `features` (1, start, n*H), the positions before the anchor: the drafted
    tokens (block_size-1,), on the device."""
    block_size, start = drafter.block_size, features.shape[1]
    device = features.device
    anchors = torch.tensor([[start]], device=device)
    mask = dense_block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), start, block_size)
    hidden = drafter(F.embedding(block, embed_weight), features, torch.arange(start, device=device).unsqueeze(0),
                     (start + torch.arange(block_size, device=device)).unsqueeze(0), mask)
    return F.linear(hidden[0, 1:], lm_head_weight.to(hidden.dtype)).argmax(-1)


def accepted_length(drafts: list[int], verdict: list[int]) -> int:
    """How many drafts agree with the target's choices before the first that does not."""
    agree = 0
    while agree < len(drafts) and drafts[agree] == verdict[agree]:
        agree += 1
    return agree


class FastDecoder:
    """The drafter is the decoder's own: with the drafter cache its projections are fused
    (model/fast_drafter.py), so it must be no module another thread trains (a snapshot
    loaded into it by load_state_dict is fine). `lm_head_weight` is kept in the drafter's
    dtype (cast once here, not per block).
    `overlap`: launch each step before reading the last (default: on CUDA, where the host
    then works while the GPU runs; elsewhere a launch runs at once, so it only adds the
    wasted step)."""

    def __init__(self, drafter: DFlashDrafter, tap: FeatureTap, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, capacity: int, cuda_graphs: bool = True, drafter_cache: bool = True,
                 compile_steps: bool = False, fuse: bool = False, overlap: bool | None = None):
        with torch.inference_mode():
            self.drafter, self.embed = drafter, embed_weight
            self.head = lm_head_weight.to(drafter.fc.weight.dtype)
            self.target = StaticTarget(tap, capacity, compile_steps=compile_steps, fuse=fuse)
            self.capacity, self.device = capacity, embed_weight.device
            size, device = drafter.block_size, self.device
            self.block_size = size
            # speculative state: the block [anchor, drafts...], the anchor's position, where the
            # last verified block began, its features, and the host's one read of a step
            self.block = torch.full((1, size), drafter.mask_token_id, dtype=torch.long, device=device)
            self.start = torch.zeros(1, dtype=torch.long, device=device)
            self.verified_start = torch.zeros(1, dtype=torch.long, device=device)
            width = len(tap.layer_ids) * tap.model.config.hidden_size
            self.features = torch.zeros(1, size, width, dtype=self.target.dtype, device=device)
            self.report = torch.zeros(2 * size - 1, dtype=torch.long, device=device)
            self.offsets = torch.arange(size, device=device)
            self.drafter_kv = drafter.context_cache(capacity) if drafter_cache else None
            self.context: torch.Tensor | None = None  # without the drafter cache: every context position's features
            # target-alone state: the newest token and its position
            self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
            self.position = torch.zeros(1, dtype=torch.long, device=device)
            self.report_readback, self.token_readback = Readback(self.report), Readback(self.token.view(1))
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self.compiled = compile_steps
        self.fast_drafter = FastDrafter(drafter, capacity, compile_steps) if drafter_cache else None
        self._steps: dict[str, Callable[[], None]] = {}

    def _step(self, name: str, step: Callable[[], None]) -> Callable[[], None]:
        """The step, graphed at its first use when graphs are on."""
        if name not in self._steps:
            self._steps[name] = graphed(step, self.device) if self.cuda_graphs else step
        return self._steps[name]

    @torch.inference_mode()
    def capture(self, alone: bool = True) -> None:
        """Capture the steps' graphs now (no-op without them), rather than at the first
        decode: a training run's evaluator does it in start-up, before other threads run
        on the GPU. `alone`: the target-alone step's too."""
        if self.drafter_kv is not None:
            self._step("draft", self._draft)
        self._step("verify", self._verify)
        if alone:
            self._step("alone", self._alone)

    def _check_room(self, prompt: list[int], max_new_tokens: int) -> None:
        need = len(prompt) + max_new_tokens + self.block_size
        if need > self.capacity:
            raise ValueError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones need {need} positions; "
                             f"the decoder holds {self.capacity}")

    def _prefill(self, prompt: list[int], features: bool) -> tuple[int, torch.Tensor | None]:
        positions = torch.arange(len(prompt), device=self.device)
        logits, tapped = self.target.forward(torch.tensor([prompt], device=self.device), positions,
                                             last_logits_only=True, features=features)
        first = logits[0, -1].argmax(-1)
        return int(first), tapped

    # -- speculative ---------------------------------------------------------------------------

    def _draft(self) -> None:
        """Drafts into block[1:]: the last verified block's features join the context first."""
        self.block[:, 1:] = self.drafter.mask_token_id
        if self.drafter_kv is None:
            self.block[0, 1:] = draft_tokens(self.drafter, self.embed, self.head, self.context, self.block)
            return
        self.fast_drafter.extend(self.features, self.verified_start + self.offsets, self.drafter_kv, step=True)
        self.block[0, 1:] = self.fast_drafter.drafts(F.embedding(self.block, self.embed), self.start + self.offsets,
                                                     self.drafter_kv, self.head)

    def _verify(self) -> None:
        """The target on the block; the gained tokens into `report`; the state moved on."""
        size = self.block_size
        logits, features = self.target.forward(self.block, self.start + self.offsets, step=True)
        verdict = logits[0].argmax(-1)  # the target's choice after each block position
        drafts = self.block[0, 1:]
        self.report[:size - 1] = drafts
        self.report[size - 1:] = verdict
        self.features.copy_(features)
        agree = (drafts == verdict[:-1]).long().cumprod(0).sum()
        self.verified_start.copy_(self.start)
        self.start.add_(agree + 1)
        self.block[0, :1] = verdict.gather(0, agree.view(1))  # the bonus token: the next anchor

    def _reads(self, launch: Callable[[], None], readback: Readback, tokens: list[int], max_new_tokens: int,
               stop_ids: set[int], may_overlap: bool) -> Iterator[list[int]]:
        """Each step's read (`readback` after `launch`) until `tokens`, which the caller
        extends from each read before asking for the next, reach max_new_tokens or end in a
        stop id. With overlap (and `may_overlap`), the next step is launched before this
        one is read, unless this one surely ends the decode (every step gains a token)."""
        def done() -> bool:
            return len(tokens) >= max_new_tokens or tokens[-1] in stop_ids

        def step_into(slot: int) -> None:
            launch()
            readback.send(slot)

        slot = 0
        if done():
            return
        step_into(slot)
        while True:
            ahead = self.overlap and may_overlap and len(tokens) + 1 < max_new_tokens
            if ahead:
                step_into(1 - slot)
            yield readback.receive(slot)  # the step's one host sync
            slot = 1 - slot
            if done():
                return
            if not ahead:
                step_into(slot)

    @torch.inference_mode()
    def decode(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
               on_step: Callable[[], None] = lambda: None, probe: Probe | None = None) -> Decoded:
        """`on_step` runs after every verify step (progress reports; it may raise to stop).
        `probe(name, step)`, when given, runs each step ("draft", "verify") in its place: a
        bench times them with it."""
        self._check_room(prompt, max_new_tokens)
        # Before the prefill: a first use captures the steps, whose warm-up runs move the state
        # on (the prefill then sets all of it).
        # Without the drafter cache the draft's shape grows with the context: never graphed.
        draft = self._step("draft", self._draft) if self.drafter_kv is not None else self._draft
        verify = self._step("verify", self._verify)
        first, features = self._prefill(prompt, features=True)
        assert features is not None
        if self.drafter_kv is not None:
            self.fast_drafter.extend(features, torch.arange(len(prompt), device=self.device), self.drafter_kv)
        else:
            self.context = features
        self.start.fill_(len(prompt))
        self.verified_start.fill_(len(prompt))  # the first draft's context extension is overwritten by its block
        self.features.zero_()
        self.block[0, 0] = first
        tokens, accepted, size = [first], [], self.block_size
        synchronize(self.device)
        started = time.perf_counter()
        if probe is not None:
            draft, verify = (lambda step=draft: probe("draft", step)), (lambda step=verify: probe("verify", step))

        def launch() -> None:
            draft()
            verify()

        # without the drafter cache a draft needs the context the host adds after each read
        for report in self._reads(launch, self.report_readback, tokens, max_new_tokens, stop_ids,
                                  self.drafter_kv is not None):
            drafts, verdict = report[:size - 1], report[size - 1:]
            agree = accepted_length(drafts, verdict)
            gained = drafts[:agree] + [verdict[agree]]
            accepted.append(len(gained))
            if self.context is not None:
                self.context = torch.cat([self.context, self.features[:, :agree + 1]], dim=1)
            stop = next((i for i, token in enumerate(gained) if token in stop_ids), None)
            tokens += gained if stop is None else gained[:stop + 1]
            on_step()
        seconds = time.perf_counter() - started
        self.context = None
        return Decoded(tokens[:max_new_tokens], accepted, seconds)

    # -- the target alone ----------------------------------------------------------------------

    def _alone(self) -> None:
        logits, _ = self.target.forward(self.token, self.position, features=False, step=True)
        self.token.view(1).copy_(logits[0, -1].argmax(-1).view(1))
        self.position.add_(1)

    @torch.inference_mode()
    def decode_alone(self, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                     on_step: Callable[[], None] = lambda: None) -> Decoded:
        """The target's greedy decode, one token a forward; `on_step` after every forward."""
        self._check_room(prompt, max_new_tokens)
        step = self._step("alone", self._alone)  # before the prefill, as in `decode`
        first, _ = self._prefill(prompt, features=False)
        self.token.fill_(first)
        self.position.fill_(len(prompt))
        tokens = [first]
        synchronize(self.device)
        started = time.perf_counter()
        for token in self._reads(step, self.token_readback, tokens, max_new_tokens, stop_ids, True):
            tokens += token
            on_step()
        return Decoded(tokens, [], time.perf_counter() - started)
