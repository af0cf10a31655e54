"""job: regenerate: answer a prompts file with the target itself; the answers are a data.train file.

The published DFlash recipe trains the drafter on responses the target wrote, so this job
runs the target over every prompt (its own chat template, greedy or sampled) and appends
one line per prompt to `regenerate.output`:

    {"index": 17, "messages": [...the prompt's turns, {"role": "assistant", "content": answer}],
     "truncated": false}

`index` is the prompt's position among the prompts file's non-blank lines; `truncated` is
true when the answer was cut at max_new_tokens (no end-of-turn token was generated).

One worker thread per entry of devices.target (`target-i`) decodes `batch_size` prompts at
once with its own copy of the target (model/batched_decode.py: a KV cache of batch_size
rows, graphed decode steps, and a row whose answer ended takes the next prompt at once).
Answers are appended in prompt order, whole lines, flushed and fsynced as they are
written, so a relaunch with the same config resumes: it reads the output, drops a partial
last line (a kill during a write), checks that every line answers the prompt of its index,
and answers only the rest, so no prompt is answered twice or skipped. Sampled answers
draw noise keyed by the prompt's index (model/sampling.py), so a resumed or re-batched job
draws what an unbroken one would. SIGTERM: no new prompt is started, the answers being
decoded are finished and written, and the job exits 128+signal.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from dflash_events import PROGRESS

from ..compiling.policy import forbid_compiles
from ..config import JobConfig, resolve_path
from ..data.batches import _read_jsonl
from ..devices import canonical, is_cuda, thread_stream
from ..faults import FaultInjector
from ..model.batched_decode import PAD_MULTIPLE, BatchedDecoder, Generated, Request, round_up
from ..model.target import load_target
from ..runlog import EventLog, say
from ..threads import StopLatch, StopRequested, JobThread
from .common import (EXIT_FAILED, EXIT_OK, JobControl, ThreadFailed, report_threads_still_running, sources,
                   torch_threads)


GIB = 1 << 30
PROGRESS_EVERY_S = 1.0  # at most one progress event a second: answers end many a second
SAMPLING_PASSES = 4  # fp32 copies of a row's logits a step's choice holds at once
PREFILL_TOKENS = 8192  # BatchedDecoder's default prefill chunk
PREFILL_WIDTHS = 8  # hidden-sized activations a prefill layer holds at once (q/k/v, residual, norms)


class RegenerateError(ValueError):
    """The prompts file or the output to resume is not what the job can use."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int  # position among the prompts file's non-blank lines: the key of its answer
    line: int
    messages: tuple[dict[str, Any], ...]


def read_prompts(path: Path) -> list[Prompt]:
    """A "text" line is one user turn; a "messages" line loses a final assistant turn (it is re-answered)."""
    prompts = []
    for index, (number, row) in enumerate(_read_jsonl(path)):
        where = f"{path}:{number}"
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            messages = list(row["messages"])
            if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise RegenerateError(f"{where}: 'messages' must be a list of turns with a 'role', "
                                      "not ending in the only assistant turn")
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            messages = [{"role": "user", "content": row["text"]}]
        else:
            raise RegenerateError(f"{where}: expected a 'text' string or a 'messages' list")
        prompts.append(Prompt(index, number, tuple(messages)))
    if not prompts:
        raise RegenerateError(f"{path}: no prompt (the file has no non-blank line)")
    return prompts


