"""The events of runs/<id>/events.jsonl: every type, who writes it, its fields.

events.jsonl is one JSON object per line, appended by the trainer (runlog.EventLog,
whose `emit` checks each event here before it is written) and, for the `attempt`
marker, by the agent's supervisor. Its readers take the names from here: the agent's
run state (dflash_agent.state), `follow` (which keeps heartbeats on the host), and on
the CLI's side the status line, TensorBoard files and `dflash plot`. docs/events.md is
made from this module (`python -m dflash_contract.events`); a test holds the two equal.

Readers stay lenient (`event.get(STEP.loss)`): a run of an older release may lack a
field. Writers are strict: an event that does not fit its type is an EventError.

Stdlib only and Python 3.8: the agent imports it.
"""
from __future__ import annotations

from typing import Any, Mapping

from .fields import (BOOL, INT, NUMBER, STR, Detail, EventError, EventType, Field, ListOf, MapOf, Nullable, OneOf,
                     Record, by_name, optional)

__all__ = ["EventError", "EventType", "TYPES", "check", "TYPE", "TS", "JobPhase", "StartupState",
           "PHASE", "HEARTBEAT", "TOKENIZING", "STARTUP", "READY", "STEP", "EVAL", "CHECKPOINT", "EXPORT",
           "REPLICAS", "PROGRESS", "DONE", "ATTEMPT"]

TYPE = "type"  # every event's type name
TS = "ts"  # every event's time: seconds since the epoch, the host's clock

_TS = Field(TS, NUMBER, "when it was written: seconds since the epoch, by the host's clock")
_TYPE = Field(TYPE, STR, "the event type")
BY_TRAINER = (_TS, _TYPE, Field("thread", STR, "the name of the trainer thread that wrote it"))
BY_SUPERVISOR = (_TS, _TYPE)


class JobPhase:
    """The values of a `phase` event: a job's main thread names what it is doing."""
    STARTUP = "startup"
    TRAIN = "train"
    EVAL = "eval"
    REGENERATE = "regenerate"
    SHUTDOWN = "shutdown"
    ALL = (STARTUP, TRAIN, EVAL, REGENERATE, SHUTDOWN)


class StartupState:
    """The values of a `startup` event's `state`."""
    STARTED = "started"
    ALIVE = "alive"
    DONE = "done"
    FAILED = "failed"
    ALL = (STARTED, ALIVE, DONE, FAILED)
    UNDER_WAY = (STARTED, ALIVE)  # the phase named has begun and not ended


# What a part of the run holds on a GPU (dflash_train.memory.ledger; errors.jsonl's `memory.parts`).
MEMORY_PART = Record("a memory part", {"part": STR, "device": STR, "bytes": INT})
CACHE = OneOf("cold", "warm")

PHASE = EventType("phase", "The job's main thread changed what it does: training's startup, train, eval "
                  "(the final evaluation), shutdown; regenerate's startup, regenerate, shutdown; evaluate's "
                  "startup, eval, shutdown.", BY_TRAINER, (
                      Field("phase", OneOf(*JobPhase.ALL), "what the job does from now on"),
                  ))

HEARTBEAT = EventType("heartbeat", "The run is making progress: at most every `runtime.heartbeat_s` while it "
                      "does, and once more when the drafters are done, so that the last one holds the step the "
                      "process reached (what `status` shows on a rank that reports no steps). `follow` keeps "
                      "them on the host.", BY_TRAINER, (
                          Field("step", Nullable(INT), "the lead drafter's completed steps (null in the "
                                "regenerate and evaluate jobs)"),
                          optional("answered", Nullable(INT), "regenerate: the prompts answered so far"),
                          optional("verify_steps", INT, "evaluate: the verify forwards done so far"),
                      ))

TOKENIZING = EventType("tokenizing", "Every 30 s (dflash_train.data.batches.PROGRESS_EVERY_S) while the training data "
                       "is tokenized at start-up: a starting run's events keep it from STALLED.", BY_TRAINER, (
                           Field("fraction", NUMBER, "of the file tokenized, 0 to 1"),
                           Field("samples", INT, "samples so far"),
                       ))

