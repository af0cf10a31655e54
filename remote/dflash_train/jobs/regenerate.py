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
from dflash_contract.events import PROGRESS

from ..compiling.policy import configure_compiler, forbid_compiles
from ..config import JobConfig, resolve_path, workspace_path
from ..data.batches import _read_jsonl
from ..devices import canonical, is_cuda, thread_stream
from ..faults import FaultInjector
from ..memory.plan import GIB, TargetShape, regenerate_terms
from ..model.batched_decode import GRAPHS_PER_DECODER, BatchedDecoder, Generated, Request, round_up
from ..model.fast_layers import FLEX_BLOCK
from ..model.target import load_target
from ..runlog import EventLog, say
from ..threads import StopLatch, StopRequested, JobThread
from ..training.distributed import PeerFailed, Peers, join
from .answer_exchange import Sender, answered_on_rank0, receive, share
from .common import (EXIT_FAILED, EXIT_OK, JobControl, ThreadFailed, end_now, report_threads_still_running, sources,
                   torch_threads)


PROGRESS_EVERY_S = 1.0  # at most one progress event a second: answers end many a second


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


class OutputFile:
    """The output, appended to: whole lines, flushed and fsynced per write."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, answers: list["Answer"]) -> None:
        self._file.write("".join(a.line() for a in answers))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class SentToRank0:
    """A rank > 0's output: its answers go to rank 0, which writes them (answer_exchange.py)."""

    def __init__(self, sender: Sender):
        self.sender = sender

    def write(self, answers: list["Answer"]) -> None:
        for a in answers:
            self.sender.send(a.prompt.index, a.text, a.truncated, a.tokens)

    def close(self) -> None:
        self.sender.done()