def answered_indices(path: Path, prompts: list[Prompt]) -> set[int]:
    """The prompts the output at `path` already answers. A partial last line (the process was
    killed while writing it) is cut off; any other line that is not an answer of these
    prompts is an error, since appending to another job's output would corrupt both."""
    if not path.exists():
        return set()
    with open(path, "r+b") as f:
        data = f.read()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            say(f"{path}: dropping a partial last line ({len(data) - whole} bytes) of an interrupted write")
            f.truncate(whole)
            f.flush()
            os.fsync(f.fileno())
    answered: set[int] = set()
    for number, raw in enumerate(data[:whole].split(b"\n")[:-1], 1):
        where = f"{path}:{number}"
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise RegenerateError(f"{where}: not JSON ({exc}); this output cannot be resumed") from exc
        index = row.get("index") if isinstance(row, dict) else None
        if not isinstance(index, int) or not 0 <= index < len(prompts):
            raise RegenerateError(f"{where}: no prompt index in 0..{len(prompts) - 1}; this output belongs to "
                                  "another prompts file (give regenerate.output a new path)")
        if index in answered:
            raise RegenerateError(f"{where}: prompt {index} is answered twice")
        if tuple(row.get("messages", ())[:-1]) != prompts[index].messages:
            raise RegenerateError(f"{where}: answers prompt {index}, but its turns differ from line "
                                  f"{prompts[index].line} of the prompts file; this output belongs to another "
                                  "prompts file (give regenerate.output a new path)")
        answered.add(index)
    return answered


@dataclasses.dataclass(frozen=True)
class Answer:
    prompt: Prompt
    text: str
    truncated: bool
    tokens: int  # generated, the end-of-turn token included

    def line(self) -> str:
        messages = [*self.prompt.messages, {"role": "assistant", "content": self.text}]
        return json.dumps({"index": self.prompt.index, "messages": messages, "truncated": self.truncated},
                          ensure_ascii=False) + "\n"


class AnswerWriter:
    """Appends answers to the output in prompt order (an answer that ends before an earlier
    prompt's waits for it), whole lines, flushed and fsynced per write; reports progress:
    a `progress` event at most every PROGRESS_EVERY_S and at the last answer, and a log
    line for every `log_every` x batch_size answers and at the last."""

    def __init__(self, path: Path, order: list[int], total: int, already: int, events: EventLog,
                 log_every_answers: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._order = order  # the indices this launch answers, in prompt order
        self._next = 0
        self._ready: dict[int, Answer] = {}
        self._lock = threading.Lock()
        self._events, self._log_every = events, max(1, log_every_answers)
        self.total, self.answered, self._already = total, already, already
        self.truncated = self.tokens = 0
        self._started: float | None = None
        self._last_event = self._logged_at = 0.0
        self._logged = already

    def begin(self) -> None:
        """The clock of tokens/s starts with the first decode (not with loading and compiling)."""
        with self._lock:
            if self._started is None:
                self._started = time.monotonic()

    def deliver(self, answers: list[Answer]) -> None:
        """Answers that ended together: written at once (one fsync), with any earlier ones
        they were waiting for."""
        with self._lock:
            self._ready.update((answer.prompt.index, answer) for answer in answers)
            ready = []
            while self._next < len(self._order) and self._order[self._next] in self._ready:
                ready.append(self._ready.pop(self._order[self._next]))
                self._next += 1
            if ready:
                self._write(ready)

    def _write(self, answers: list[Answer]) -> None:
        self._file.write("".join(a.line() for a in answers))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.answered += len(answers)
        self.truncated += sum(a.truncated for a in answers)
        self.tokens += sum(a.tokens for a in answers)
        now = time.monotonic()
        elapsed = max(now - (self._started or now), 1e-9)
        last = self.answered == self.total
        if not last and now - self._last_event < PROGRESS_EVERY_S:
            return
        self._last_event = now
        rate = (self.answered - self._already) / elapsed  # prompts per second in this launch
        eta = (self.total - self.answered) / rate if rate > 0 else None
        self._events.emit(PROGRESS, answered=self.answered, total=self.total, truncated=self.truncated,
                          new_tokens=self.tokens, tokens_per_s=self.tokens / elapsed, eta_s=eta)
        if self.answered - self._logged >= self._log_every or last:
            self._logged = self.answered
            eta_text = "--:--:--" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
            say(f"answered {self.answered}/{self.total} prompts ({self.truncated} cut at max_new_tokens), "
                f"{self.tokens / elapsed:.1f} tokens/s, ETA {eta_text}")

    def close(self) -> None:
        self._file.close()


class Feed:
    """The prompts still to answer, in prompt order, shared by the workers: each takes the
    next one as a row of its decoder frees up."""

    def __init__(self, requests: list[Request]):
        self._requests = iter(requests)
        self._lock = threading.Lock()

    def __iter__(self) -> "Feed":
        return self

    def __next__(self) -> Request:
        with self._lock:
            return next(self._requests)


def render(tokenizer, prompt: Prompt, enable_thinking: bool | None) -> str:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True, **extra)