STARTUP = EventType(
    "startup",
    "A phase of the start-up began (`started`), is still at work (`alive`: every 5 s, dflash_train.config."
    "STARTUP_PULSE_S, while the process's threads used the CPU or moved bytes, until the job's phase leaves "
    "startup) or ended (`done`, `failed`; each also a log line `start-up: <label> <seconds> s`), in order. "
    "Code anywhere in the trainer adds a phase with `startup_phases.phase(name, **detail)`, a context manager "
    "whose body may add detail to the dict it yields; each phase and its detail fields are declared below "
    "(a `started` event carries those known at the start, `done` and `failed` all of them, `alive` none).",
    BY_TRAINER, (
        Field("phase", STR, "the phase's name; `startup` in an `alive` event between two phases"),
        Field("state", OneOf(*StartupState.ALL), "where the phase is"),
        Field("label", STR, "how the log and `watch` name it: \"build train step drafter 0 (cold)\""),
        optional("duration_s", NUMBER, "done and failed: how long the phase took"),
        optional("elapsed_s", NUMBER, "alive: how long the phase has been under way"),
        optional("cpu_s", NUMBER, "alive: CPU time of the process's threads since the last `alive` event"),
        optional("io_bytes", INT, "alive: bytes they read and wrote since then"),
    ),
    detail_of="phase",
    details={
        "import": Detail("The interpreter's start and torch's and transformers' imports, timed from the "
                         "process's start: it has no started event.",
                         optional("since", OneOf("process start", "trainer start", "warm interpreter"),
                                  "what it counts from: `trainer start` without /proc; `warm interpreter`: the "
                                  "process was forked from the warm interpreter, which had imported them "
                                  "(docs/runs.md), and this counts from the fork"),
                         optional("warm_import_s", NUMBER,
                                  "warm interpreter: what the imports took it, once, when it started")),
        "join peers": Detail("A run of several processes: this rank joining the others' process group "
                             "(torch.distributed), which waits for every rank to come.",
                             optional("rank", INT, "this process's rank"),
                             optional("world_size", INT, "how many processes the run has"),
                             optional("backend", OneOf("gloo", "nccl"), "torch.distributed's")),
        "find sources": Detail("Where the target and the data come from (building the tiny target's assets).",
                               optional("tiny", BOOL, "whether the target is the tiny one built here")),
        "build data": Detail("Tokenizing the data (or reading its cache) and planning the batches.",
                             optional("samples", INT, "training samples"), optional("steps", INT, "optimizer steps")),
        "load target": Detail("The target model, one copy per device.",
                              optional("devices", ListOf(STR), "its devices"),
                              optional("memory", ListOf(MEMORY_PART), "what it holds; [] off CUDA")),
        "drafter weights": Detail("The drafter's starting weights: freshly initialised, or the checkpoint "
                                  "`checkpoint.resume` names, read (rank 0) or received from rank 0, and checked "
                                  "to fit this run.",
                                  optional("resume", BOOL, "whether the config names a checkpoint to resume"),
                                  optional("step", INT, "the step they are from: 0 for fresh ones")),
        "plan shapes": Detail("The micro-batch shapes to compile for.",
                              optional("shapes", INT, "how many distinct shapes")),
        "set up evaluator": Detail("Rank 0 of a run that evaluates: the evaluator's drafter and decoder, built "
                                   "once for every evaluation.",
                                   optional("device", STR, "where it decodes"),
                                   optional("prompts", INT, "how many prompts it decodes")),
        "compile cache": Detail("Unless `compile: off`: the compile cache's key folder, its saved artifacts "
                                "loaded when the caches are cold.",
                                optional("key", STR, "the key folder's name"), optional("folder", STR, "its path"),
                                optional("cache", CACHE, "the compiler's caches"),
                                optional("artifacts", OneOf("loaded", "present", "absent", "corrupt", "mismatch",
                                                            "unsupported"), "the saved artifacts"),
                                optional("message", STR, "what was found, in words")),
        "set up": Detail("Per drafter: its model and optimizer made on its device from the starting "
                         "weights (a resumed optimizer's state loaded), and the inputs its train step is "
                         "built for.",
                         optional("drafter", INT, "which drafter"), optional("device", STR, "its device")),
        "build train step": Detail("Per drafter: its train step compiled, warmed up and (cudagraphs) captured.",
                                   optional("drafter", INT, "which drafter"),
                                   optional("compile", OneOf("off", "default", "cudagraphs"), "the config's"),
                                   optional("cache", Nullable(CACHE), "the compiler's caches; null with compile: "
                                            "off"),
                                   optional("graphs_traced", INT, "done: graphs Dynamo traced for it (none where "
                                            "an earlier drafter's serve it)"),
                                   optional("graphs_loaded", INT, "done: graphs loaded precompiled from the "
                                            "compile cache, which Dynamo does not trace"),
                                   optional("warmup_s", NUMBER, "done: the steps run before any capture, the "
                                            "compile or the loading of the graphs they ran included"),
                                   optional("capture_s", NUMBER, "done: cudagraphs: the CUDA-graph captures' share"),
                                   optional("optimizer_s", NUMBER, "done: the optimizer's state made and (cudagraphs) "
                                            "its step captured"),
                                   optional("trace_s", NUMBER, "done, compiled: Dynamo and AOTAutograd tracing "
                                            "the step, by torch's own timers: what a warm start still pays"),
                                   optional("inductor_s", NUMBER, "done, compiled: Inductor compiling the traced "
                                            "graphs, forward and backward, or loading them from its caches"),
                                   optional("inductor_cache_hits", INT, "done, compiled: graphs Inductor loaded "
                                            "from its FX graph cache"),
                                   optional("inductor_cache_misses", INT, "done, compiled: graphs Inductor compiled"),
                                   optional("autograd_cache_hits", INT, "done, compiled: forward+backward pairs "
                                            "loaded from AOTAutograd's cache"),
                                   optional("autograd_cache_misses", INT, "done, compiled: pairs AOTAutograd "
                                            "compiled")),
        "save compile artifacts": Detail("After the first drafter's compile, when the key folder holds no valid "
                                         "artifacts; a failed write is said and the run goes on.",
                                         optional("key", STR, "the key folder's name"),
                                         optional("bytes", Nullable(INT), "their size, null when none was made"),
                                         optional("error", STR, "why they were not saved")),
        "startup": Detail("The work between two phases (`alive` events only)."),
    })

