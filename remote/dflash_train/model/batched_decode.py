"""Many prompts decoded at once by the target: slots, continuous batching, graphed steps.

`BatchedDecoder` answers a stream of prompts on one device, as serving engines do:

* a KV cache of `slots` rows, each for `capacity` positions (the longest prompt plus
  max_new_tokens), allocated once (fast_layers.FastLayers.kv_cache);
* a decode step advances every row by one token: the target's layers over the rows'
  newest tokens at their own positions, attention reading each row's keys up to its own
  position (fast_layers.step_attention, from positions set on the device; without
  compiling, SDPA over the first L positions, L the smallest multiple of
  `length_step` past every live row's position), and the next tokens chosen on the device
  (model/sampling.py); one host read per step;
* the step's state (tokens, positions, which rows are live, sampling counters) stays on
  the device, so on CUDA the step (for each L) is a CUDA graph, captured in `warm_up`, with
  its layer functions compiled once for the one step shape (slots, 1): nothing compiles
  once warm_up returns;
* a row whose answer ended (an end token, or max_new_tokens) takes the next prompt at
  once: the prompts waiting are prefilled together, right-padded to a multiple of 64 in
  chunks of about `prefill_tokens` tokens, and causal attention over their own positions
  is their whole mask. Compiling, the prefill's layer functions are compiled with their
  rows and width symbolic (one graph for one row, one for several), in `warm_up` too, at
  the corners of the shapes a prefill can take; its attention stays eager.

Stale keys and values (a row's previous prompt, the padding of a prefill, the warm-up's)
are never attended to: a row attends to positions up to its own, and each of those was
written for its current prompt before the step that reads it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

from ..config import SamplingConfig
from ..memory.plan import PREFILL_TOKENS
from .decode_graphs import graphed
from . import fast_layers
from .fast_layers import (FLEX_BLOCK, FastLayers, attend, attend_causal, compile_step, output_and_mlp,
                          project_and_store, run_layers)
from .sampling import Chooser

PAD_MULTIPLE = 64  # a prefill row's length is rounded up to this
# Graphs a decoder compiles of one layer function: the step's, and the prefill's for one
# row and for several, with one to spare.
GRAPHS_PER_DECODER = 4


@dataclasses.dataclass(frozen=True)
class Request:
    index: int  # the prompt's index: the key of its sampling noise
    tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Generated:
    index: int
    tokens: list[int]  # the answer, the end token left out
    ended: bool  # an end token came (else max_new_tokens cut it)
    count: int  # tokens generated, the end token included


@dataclasses.dataclass
class _Row:
    request: Request
    tokens: list[int]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class BatchedDecoder:
    def __init__(self, model: torch.nn.Module, slots: int, capacity: int, max_new_tokens: int, stop_ids: set[int],
                 sampling: SamplingConfig | None, compile_steps: bool = True, cuda_graphs: bool = True,
                 length_step: int = 256, prefill_tokens: int = PREFILL_TOKENS, attention: str = "auto"):
        """`compile_steps` and `cuda_graphs` apply on CUDA only. `fuse`s the model's
        projections: the model must be this decoder's alone. `attention`: "split" or
        "flex" reads each row's keys up to its own position (fast_layers.step_attention:
        compiled steps on CUDA only), "sdpa" every row's up to the step's attention
        length; "auto": fast_layers.STEP_ATTENTION when compiling on CUDA, else sdpa."""
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.layers = FastLayers(model, compile_steps=compile_steps and on_cuda, fuse=True)
        self.attention = attention if attention != "auto" else \
            fast_layers.STEP_ATTENTION if self.layers.compiled else "sdpa"
        per_row = self.attention in fast_layers.STEP_ATTENTIONS
        multiple = FLEX_BLOCK if per_row else PAD_MULTIPLE
        self.slots, self.capacity = slots, round_up(capacity, multiple)
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.length_step, self.prefill_tokens = length_step, prefill_tokens
        self.cuda_graphs = cuda_graphs and on_cuda
        device = self.device = self.layers.device
        self.chooser = Chooser(sampling, model.config.vocab_size, device)
        # the step's choice over (slots, vocabulary): a dozen elementwise passes when sampling
        self._step_choose = compile_step(self.chooser.choose, one_token=True) if self.layers.compiled else self.chooser.choose
        # the prefill's shapes (rows, width) vary: its functions are compiled with those
        # sizes symbolic (_prefill_rows marks them), a graph serving every shape of a class
        self._prefill_project, self._prefill_output = (
            (torch.compile(project_and_store), torch.compile(output_and_mlp)) if self.layers.compiled
            else (project_and_store, output_and_mlp))
        self.keys, self.values = self.layers.kv_cache(slots, self.capacity)
        self.cos, self.sin = self.layers.rope_table(self.capacity)
        self.key_index = torch.arange(self.capacity, device=device)
        self.rows = torch.arange(slots, device=device)
        # the step's state: each row's newest token and its position, whether the row is
        # live (1) or free (0), and its prompt index and token count for the sampling noise
        zeros = lambda: torch.zeros(slots, dtype=torch.long, device=device)  # noqa: E731
        self.token, self.position, self.live, self.prompt_index, self.count = (zeros() for _ in range(5))
        self.chosen = zeros()
        self._steps: dict[int, Callable[[], None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._per_row = fast_layers.step_attention(self.attention, slots, 1, self.capacity, device,
                                                   self.layers.geometry) if per_row else None

    def lengths(self) -> list[int]:
        """The attention lengths the steps use: multiples of length_step up to capacity
        (per-row attention: the capacity alone, each row's own length being read on the device)."""
        if self._per_row is not None:
            return [self.capacity]
        return sorted({min(round_up(n, self.length_step), self.capacity)
                       for n in range(self.length_step, self.capacity + self.length_step, self.length_step)})

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile and capture the step for every attention length now, with no row live
        (the state moves nowhere), and compile the prefill at the corners of its shapes:
        the decode after this compiles nothing."""
        for length in self.lengths():
            self._step_for(length)
        if self.layers.compiled:
            for rows, width in self.prefill_corners():
                # a prompt of `width` tokens in `rows` slots: what it writes there is stale
                # before any prompt is admitted
                request = Request(0, (0,) * width)
                self._prefill_rows(list(range(rows)), [request] * rows, width)

    def prefill_corners(self) -> list[tuple[int, int]]:
        """(rows, width) at the corners of the prefill shapes `_prefill` makes: the
        narrowest and widest row, one row and as many as a chunk takes. Dynamo gives a
        dimension of 1 a graph of its own, and any guard Inductor puts on a size shows at
        a corner."""
        corners = []
        for width in sorted({PAD_MULTIPLE, self.capacity}):
            most = min(self.slots, max(self.prefill_tokens, width) // width)
            corners += [(rows, width) for rows in sorted({1, min(2, most), most})]
        return corners

    def _step_for(self, length: int) -> Callable[[], None]:
        if length not in self._steps:
            step = lambda: self._step(length)  # noqa: E731
            self._steps[length] = graphed(step, self.device, self._pool) if self.cuda_graphs else step
        return self._steps[length]

    def _step(self, length: int) -> None:
        """One token for every row (free rows compute too, and move nowhere)."""
        layers, g = self.layers, self.layers.geometry
        at = self.position.unsqueeze(1)  # (S, 1)
        hidden = layers.embed(self.token.unsqueeze(1))  # (S, 1, hidden)
        cos, sin = self.cos[at], self.sin[at]  # (S, 1, D)
        if self._per_row is not None:
            self._per_row.set(at)
            attention = self._per_row
        else:
            seen = (self.key_index[:length] <= at).unsqueeze(1)  # (S, 1, L)

            def attention(q, keys, values, scale):
                return attend(q, keys[:, :, :length], values[:, :, :length], seen, scale)
        hidden, _ = run_layers(layers.token, hidden, layers.weights, self.keys, self.values, g, cos, sin, self.rows,
                               at, attention)
        logits = layers.final(hidden, layers.token)[:, 0]  # (S, V)
        self.chosen.copy_(self._step_choose(logits, self.prompt_index, self.count))
        self.token.copy_(self.chosen)
        self.position.add_(self.live)
        self.count.add_(self.live)

    @torch.inference_mode()
    def _prefill(self, slots: list[int], requests: list[Request]) -> list[int]:
        """The requests' prompts into their slots' caches; their first tokens."""
        firsts: dict[int, int] = {}
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].tokens))
        while order:
            longest = min(round_up(len(requests[order[0]].tokens), PAD_MULTIPLE), self.capacity)
            chunk = []
            for i in order:  # shortest first: add rows while their padded tokens fit
                width = min(round_up(len(requests[i].tokens), PAD_MULTIPLE), self.capacity)
                if chunk and (len(chunk) + 1) * width > max(self.prefill_tokens, width):
                    break
                chunk.append(i)
                longest = width
            order = order[len(chunk):]
            chosen = self._prefill_rows([slots[i] for i in chunk], [requests[i] for i in chunk], longest)
            firsts.update(zip(chunk, chosen))
        return [firsts[i] for i in range(len(requests))]

    def _prefill_rows(self, slots: list[int], requests: list[Request], width: int) -> list[int]:
        layers, g, device = self.layers, self.layers.geometry, self.device
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, :len(request.tokens)] = torch.tensor(request.tokens)
        rows = torch.tensor(slots, device=device)
        at = torch.arange(width, device=device).unsqueeze(0).expand(len(requests), width).contiguous()
        hidden = layers.embed(ids.to(device))  # (P, W, hidden)
        cos, sin = self.cos[at], self.sin[at]
        if layers.compiled:
            for tensor in (hidden, cos, sin, at):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
            torch._dynamo.maybe_mark_dynamic(rows, 0)
        try:
            for w, keys, values in zip(layers.weights, self.keys, self.values):
                q = self._prefill_project(hidden, w, g, cos, sin, keys, values, rows, at)
                attention = attend_causal(q, keys[rows, :, :width], values[rows, :, :width], g.scale)  # (P, H, W, D)
                if layers.compiled:
                    torch._dynamo.maybe_mark_dynamic(attention, 0)
                    torch._dynamo.maybe_mark_dynamic(attention, 2)
                hidden = self._prefill_output(attention, hidden, w, g)
        except torch._dynamo.exc.RecompileError as exc:  # policy.forbid_compiles refused a compile
            raise RuntimeError(f"the prefill of {len(requests)} rows of {width} tokens would compile after "
                                   f"warm-up (a shape prefill_corners did not foresee): {exc}") from exc
        last = torch.tensor([len(r.tokens) - 1 for r in requests], device=device)
        logits = layers.final(hidden[torch.arange(len(requests), device=device), last])  # (P, V)
        index = torch.tensor([r.index for r in requests], device=device)
        return self.chooser.choose(logits, index, torch.zeros_like(index)).tolist()

    def _set(self, slots: list[int], **values: list[int]) -> None:
        where = torch.tensor(slots, device=self.device)
        for name, column in values.items():
            getattr(self, name).index_copy_(0, where, torch.tensor(column, device=self.device))

    def _finished(self, row: _Row) -> Generated | None:
        tokens = row.tokens
        if tokens[-1] in self.stop_ids:
            return Generated(row.request.index, tokens[:-1], True, len(tokens))
        if len(tokens) >= self.max_new_tokens:
            return Generated(row.request.index, tokens, False, len(tokens))
        return None

    def check_room(self, request: Request) -> None:
        need = len(request.tokens) + self.max_new_tokens
        if need > self.capacity:
            raise ValueError(f"prompt {request.index} has {len(request.tokens)} tokens: with max_new_tokens "
                             f"{self.max_new_tokens} it needs {need} positions; the decoder's rows hold "
                             f"{self.capacity}")

    @torch.inference_mode()
    def run(self, requests: Iterator[Request], deliver: Callable[[list[Generated]], None],
            on_step: Callable[[], None] = lambda: None, stopping: Callable[[], bool] = lambda: False) -> None:
        """Answer `requests` (taken as rows free up) until there are none or `stopping()`;
        then the answers being decoded are finished. `deliver` gets the answers that ended
        together (at one step, or at their first token), `on_step` runs after every decode
        step (it may raise to abort)."""
        live: dict[int, _Row] = {}
        exhausted = False
        while True:
            free = [slot for slot in range(self.slots) if slot not in live]
            admitted: list[tuple[int, Request]] = []
            while free and not exhausted and not stopping():
                request = next(requests, None)
                if request is None:
                    exhausted = True
                    break
                self.check_room(request)
                admitted.append((free.pop(0), request))
            if admitted:
                slots = [slot for slot, _ in admitted]
                firsts = self._prefill(slots, [request for _, request in admitted])
                started, ended_at_once = [], []
                for (slot, request), first in zip(admitted, firsts):
                    row = _Row(request, [first])
                    if (done := self._finished(row)) is not None:
                        ended_at_once.append(done)
                    else:
                        live[slot] = row
                        started.append(slot)
                if ended_at_once:
                    deliver(ended_at_once)
                if started:
                    self._set(started, token=[live[s].tokens[0] for s in started],
                              position=[len(live[s].request.tokens) for s in started],
                              prompt_index=[live[s].request.index for s in started],
                              count=[1] * len(started), live=[1] * len(started))
                continue  # more rows may be free (answers that ended at their first token)
            if not live:
                return
            furthest = max(len(row.request.tokens) + len(row.tokens) for row in live.values())
            length = self.capacity if self._per_row is not None else \
                min(round_up(furthest, self.length_step), self.capacity)
            self._step_for(length)()
            chosen = self.chosen.tolist()  # the step's one host read
            ended, answers = [], []
            for slot, row in live.items():
                row.tokens.append(chosen[slot])
                if (done := self._finished(row)) is not None:
                    answers.append(done)
                    ended.append(slot)
            for slot in ended:
                del live[slot]
            if ended:
                self._set(ended, live=[0] * len(ended), position=[0] * len(ended))
                deliver(answers)
            on_step()