class AnswerWriter:
    """Hands answers to `sink` in prompt order (an answer that ends before an earlier
    prompt's waits for it); reports progress: a `progress` event at most every
    PROGRESS_EVERY_S and at the last answer, and a log line for every `log_every` answers
    and at the last."""

    def __init__(self, sink: OutputFile | SentToRank0, order: list[int], total: int, already: int,
                 events: EventLog, log_every: int, what: str = "prompts"):
        self._sink = sink
        self._order = order  # the indices to write in this launch, in prompt order
        self._next = 0
        self._ready: dict[int, Answer] = {}
        self._lock = threading.Lock()
        self._events, self._log_every, self._what = events, max(1, log_every), what
        self.total, self.answered, self._already = total, already, already
        self.truncated = self.tokens = 0
        self._started: float | None = None
        self._last_event = 0.0
        self._logged = already
        self.closed = False

    @property
    def writes_file(self) -> bool:
        return isinstance(self._sink, OutputFile)

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
        self._sink.write(answers)
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
            say(f"answered {self.answered}/{self.total} {self._what} ({self.truncated} cut at max_new_tokens), "
                f"{self.tokens / elapsed:.1f} tokens/s, ETA {eta_text}")

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._sink.close()


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
    """Refuse, before allocating it, a decoder the device's free memory cannot hold beside
    the loaded target (memory.plan.regenerate_terms: the launch's fit check counts the same
    without the prompts' positions, which only this job knows), naming the figures and the
    batch_size that would fit."""
    if not is_cuda(device):
        return
    target = TargetShape.from_config_json(model.config.to_dict())
    element = next(model.parameters()).element_size()
    positions = round_up(capacity, FLEX_BLOCK)
    terms = regenerate_terms(target, element, slots, positions, "")
    need = sum(term.bytes for term in terms)
    per_row = sum(term.bytes for term in regenerate_terms(target, element, 1, positions, "")) - terms[-1].bytes
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need > free:
        fits = max(0, (free - terms[-1].bytes) // per_row)
        raise RegenerateError(
            f"regenerate.batch_size {slots}: {slots} rows of {positions} positions (the longest prompt + "
            f"max_new_tokens) need {need / GIB:.1f} GiB beside the target on {device}, which has {free / GIB:.1f} "
            f"GiB free; at most {fits} rows fit (lower batch_size or max_new_tokens)")


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
        peers: Peers | None = None
        try:
            self._set_phase("startup")
            # Several hosts join as a training run's do: a failed or silent rank ends the others.
            peers = join(self.config.distributed, 1, False, self.latch, where=lambda: (self.phase, None),
                         on_stuck=self._end_now, exit_after_s=self.config.runtime.stop_grace_s + 10.0)
            faults = FaultInjector(self.config.faults, peers.rank if peers is not None else 0)
            faults.fire("coordinator")
            requests, decoders, remote = self._prepare(peers)
            self._set_phase("regenerate")
            feed = Feed(requests)
            # Every decoder compiles the same layer functions (a graph per device for the
            # step, and the prefill's for one row and for several): Dynamo's limit of
            # graphs per function is sized to the decoders before their threads start.
            configure_compiler("default", len(decoders), GRAPHS_PER_DECODER, dynamic_shapes=True)
            for index, decoder in enumerate(decoders):
                self._start(f"target-{index}", self._body(decoder, faults, feed))
            if remote:
                self._start("answers-in", self._receiver(peers, remote))
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
            if self.latch.failure is not None:  # a worker failed as the last prompt was taken
                name, exc = self.latch.failure
                raise ThreadFailed(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            self._set_phase("shutdown")
            if peers is not None:
                # Every answer is written or sent (sent/<rank>); then this rank leaves, before
                # the stop of _finish, which would tell the peers this rank stopped.
                assert self.writer is not None
                self.writer.close()
                peers.leave(ok=True)
            self._finish()
            return EXIT_OK
        except (StopRequested, PeerFailed):
            stopped = self.latch.failure is None
            self._set_phase("shutdown")
            self._finish()
            if peers is not None:
                peers.leave(ok=False)
            return 128 + int(self._signal or signal.SIGTERM) if stopped else EXIT_FAILED
        except BaseException as exc:  # noqa: BLE001 - the coordinator's own failure is recorded too
            self.latch.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(),
                                      phase=self.phase, step=None)
            self._finish()
            if peers is not None:
                peers.leave(ok=False)
            return EXIT_FAILED

    def _end_now(self, code: int) -> None:
        end_now(self.events, self.fault_log, self.config.runtime.stop_grace_s + 10.0, code)

    def _prepare(self, peers: Peers | None) -> tuple[list[Request], list[BatchedDecoder], list[int]]:
        """This rank's prompts as requests, its decoders, and (rank 0 of several hosts) the
        indices the other ranks answer, in order."""
        from transformers import AutoTokenizer

        settings = self.settings
        source, _, _ = sources(self.config, self.run_dir)
        torch.set_num_threads(torch_threads(self.config))
        prompts = read_prompts(resolve_path(settings.prompts))
        output = workspace_path(settings.output)
        rank, world = (peers.rank, peers.layout.world_size) if peers is not None else (0, 1)
        answered = answered_indices(output, prompts) if rank == 0 else None
        if peers is not None:
            answered = answered_on_rank0(peers, answered, self.config.distributed.join_timeout_s)
        assert answered is not None
        pending = [p.index for p in prompts if p.index not in answered]
        mine = share(pending, rank, world)
        where = f"{output}" if world == 1 else f"{output} on rank 0"
        say(f"{len(prompts)} prompts, {len(answered)} already answered in {where}, {len(pending)} to go"
            f"{'' if world == 1 else f', {len(mine)} of them on this host (rank {rank} of {world})'}, "
            f"up to {settings.batch_size} at once per device; max_new_tokens {settings.max_new_tokens}, "
            f"{'sampled' if settings.sampling else 'greedy'}, enable_thinking {settings.enable_thinking}")
        log_every = self.config.log_every * settings.batch_size
        if rank == 0:
            self.writer = AnswerWriter(OutputFile(output), pending, len(prompts), len(answered), self.events,
                                       log_every)
        else:
            self.writer = AnswerWriter(SentToRank0(Sender(peers)), mine, len(mine), 0, self.events, log_every,
                                       what=f"prompts of rank {rank}")
        self.prompts = {p.index: p for p in prompts if p.index not in answered}
        remote = [index for index in pending if index % world != 0] if rank == 0 else []
        if not mine:
            return [], [], remote
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        texts = [render(self.tokenizer, self.prompts[i], settings.enable_thinking) for i in mine]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        requests = [Request(index, tuple(ids)) for index, ids in zip(mine, encoded)]
        capacity = max(map(len, encoded)) + settings.max_new_tokens
        decoders = []
        for device in (canonical(d) for d in self.config.devices.target):
            model = load_target(source, self.config.target.dtype, device)
            check_cache_fits(model, settings.batch_size, capacity, device)
            decoders.append(BatchedDecoder(model, settings.batch_size, capacity, settings.max_new_tokens,
                                           end_ids(self.tokenizer, model), settings.sampling))
        say(f"prompts of up to {capacity - settings.max_new_tokens} tokens: "
            f"{settings.batch_size} rows of {decoders[0].capacity} positions per device")
        return requests, decoders, remote

    def _receiver(self, peers: Peers, indices: list[int]):
        """Rank 0's thread that writes the other ranks' answers in their places."""
        def body(worker: JobThread) -> None:
            assert self.writer is not None
            writer = self.writer
            worker.mark_ready()
            worker.phase = "regenerate"
            writer.begin()

            def deliver(index: int, answer: dict) -> None:
                self.latch.progressed()
                writer.deliver([Answer(self.prompts[index], answer["text"], answer["truncated"], answer["tokens"])])

            receive(peers, indices, deliver, stopped=lambda: self.latch.failure is not None)

        return body

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
            # A worker left behind may still deliver (the process exits at once anyway); a
            # rank that failed sends no word that it sent all: rank 0 learns of it as a failure.
            if not self.alive and (self.latch.failure is None or self.writer.writes_file):
                self.writer.close()
            say(f"{self.writer.answered}/{self.writer.total} prompts answered "
                f"({self.writer.truncated} of them in this launch cut at max_new_tokens)")