READY = EventType("ready", "A drafter is built (weights on its device, train step compiled and warmed up).",
                  BY_TRAINER, (
                      Field("replica", INT, "the drafter's index in this process"),
                      Field("device", STR, "its device"),
                      Field("compile", OneOf("off", "default", "cudagraphs"), "the config's `compile`"),
                      Field("rank", INT, "this process's rank"),
                      Field("world_size", INT, "how many processes the run has"),
                      Field("memory", ListOf(MEMORY_PART), "what the drafter holds (and its CUDA graphs); "
                            "[] off CUDA"),
                  ))

STEP = EventType("step", "One per optimizer step, from rank 0 only: the run's figures over every replica.",
                 BY_TRAINER, (
                     Field("step", INT, "the optimizer steps done"),
                     Field("total_steps", INT, "the run's"),
                     Field("epoch", INT, "the epoch of the step's first micro-batch"),
                     Field("loss", NUMBER, "mean over the replicas and their accumulated micro-batches"),
                     Field("acc", ListOf(Nullable(NUMBER)), "accuracy of block position 1, 2, ... (null for a "
                           "position with no learnable token)"),
                     Field("lr", NUMBER, "the learning rate the step used"),
                     Field("grad_norm", NUMBER, "of the averaged gradients, before clipping"),
                     Field("micro_batches", INT, "of the whole run in this step: replicas x optim.accumulate"),
                     Field("samples", INT, "real samples in those micro-batches"),
                     Field("tokens", INT, "real (unpadded) tokens in those micro-batches"),
                     Field("tokens_per_s", NUMBER, "since the last step"),
                     Field("samples_per_s", NUMBER, "since the last step"),
                     Field("queue_depths", MapOf(INT), "items waiting in each queue, by queue name"),
                     Field("wait_s", MapOf(NUMBER), "seconds each thread waited on its queues since the last "
                           "step"),
                     Field("peak_memory_bytes", ListOf(Nullable(INT)), "per drafter: torch.cuda."
                           "max_memory_allocated of its device since the start, null on CPU; drafters sharing "
                           "a GPU share it"),
                 ))

EVAL = EventType("eval", "The drafter's acceptance length on the eval prompts: in training, of the weights it "
                 "started from (the baseline, measured once the run's first step is taken), every "
                 "`eval.every` steps and at the end; the evaluate job's one result.",
                 BY_TRAINER, (
                     Field("step", Nullable(INT), "the steps the drafter was trained (null in the evaluate job)"),
                     Field("acceptance_length", NUMBER, "tokens per verify forward, pooled over all prompts"),
                     Field("mean_per_prompt", NUMBER, "the mean of per_prompt"),
                     Field("per_prompt", ListOf(NUMBER), "each prompt's tokens per verify forward"),
                     Field("prompts", INT, "prompts decoded"),
                     Field("verify_steps", INT, "verify forwards, all prompts"),
                     Field("new_tokens", INT, "tokens decoded, all prompts"),
                     Field("seconds", NUMBER, "how long the evaluation took"),
                     Field("baseline", BOOL, "whether this is the untrained drafter's: the weights this run started from"),
                     Field("final", BOOL, "whether this is the trained drafter's, after the last step"),
                     optional("baseline_step", INT, "training, once there is a baseline: its step"),
                     optional("baseline_acceptance_length", NUMBER, "and its acceptance length"),
                     optional("drafter", STR, "evaluate: the drafter folder evaluated"),
                     optional("prompts_file", STR, "evaluate: the prompts file"),
                     optional("max_new_tokens", INT, "evaluate: tokens decoded at most per prompt"),
                     optional("hosts", INT, "evaluate: the hosts whose shares of the prompts are pooled here "
                              "(rank 0's event)"),
                     optional("cuda_graphs", BOOL, "whether the decode's steps ran as CUDA graphs (never on CPU)"),
                     optional("compiled", BOOL, "whether the decode's steps ran compiled by torch.compile "
                              "(`compile_steps`; never on CPU)"),
                     optional("tokens_per_s", NUMBER, "with the speed-up (`speedup` of eval or evaluate): "
                              "speculative decoding's tokens per second, 1 / the mean over prompts of the time "
                              "per token after the prefill (the reference benchmark's throughput)"),
                     optional("target_tokens_per_s", NUMBER, "with the speed-up: the same for the target decoding "
                              "alone, through the same static cache and graphs, one token a forward"),
                     optional("speedup", NUMBER, "with the speed-up: tokens_per_s / target_tokens_per_s (the "
                              "reference's \"Decoding speedup\")"),
                 ))