def end_ids(tokenizer, model) -> set[int]:
    """The tokens that end an answer: the tokenizer's eos and the model's generation_config eos ids."""
    eos = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}


def check_cache_fits(model, slots: int, capacity: int, device: str) -> None:
    """Refuse, before allocating it, a KV cache the device's free memory cannot hold beside
    the loaded target, naming the figures and the batch_size that would fit."""
    if not is_cuda(device):
        return
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    per_row = round_up(capacity, PAD_MULTIPLE) * config.num_hidden_layers * 2 * config.num_key_value_heads \
        * head_dim * element
    # beside the cache: a step's logits and sampling over the vocabulary (fp32, a few
    # passes) per row, and a prefill chunk's activations
    per_row += SAMPLING_PASSES * config.vocab_size * 4
    prefill = PREFILL_TOKENS * (PREFILL_WIDTHS * config.hidden_size + 3 * config.intermediate_size) * element
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    need = slots * per_row + prefill
    if need > free:
        fits = max(0, (free - prefill) // per_row)
        raise RegenerateError(
            f"regenerate.batch_size {slots}: {slots} rows of {round_up(capacity, PAD_MULTIPLE)} positions (the "
            f"longest prompt + max_new_tokens) need {need / GIB:.1f} GiB beside the target on {device}, which has "
            f"{free / GIB:.1f} GiB free; at most {fits} rows fit (lower batch_size or max_new_tokens)")


class Regeneration(JobControl):
    """The coordinator of job: regenerate (main thread): startup, the workers, the exit code.
    Failures and signals are handled as in training (coordinator.Coordinator), with the
    same exit codes (common.py)."""

    def __init__(self, config: JobConfig, run_dir: Path, events: EventLog, latch: StopLatch, fault_log):
        assert config.regenerate is not None
        super().__init__(events, latch, config.runtime.heartbeat_s)
        self.config, self.settings = config, config.regenerate
        self.run_dir, self.fault_log = run_dir, fault_log
        self.workers: list[JobThread] = []
        self.alive: list[str] = []
        self.writer: AnswerWriter | None = None
        self.tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.prompts: dict[int, Prompt] = {}

    def poll(self) -> None:
        self.act_on_signal("stopping after the answers being decoded")
        self.heartbeat_if_due(step=None, answered=self.writer.answered if self.writer else None)

    def run(self) -> int:
        try:
            self._set_phase("startup")
            faults = FaultInjector(self.config.faults)
            faults.fire("coordinator")
            requests, decoders = self._prepare()
            self._set_phase("regenerate")
            feed = Feed(requests)
            for index, decoder in enumerate(decoders):
                self._start(f"target-{index}", self._body(decoder, faults, feed))
            forbidden = False
            while not all(w.done.is_set() for w in self.workers):
                if not forbidden and all(w.is_ready() for w in self.workers):
                    # Every worker compiled its steps in warm_up; a compile now would be a
                    # shape warm_up missed, racing the other workers on Dynamo's caches.
                    forbid_compiles()
                    forbidden = True
                self.poll()
                if self.latch.failure is not None:
                    name, exc = self.latch.failure
                    raise ThreadFailed(f"{name} failed: {type(exc).__name__}: {exc}") from exc
                self.latch.check()
                time.sleep(0.1)
            if self.latch.failure is not None:  # a worker failed as the last batch was taken
                name, exc = self.latch.failure
                raise ThreadFailed(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            self._set_phase("shutdown")
            self._finish()
            return EXIT_OK
        except StopRequested:
            self._set_phase("shutdown")
            self._finish()
            return 128 + int(self._signal or signal.SIGTERM)
        except BaseException as exc:  # noqa: BLE001 - the coordinator's own failure is recorded too
            self.latch.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(),
                                      phase=self.phase, step=None)
            self._finish()
            return EXIT_FAILED

    def _prepare(self) -> tuple[list[Request], list[BatchedDecoder]]:
        from transformers import AutoTokenizer

        settings = self.settings
        source, _, _ = sources(self.config, self.run_dir)
        torch.set_num_threads(torch_threads(self.config))
        prompts = read_prompts(resolve_path(settings.prompts))
        output = resolve_path(settings.output)
        answered = answered_indices(output, prompts)
        pending = [p for p in prompts if p.index not in answered]
        say(f"{len(prompts)} prompts, {len(answered)} already answered in {output}, {len(pending)} to go, "
            f"up to {settings.batch_size} at once per device; max_new_tokens {settings.max_new_tokens}, "
            f"{'sampled' if settings.sampling else 'greedy'}, enable_thinking {settings.enable_thinking}")
        self.writer = AnswerWriter(output, [p.index for p in pending], len(prompts), len(answered), self.events,
                                   self.config.log_every * settings.batch_size)
        if not pending:
            return [], []
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        texts = [render(self.tokenizer, p, settings.enable_thinking) for p in pending]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        requests = [Request(p.index, tuple(ids)) for p, ids in zip(pending, encoded)]
        self.prompts = {p.index: p for p in pending}
        capacity = max(map(len, encoded)) + settings.max_new_tokens
        decoders = []
        for device in (canonical(d) for d in self.config.devices.target):
            model = load_target(source, self.config.target.dtype, device)
            check_cache_fits(model, settings.batch_size, capacity, device)
            decoders.append(BatchedDecoder(model, settings.batch_size, capacity, settings.max_new_tokens,
                                           end_ids(self.tokenizer, model), settings.sampling))
        say(f"prompts of up to {capacity - settings.max_new_tokens} tokens: "
            f"{settings.batch_size} rows of {decoders[0].capacity} positions per device")
        return requests, decoders

    def _answer(self, generated: Generated) -> Answer:
        with self._tokenizer_lock:  # a fast tokenizer refuses concurrent use from two threads
            text = self.tokenizer.decode(generated.tokens, skip_special_tokens=False)
        return Answer(self.prompts[generated.index], text, truncated=not generated.ended, tokens=generated.count)

    def _body(self, decoder: BatchedDecoder, faults: FaultInjector, feed: Feed):
        def body(worker: JobThread) -> None:
            assert self.writer is not None
            writer = self.writer

            def stepped() -> None:
                self.latch.progressed()
                worker.step += 1  # this thread's Nth decode step: what faults' step:N means here
                faults.fire(worker.name, worker.step)

            with thread_stream(decoder.device):
                faults.fire(worker.name)
                decoder.warm_up()  # compiles and captures every step shape: none after ready
                worker.mark_ready()
                worker.phase, worker.step = "regenerate", 0
                writer.begin()
                decoder.run(feed, lambda ended: writer.deliver([self._answer(g) for g in ended]), on_step=stepped,
                            stopping=self.latch.stop.is_set)

        return body

    def _start(self, name: str, body) -> JobThread:
        worker = JobThread(name, self.latch, body)
        self.workers.append(worker)
        worker.start()
        return worker

    def _finish(self) -> None:
        """Let every worker finish the answers it is decoding (they are written), as long as
        it makes progress: a worker with no decoding step for stop_grace_s is left behind."""
        self.latch.request_stop(self.latch.stop_reason or "run over")
        grace = self.config.runtime.stop_grace_s
        last_progress, since = self.latch.progress, time.monotonic()
        while any(w.is_alive() for w in self.workers) and time.monotonic() - since < grace:
            self.poll()
            time.sleep(0.1)
            if self.latch.progress != last_progress:
                last_progress, since = self.latch.progress, time.monotonic()
        self.alive = [w.name for w in self.workers if w.is_alive()]
        report_threads_still_running(self.alive, grace, self.fault_log)
        if self.writer is not None:
            if not self.alive:  # a worker left behind may still deliver; the process exits at once anyway
                self.writer.close()
            say(f"{self.writer.answered}/{self.writer.total} prompts answered "
                f"({self.writer.truncated} of them in this launch cut at max_new_tokens)")
