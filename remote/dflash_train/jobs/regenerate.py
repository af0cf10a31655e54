"""job: regenerate: answer a prompts file with the target itself; the answers are a data.train file.

The published DFlash recipe trains the drafter on responses the target wrote, so this job
runs the target over every prompt (its own chat template, greedy or sampled, batched,
left-padded, KV-cached `generate`) and appends one line per prompt to `regenerate.output`:

    {"index": 17, "messages": [...the prompt's turns, {"role": "assistant", "content": answer}],
     "truncated": false}

`index` is the prompt's position among the prompts file's non-blank lines; `truncated` is
true when the answer was cut at max_new_tokens (no end-of-turn token was generated).

Batch j is always prompts [j*batch_size, (j+1)*batch_size) less those already answered, and
answers are appended in batch order, whole lines, flushed and fsynced per batch, so the
output is in prompt order. A relaunch with the same config resumes: it reads the output,
drops a partial last line (a kill during a write), checks that every line answers the
prompt of its index, and answers only the rest, so no prompt is answered twice or skipped.
One worker thread per entry of devices.target (`target-i`) takes the next batch; SIGTERM
lets each finish the batch it is answering, writes it, and exits 128+signal.
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

from ..config import RegenerateConfig, JobConfig, resolve_path
from ..data.batches import _read_jsonl
from ..devices import canonical, thread_stream
from ..faults import FaultInjector
from ..model.target import load_target
from ..runlog import EventLog, say
from ..threads import StopLatch, StopRequested, JobThread
from .common import (EXIT_FAILED, EXIT_OK, JobControl, ThreadFailed, report_threads_still_running, sources,
                   torch_threads)


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
class Batch:
    number: int  # j: prompts [j*batch_size, (j+1)*batch_size)
    prompts: tuple[Prompt, ...]  # those not answered yet


def plan_batches(prompts: list[Prompt], batch_size: int, answered: set[int]) -> list[Batch]:
    """Fixed batches of consecutive prompts, less the answered ones; empty batches dropped.
    A batch's number seeds its sampling, so a resumed job draws what an unbroken one would."""
    batches = []
    for start in range(0, len(prompts), batch_size):
        pending = tuple(p for p in prompts[start:start + batch_size] if p.index not in answered)
        if pending:
            batches.append(Batch(start // batch_size, pending))
    return batches


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
    """Appends finished batches to the output in batch order, whole lines, flushed and
    fsynced per batch; reports progress (a log line every `log_every` batches and a
    `progress` event per batch)."""

    def __init__(self, path: Path, batches: list[Batch], total: int, already: int, events: EventLog,
                 log_every: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._order = [b.number for b in batches]
        self._next = 0
        self._ready: dict[int, list[Answer]] = {}
        self._lock = threading.Lock()
        self._events, self._log_every = events, log_every
        self.total, self.answered, self._already = total, already, already
        self.truncated = self.tokens = self._written_batches = 0
        self._started = time.monotonic()

    def deliver(self, batch: Batch, answers: list[Answer]) -> None:
        with self._lock:
            self._ready[batch.number] = answers
            while self._next < len(self._order) and self._order[self._next] in self._ready:
                self._write(self._ready.pop(self._order[self._next]))
                self._next += 1

    def _write(self, answers: list[Answer]) -> None:
        self._file.write("".join(a.line() for a in answers))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.answered += len(answers)
        self.truncated += sum(a.truncated for a in answers)
        self.tokens += sum(a.tokens for a in answers)
        self._written_batches += 1
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = (self.answered - self._already) / elapsed  # prompts per second in this launch
        eta = (self.total - self.answered) / rate if rate > 0 else None
        self._events.emit(PROGRESS, answered=self.answered, total=self.total, truncated=self.truncated,
                          new_tokens=self.tokens, tokens_per_s=self.tokens / elapsed, eta_s=eta)
        if self._written_batches % self._log_every == 0 or self.answered == self.total:
            eta_text = "--:--:--" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
            say(f"answered {self.answered}/{self.total} prompts ({self.truncated} cut at max_new_tokens), "
                f"{self.tokens / elapsed:.1f} tokens/s, ETA {eta_text}")

    def close(self) -> None:
        self._file.close()


class _Pulse:
    """A stopping criterion that stops nothing: called once per decoding step, it counts
    progress, so heartbeats go on during a long batch (the run is not STALLED)."""

    def __init__(self, latch: StopLatch):
        self._latch = latch

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self._latch.progressed()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class Answerer:
    """The target on one device, answering one batch at a time."""

    def __init__(self, model, tokenizer, tokenizer_lock: threading.Lock, settings: RegenerateConfig,
                 device: str, latch: StopLatch):
        from transformers import GenerationConfig, StoppingCriteriaList

        self.model, self.tokenizer, self._tokenizer_lock = model, tokenizer, tokenizer_lock
        self.settings, self.device = settings, device
        eos = model.generation_config.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        sampling = settings.sampling
        # Every sampling value is given, so none is taken from the model's generation_config.
        self.generation = GenerationConfig(
            max_new_tokens=settings.max_new_tokens, do_sample=sampling is not None,
            temperature=sampling.temperature if sampling else None, top_p=sampling.top_p if sampling else None,
            top_k=sampling.top_k if sampling else None, eos_token_id=sorted(self.stop_ids), pad_token_id=pad)
        self.criteria = StoppingCriteriaList([_Pulse(latch)])

    def render(self, prompt: Prompt) -> str:
        extra = {} if self.settings.enable_thinking is None else {"enable_thinking": self.settings.enable_thinking}
        return self.tokenizer.apply_chat_template(list(prompt.messages), tokenize=False,
                                                  add_generation_prompt=True, **extra)

    @torch.inference_mode()
    def answer(self, batch: Batch) -> list[Answer]:
        with self._tokenizer_lock:  # a fast tokenizer refuses concurrent use from two threads
            encoded = self.tokenizer([self.render(p) for p in batch.prompts], add_special_tokens=False,
                                     padding=True, return_tensors="pt")
        if self.settings.sampling is not None:
            seed = self.settings.sampling.seed + batch.number
            if self.device.startswith("cuda"):
                torch.cuda.manual_seed(seed)  # this thread's device only; other workers sample on theirs
            else:
                torch.random.default_generator.manual_seed(seed)
        input_ids = encoded["input_ids"].to(self.device)
        output = self.model.generate(input_ids=input_ids, attention_mask=encoded["attention_mask"].to(self.device),
                                     generation_config=self.generation, stopping_criteria=self.criteria)
        answers = []
        for prompt, row in zip(batch.prompts, output[:, input_ids.shape[1]:].tolist()):
            end = next((i for i, token in enumerate(row) if token in self.stop_ids), None)
            ids = row if end is None else row[:end]
            with self._tokenizer_lock:
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
            answers.append(Answer(prompt, text, truncated=end is None, tokens=len(ids) + (end is not None)))
        return answers


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

    def poll(self) -> None:
        self.act_on_signal("stopping after the batches being answered")
        self.heartbeat_if_due(step=None, answered=self.writer.answered if self.writer else None)

    def run(self) -> int:
        try:
            self._set_phase("startup")
            faults = FaultInjector(self.config.faults)
            faults.fire("coordinator")
            batches, answerers = self._prepare()
            self._set_phase("regenerate")
            queue = iter(batches)
            queue_lock = threading.Lock()
            for index, answerer in enumerate(answerers):
                self._start(f"target-{index}", self._body(answerer, faults, queue, queue_lock))
            while not all(w.done.is_set() for w in self.workers):
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

    def _prepare(self) -> tuple[list[Batch], list[Answerer]]:
        from transformers import AutoTokenizer

        settings = self.settings
        source, _, _ = sources(self.config, self.run_dir)
        torch.set_num_threads(torch_threads(self.config))
        prompts = read_prompts(resolve_path(settings.prompts))
        output = resolve_path(settings.output)
        answered = answered_indices(output, prompts)
        batches = plan_batches(prompts, settings.batch_size, answered)
        say(f"{len(prompts)} prompts, {len(answered)} already answered in {output}, {len(batches)} batches "
            f"of up to {settings.batch_size} to go; max_new_tokens {settings.max_new_tokens}, "
            f"{'sampled' if settings.sampling else 'greedy'}, enable_thinking {settings.enable_thinking}")
        self.writer = AnswerWriter(output, batches, len(prompts), len(answered), self.events, self.config.log_every)
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.padding_side = "left"  # generate appends to the right end of every row
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        lock = threading.Lock()
        devices = [canonical(d) for d in self.config.devices.target] if batches else []
        answerers = [Answerer(load_target(source, self.config.target.dtype, device), tokenizer, lock, settings,
                              device, self.latch) for device in devices]
        return batches, answerers

    def _body(self, answerer: Answerer, faults: FaultInjector, queue, queue_lock: threading.Lock):
        def body(worker: JobThread) -> None:
            with thread_stream(answerer.device):
                faults.fire(worker.name)
                worker.mark_ready()
                worker.phase, worker.step = "regenerate", 0
                while True:
                    self.latch.check()
                    with queue_lock:
                        batch = next(queue, None)
                    if batch is None:
                        return
                    worker.step += 1  # this thread's Nth batch: what faults' step:N means here
                    faults.fire(worker.name, worker.step)
                    answers = answerer.answer(batch)
                    assert self.writer is not None
                    self.writer.deliver(batch, answers)

        return body

    def _start(self, name: str, body) -> JobThread:
        worker = JobThread(name, self.latch, body)
        self.workers.append(worker)
        worker.start()
        return worker

    def _finish(self) -> None:
        """Let every worker finish the batch it is answering (it is written), as long as it
        makes progress: a worker with no decoding step for stop_grace_s is left behind."""
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