CHECKPOINT = EventType("checkpoint", "A checkpoint is complete: emitted by the checkpoint-writer thread once "
                       "the folder is in place.", BY_TRAINER, (
                           Field("step", INT, "its step"),
                           Field("path", STR, "its folder"),
                           Field("held_s", NUMBER, "how long training was held for the copy off the device"),
                           Field("write_s", NUMBER, "how long the background write took"),
                           Field("waited_s", NUMBER, "how long it waited for the previous checkpoint's write"),
                       ))

EXPORT = EventType("export", "The trained drafter is exported (DIR/export, replaced whole).", BY_TRAINER, (
    Field("step", INT, "the steps it was trained"),
    Field("path", STR, "the export folder"),
))

REPLICAS = EventType("replicas", "After the last step: every drafter replica's weights, by checksum (identical, "
                     "or the run fails with ReplicasDiverged).", BY_TRAINER, (
                         Field("step", INT, "the step the replicas reached"),
                         Field("devices", ListOf(STR), "this process's replicas' devices"),
                         Field("sha256", ListOf(STR), "their weights' checksums"),
                         optional("rank", INT, "several hosts: this process's rank"),
                         optional("world_size", INT, "several hosts: how many processes"),
                         optional("sha256_by_rank", ListOf(ListOf(STR)), "several hosts: every rank's checksums"),
                     ))

PROGRESS = EventType("progress", "The regenerate job wrote answers (at most one event a second, and one for the "
                     "last answer).", BY_TRAINER, (
    Field("answered", INT, "prompts answered, over the whole file"),
    Field("total", INT, "prompts in the file"),
    Field("truncated", INT, "answers cut at max_new_tokens, in this launch"),
    Field("new_tokens", INT, "tokens generated in this launch"),
    Field("tokens_per_s", NUMBER, "over this launch's decoding (from its first decode step, after start-up)"),
    Field("eta_s", Nullable(NUMBER), "seconds left at this launch's pace; null before an answer is written"),
))

DONE = EventType("done", "The trainer's last act: its own record of how it ended, which decides the state of a "
                 "run whose supervisor died before writing exit.json. It is the attempt's last event: the trainer "
                 "writes none after it.", BY_TRAINER, (
                     Field("exit_code", INT, "the trainer's exit status"),
                     Field("threads_alive", ListOf(STR), "threads that outlived the stop"),
                 ))

ATTEMPT = EventType("attempt", "The supervisor's marker of a new attempt (a resume or a restart): events.jsonl "
                    "goes on after it, and reading it backwards stops here, so nothing an earlier attempt wrote "
                    "counts for this one.", BY_SUPERVISOR, (
                        Field("attempt", INT, "the attempt's number (0 is the launch)"),
                        Field("reason", OneOf("resume", "restart"), "why it started"),
                        Field("resume_step", Nullable(INT), "the checkpoint's step it resumes from, or null"),
                        Field("release_id", STR, "the release it runs"),
                    ))

TYPES = by_name([PHASE, HEARTBEAT, TOKENIZING, STARTUP, READY, STEP, EVAL, CHECKPOINT, EXPORT, REPLICAS,
                 PROGRESS, DONE, ATTEMPT])


def check(record: Mapping[str, Any]) -> None:
    """Raise EventError unless `record` is a whole, well-typed event of a declared type."""
    kind = TYPES.get(record.get(TYPE))  # type: ignore[arg-type]
    if kind is None:
        raise EventError(repr(record.get(TYPE)), None, "no such event type in the schema")
    kind.check(record)
