"""The training config: YAML -> frozen dataclasses, checked before anything runs.

The CLI imports this module to validate a config before deploying it, so it must not
import torch or transformers. Every component is a small frozen dataclass loaded by
dflash_schema; cross-field rules live in `__post_init__` (the loader turns their
ValueError into a SchemaError naming the file and the section's key path, so a
section's message names its keys relative to the section: "optim: lr must be ...").
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Literal

from dflash_contract.names import RELEASE_DIR_ENV, WORKSPACE_ENV
import dflash_schema
from dflash_files.compile_key import CACHE_DIR

CompileMode = Literal["off", "default", "cudagraphs"]
CompileShapes = Literal["dynamic", "static"]
# What a launch does; each job is dispatched by __main__.JOBS and reads the sections JOB_SECTIONS names.
Job = Literal["train", "regenerate", "evaluate"]
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# compile: cudagraphs captures one graph per padded length, per drafter; each costs a
# compile and a capture at start-up and a graph's worth of memory (see compiling/cudagraphs.py).
CUDAGRAPH_MAX_BUCKETS = 4
STARTUP_PULSE_S = 5.0  # how often a working start-up says so (startup_phases.start_pulse)
# The turn id of a token no assistant turn learns: what the chat writes (data/chat.py) and
# the objective reads (model/objective.py); here, torch-free, for the tokenizing workers.
NO_TURN = -1


def padded_length(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def blocks_per_row(most_anchors: int, num_anchors: int) -> int:
    """Blocks every row of a micro-batch gets: the most anchors a row has, rounded up to 8
    so few distinct shapes occur, never past drafter.num_anchors."""
    return min(num_anchors, padded_length(most_anchors, 8))


def rows_per_micro_batch(data: DataConfig, drafter: DrafterConfig, length: int) -> int:
    """The most sequences a micro-batch of padded `length` holds: `data.token_budget` of
    padded tokens, and, with `data.block_token_budget`, that many drafter block tokens at
    the most blocks a row of that length can have (a row of n tokens has at most n - 2
    anchors). At least one: a sequence of max_length always makes a micro-batch."""
    rows = data.token_budget // length
    if data.block_token_budget is not None:
        rows = min(rows, data.block_token_budget // (drafter.block_size * blocks_per_row(length - 2, drafter.num_anchors)))
    return max(1, rows)


@dataclasses.dataclass(frozen=True)
class TinyTargetSpec:
    """A Qwen3-architecture target with random weights, built at run time (no download)."""

    vocab_words: int = 200  # word tokens; special tokens come on top
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.vocab_words, self.hidden_size, self.intermediate_size, self.num_layers,
               self.num_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError("every size must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    path: str | None = None  # a Hugging Face model folder (relative: see resolve_path)
    tiny: TinyTargetSpec | None = None  # or: build a tiny random target instead
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give exactly one of 'path' (a model folder) or 'tiny' (a spec)")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    loss_gamma: float = 7.0  # position k of a block weighs exp(-(k-1)/gamma)
    mask_token: str = "<|MASK|>"
    # Target layers whose outputs feed the drafter; default: spread evenly from 1 to L-3.
    target_layer_ids: tuple[int, ...] | None = None
    num_target_features: int | None = None  # how many layers when ids are not given; default num_layers
    intermediate_size: int | None = None  # default: the target's
    # sdpa: a dense block mask; flex: FlexAttention's sparse BlockMask, fast only when compiled.
    # auto: flex under compile: cudagraphs, sdpa otherwise (JobConfig.uses_flex says why).
    attention: Literal["auto", "sdpa", "flex"] = "auto"

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.num_anchors <= 0 or self.loss_gamma <= 0:
            raise ValueError("num_layers, num_anchors and loss_gamma must be positive")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2 (an anchor plus one draft token)")
        if self.target_layer_ids is not None and (
                not self.target_layer_ids or min(self.target_layer_ids) < 0):
            raise ValueError("target_layer_ids must be a non-empty list of layer indices >= 0")


def last_layer_refusal(layer_ids: tuple[int, ...], num_target_layers: int) -> str | None:
    """Why `layer_ids` cannot feed a drafter of a target with `num_target_layers`, or None.

    The last layer is refused: for it Hugging Face's `hidden_states[L]` (what the public
    DFlash inference code reads) is taken after the target's final norm, while a server
    capturing layer outputs takes it before, so no single feature serves every reader."""
    if max(layer_ids) >= num_target_layers - 1:
        return (f"drafter.target_layer_ids {list(layer_ids)}: the target has {num_target_layers} layers, "
                f"so ids must be at most {num_target_layers - 2} (the last layer, {num_target_layers - 1}, "
                "is read after the final norm by some servers and before it by others)")
    return None


@dataclasses.dataclass(frozen=True)
class SyntheticDataSpec:
    """Tiny-target data: random prompts, responses generated greedily by the target."""

    num_train: int = 512
    num_eval: int = 8
    prompt_words: int = 12
    response_tokens: int = 40
    seed: int = 1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str | None = None  # jsonl with "text" or chat "messages"
    eval: str | None = None  # jsonl of held-out prompts ("text" or "messages")
    synthetic: SyntheticDataSpec | None = None  # only with target.tiny
    max_length: int = 3072
    token_budget: int = 16384  # padded tokens per micro-batch (one drafter, one step)
    # Drafter block tokens (rows x blocks x block_size) per micro-batch; null: token_budget
    # alone bounds one. Every row brings up to num_anchors blocks whatever its length, so
    # short rows packed to a token budget make the drafter's activations many times those
    # of one long row: this bounds them (rows_per_micro_batch).
    block_token_budget: int | None = None
    pad_multiple: int = 64  # sequence lengths are padded up to this, to bound the shapes compiled
    # Passed to the chat template (Qwen3), as job: regenerate's is: what the data was
    # answered with. false: the generation prompt holds the empty think block, so it is not learnt.
    enable_thinking: bool | None = None

    def __post_init__(self) -> None:
        if (self.train is None) == (self.synthetic is None):
            raise ValueError("give exactly one of 'train' (a jsonl file) or 'synthetic'")
        if self.synthetic is not None and self.eval is not None:
            raise ValueError("'eval' comes from the synthetic data when 'synthetic' is set")
        if self.max_length <= 1 or self.pad_multiple <= 0:
            raise ValueError("max_length must exceed 1 and pad_multiple be positive")
        if self.token_budget < self.max_length:
            raise ValueError(f"token_budget ({self.token_budget}) must hold one sequence "
                             f"of max_length ({self.max_length})")
        if self.block_token_budget is not None and self.block_token_budget <= 0:
            raise ValueError(f"block_token_budget must be positive, not {self.block_token_budget}")

    def template_kwargs(self) -> dict[str, bool]:
        """What the chat template is rendered with, beyond the messages."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def padded_lengths(self) -> tuple[int, ...]:
        """Every sequence length a micro-batch can have: the multiples of pad_multiple up to
        max_length rounded up (data/batches.py pads each batch to its longest row, rounded up)."""
        top = padded_length(self.max_length, self.pad_multiple)
        return tuple(range(self.pad_multiple, top + 1, self.pad_multiple))

    def too_many_cudagraph_buckets(self) -> str | None:
        """Why `compile: cudagraphs` cannot capture every length this data makes, or None."""
        lengths = self.padded_lengths()
        if len(lengths) <= CUDAGRAPH_MAX_BUCKETS:
            return None
        return (f"compile: cudagraphs captures one graph per padded length; data.max_length {self.max_length} "
                f"with data.pad_multiple {self.pad_multiple} makes {len(lengths)} (at most "
                f"{CUDAGRAPH_MAX_BUCKETS}): set data.pad_multiple to at least "
                f"{-(-self.max_length // CUDAGRAPH_MAX_BUCKETS)} (e.g. {self.max_length}, one graph)")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, ...] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    epochs: int = 6
    max_steps: int | None = None  # stop earlier than `epochs` would
    # Micro-batches per optimizer step, per replica: a step trains on replicas x accumulate
    # micro-batches, their gradients averaged, then one exchange, clip and AdamW step.
    accumulate: int = 1

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ValueError("betas must be two numbers")
        if self.lr <= 0 or self.epochs <= 0 or not 0 <= self.warmup_ratio < 1:
            raise ValueError("lr and epochs must be positive, warmup_ratio in [0, 1)")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError("max_steps must be positive")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be at least 1 (micro-batches per optimizer step), not {self.accumulate}")


@dataclasses.dataclass(frozen=True)
class DevicesConfig:
    target: tuple[str, ...] = ("cpu",)  # one target thread per entry
    drafters: tuple[str, ...] | None = None  # one data-parallel drafter thread per entry; default: target's

    def __post_init__(self) -> None:
        if self.drafters is None:
            object.__setattr__(self, "drafters", self.target)
        for key, devices in (("target", self.target), ("drafters", self.drafters)):
            if not devices:
                raise ValueError(f"{key} must list at least one device")
            bad = [d for d in devices if not _DEVICE.match(d)]
            if bad:
                raise ValueError(f"{key}: {bad[0]!r} is not 'cpu', 'cuda' or 'cuda:N'")
        kinds = {d.split(":")[0] for d in self.target + self.drafters}
        if len(kinds) > 1:
            raise ValueError("mixing cpu and cuda devices is not supported")
        if len(self.target) > len(self.drafters):
            raise ValueError("more target devices than drafters (each target serves drafters)")

    @property
    def cpu_only(self) -> bool:
        return all(d == "cpu" for d in self.target + self.drafters)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    mode: Literal["threaded", "sequential"] = "threaded"
    queue_size: int = 4
    poll_s: float = 0.5  # how long a blocked thread waits before re-checking the stop event

    def __post_init__(self) -> None:
        if self.queue_size <= 0 or self.poll_s <= 0:
            raise ValueError("queue_size and poll_s must be positive")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # steps between evaluations; 0: only at the start and the end
    num_prompts: int = 8
    max_new_tokens: int = 64
    at_start: bool = True  # also measure the drafter before this run's first step
    # Also decode the prompts with the target alone and report both tokens/s and their ratio
    # (`speedup`): about doubles an evaluation's time, hence off in training.
    speedup: bool = False
    # On CUDA, replay the decode's draft and verify steps as CUDA graphs; false runs them
    # eagerly (the same tokens: for measuring what the graphs give, or a GPU they fail on).
    cuda_graphs: bool = True
    # On CUDA, compile the decode's fixed-shape steps with torch.compile before their graphs
    # are captured (fused norms, RoPE and residuals: faster steps, bench/RESULTS-h200.md
    # "Evaluation at the hardware's speed"), for a compile in start-up: off in training,
    # where start-up is the patch loop's wait; on in `job: evaluate`.
    compile_steps: bool = False

    def __post_init__(self) -> None:
        if self.every < 0 or self.num_prompts < 0 or self.max_new_tokens <= 0:
            raise ValueError("every/num_prompts must be >= 0 and max_new_tokens > 0")


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    """`job: evaluate`: one drafter measured against the target on a prompts file."""

    drafter: str  # a folder in the export format (config.json + model.safetensors), ours or another's
    prompts: str | None = None  # jsonl of "text" or chat "messages"; default: data.eval, or the synthetic prompts
    max_new_tokens: int = 2048
    num_prompts: int | None = None  # the first N prompts; default: all
    speedup: bool = True  # as eval.speedup; on: the speed-up is what this job is for
    cuda_graphs: bool = True  # as eval.cuda_graphs
    compile_steps: bool = True  # as eval.compile_steps; on: this job's figure is the hardware's speed

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0 or (self.num_prompts is not None and self.num_prompts <= 0):
            raise ValueError("max_new_tokens and num_prompts must be positive")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 1000  # steps between checkpoints; 0: only at the end
    # minutes between checkpoints, whichever of this and `every` comes first; 0: by steps only.
    # Bounds what a restart redoes when steps are slow (a 40-minute step count is hours).
    every_minutes: float = 0.0
    keep: int = 3
    resume: str | None = None  # "latest" (this run dir) or a checkpoint folder
    on_stop: bool = True  # write one when stopped by SIGTERM

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep <= 0 or self.every_minutes < 0:
            raise ValueError("every and every_minutes must be >= 0 and keep positive")


_FAULT_AT = re.compile(r"^(startup|step:(\d+))$")
_DOTTED_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    # auto: bfloat16 where the drafters train on CUDA (their forward runs under bf16
    # autocast, so bf16 is what was trained and what servers load), float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A failure injected on purpose, so every failure path is testable on CPU."""

    thread: str
    at: str  # "startup" or "step:N" (for the eval thread: the evaluation of step N)
    # nonfinite: a drafter's step:N only; busy: `seconds` of CPU work (a long phase that is working)
    kind: Literal["raise", "hang", "abort", "exit", "nonfinite", "busy"]
    depth: int = 10  # raise: frames between the thread body and the raise
    code: int = 3  # exit: the exit status
    seconds: float = 10.0  # busy: how long
    attempt: int | None = None  # fire only in this attempt of the run (0: the launch); None: in every one
    rank: int | None = None  # only in the process of this rank (a host of a multi-host run); None: every rank
    # raise: an exception of this class ("module.Name", imported when the trainer starts)
    # made with `message`, in place of the InjectedFault chain: a failure exactly as torch,
    # NCCL or a library would raise it, type and text, for the paths that read them
    exception: str | None = None
    message: str | None = None  # with exception: its message (none: the class's default)

    def __post_init__(self) -> None:
        if self.kind != "raise" and (self.exception is not None or self.message is not None):
            raise ValueError(f"exception and message are for kind raise, not {self.kind}")
        if self.exception is not None and not _DOTTED_NAME.match(self.exception):
            raise ValueError(f"exception must name a class as module.Name (e.g. torch.OutOfMemoryError), "
                             f"got {self.exception!r}")
        if self.message is not None and self.exception is None:
            raise ValueError("message is the message of `exception`: name the exception too")
        match = _FAULT_AT.match(self.at)
        if not match:
            raise ValueError(f"at must be 'startup' or 'step:N', got {self.at!r}")
        if match.group(2) is not None and int(match.group(2)) <= 0:
            raise ValueError("at: steps count from 1")
        if self.depth < 1 or not 0 < self.code < 256 or self.seconds < 0:
            raise ValueError("depth must be >= 1, code in 1..255 and seconds >= 0")
        if self.attempt is not None and self.attempt < 0:
            raise ValueError("attempt counts from 0 (the launch)")
        if self.rank is not None and self.rank < 0:
            raise ValueError("rank counts from 0")

    @property
    def step(self) -> int | None:
        """The step the fault fires at, or None for startup."""
        return None if self.at == "startup" else int(self.at.split(":")[1])


RestartCause = Literal["failure", "killed"]


@dataclasses.dataclass(frozen=True)
class RestartConfig:
    """`restart:`: the host's supervisor starts a new attempt of a run that ended badly, from
    its newest checkpoint (read by the agent from run.json, not by the trainer)."""

    max: int = 0  # restarts at most; 0: none
    # failure: the trainer recorded an error or exited non-zero; killed: a signal ended it
    # with no record (SIGKILL, the OOM killer, a segfault)
    on: tuple[RestartCause, ...] = ("failure", "killed")
    backoff_s: float = 10.0  # before the first restart; doubled before each next one

    def __post_init__(self) -> None:
        if self.max < 0 or self.backoff_s < 0:
            raise ValueError("max and backoff_s must be >= 0")
        if not self.on:
            raise ValueError("on: name at least one of failure, killed")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    torch_threads: int | None = None  # default: the cores divided among the compute threads
    heartbeat_s: float = 2.0
    ready_timeout_s: float = 3600.0  # one drafter's warm-up (compile) may take this long
    stop_grace_s: float = 3.0  # after a failure or SIGTERM, how long threads get to finish a step

    def __post_init__(self) -> None:
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise ValueError("torch_threads must be positive")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One run over several processes (one per host), joined by torch.distributed.

    Used only when the process is started with WORLD_SIZE > 1 (training/distributed.py)."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl when the drafters are on CUDA, else gloo
    join_timeout_s: float = 600.0  # how long a process waits for the others to join
    timeout_s: float = 600.0  # one collective (a step's gradient all-reduce) at most; then the run fails
    peer_timeout_s: float = 30.0  # a peer (or the store) silent this long is gone (killed, frozen, cut off)
    bucket_mb: float = 256.0  # the cross-process all-reduce runs in buckets of this many MiB

    def __post_init__(self) -> None:
        if min(self.join_timeout_s, self.timeout_s, self.peer_timeout_s, self.bucket_mb) <= 0:
            raise ValueError("join_timeout_s, timeout_s, peer_timeout_s and bucket_mb must be positive")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampled answers (the `regenerate.sampling` section; without it answers are greedy).
    None of them comes from the model's generation_config."""

    temperature: float = 1.0
    top_p: float = 1.0  # 1.0: no nucleus cut
    top_k: int = 0  # 0: no top-k cut
    seed: int = 0  # prompt i's t-th token draws noise keyed by (seed, i, t): a resumed or re-batched job draws the same

    def __post_init__(self) -> None:
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature must be positive, top_p in (0, 1] and top_k >= 0 "
                             "(for greedy answers leave the sampling section out)")


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    """job: regenerate: answer every prompt with the target; the output is a data.train file."""

    prompts: str  # jsonl of "text" (one user turn) or chat "messages" (a final assistant turn is re-answered)
    output: str  # jsonl, appended in prompt order; an existing one is resumed (relative: in the workspace)
    max_new_tokens: int = 2048
    batch_size: int = 32  # prompts decoded at once per device: the KV cache's slots
    enable_thinking: bool | None = None  # passed to the chat template (Qwen3); null: the template's default
    sampling: SamplingConfig | None = None  # null: greedy

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0 or self.batch_size <= 0:
            raise ValueError("max_new_tokens and batch_size must be positive")
        # A relative output is the workspace's, not the release's (read-only) nor the run
        # directory's (new at every launch): a relaunch must find it to resume it.
        if not self.output.strip() or self.output.startswith("..") or "/../" in self.output:
            raise ValueError(f"output must be a file path inside the workspace (relative), absolute or ~/..., "
                             f"got {self.output!r}")


# The optional sections each job reads. A job refuses a section it does not read that is
# set to anything but its default: a training setting in a regeneration config is a mistake.
JOB_SECTIONS: dict[str, frozenset[str]] = {
    "train": frozenset({"data", "drafter", "optim", "pipeline", "compile", "compile_shapes", "eval", "checkpoint",
                        "export", "distributed"}),
    "regenerate": frozenset({"regenerate"}),
    "evaluate": frozenset({"evaluate", "data"}),  # data: the tiny target's synthetic spec, or data.eval prompts
}
# The sections a job cannot run without.
JOB_REQUIRES: dict[str, tuple[str, ...]] = {"train": ("data",), "regenerate": ("regenerate",),
                                           "evaluate": ("evaluate",)}
_JOB_SPECIFIC = frozenset().union(*JOB_SECTIONS.values())


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """A launch's config: the job it runs (train, regenerate or evaluate) and the sections
    that job reads (JOB_SECTIONS)."""

    target: TargetConfig
    data: DataConfig | None = None  # required by job: train
    job: Job = "train"
    regenerate: RegenerateConfig | None = None  # required by job: regenerate
    evaluate: EvaluateConfig | None = None  # required by job: evaluate
    drafter: DrafterConfig = DrafterConfig()
    optim: OptimConfig = OptimConfig()
    devices: DevicesConfig = DevicesConfig()
    pipeline: PipelineConfig = PipelineConfig()
    # YAML 1.1 reads a bare `off` as false, so false is accepted and means "off".
    compile: CompileMode | bool = "off"
    # cudagraphs: one Inductor compile for every shape bucket (dynamic), or one per bucket
    # (static: kernels specialized to each size; a longer start-up). step_build.compile_for_shapes.
    # Unset: static under cudagraphs, dynamic under compile: default (JobConfig.compiled_shapes).
    compile_shapes: CompileShapes | None = None
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()
    distributed: DistributedConfig = DistributedConfig()
    faults: tuple[FaultSpec, ...] = ()
    runtime: RuntimeConfig = RuntimeConfig()
    restart: RestartConfig = RestartConfig()
    seed: int = 0
    log_every: int = 1
    stall_after: float = 300.0  # seconds without a heartbeat before the run counts as STALLED
    # seconds of start-up without an event or any work of the process (startup_phases'
    # pulse: CPU or bytes moved) before it counts as STALLED
    startup_stall_after: float = 300.0

    def __post_init__(self) -> None:
        if self.compile is False:
            object.__setattr__(self, "compile", "off")
        elif self.compile is True:
            raise ValueError("compile: true is ambiguous; write off, default or cudagraphs")
        self._check_job_sections()
        if self.job == "train":
            self._check_training()
        if self.job == "regenerate":
            devices = [{"cuda": "cuda:0"}.get(d, d) for d in self.devices.target]  # devices.canonical, torch-free
            if len(set(devices)) < len(devices):
                raise ValueError("devices.target: job: regenerate runs one model per device; a device listed "
                                 "twice would only split it (raise regenerate.batch_size instead)")
        if self.job == "evaluate":
            self._check_evaluation()
        known = self.thread_names()
        for i, fault in enumerate(self.faults):
            if fault.thread not in known:
                raise ValueError(f"faults[{i}].thread: unknown thread {fault.thread!r} "
                                 f"(threads of this config: {', '.join(known)})")
            if fault.thread == "coordinator" and fault.step is not None:
                raise ValueError(f"faults[{i}]: the coordinator takes faults at startup only")
            if fault.kind == "nonfinite" and (not fault.thread.startswith("drafter-") or fault.step is None):
                raise ValueError(f"faults[{i}]: nonfinite poisons a drafter's step: "
                                 f"thread drafter-N and at step:N, got {fault.thread} at {fault.at}")
        if self.log_every <= 0 or self.stall_after <= 0:
            raise ValueError("log_every and stall_after must be positive")
        if self.startup_stall_after < 3 * STARTUP_PULSE_S:
            raise ValueError(f"startup_stall_after must be at least {3 * STARTUP_PULSE_S:.0f} s: a working "
                             f"start-up says so every {STARTUP_PULSE_S:.0f} s")

    def _check_job_sections(self) -> None:
        reads = JOB_SECTIONS[self.job]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        stray = [name for name in sorted(_JOB_SPECIFIC - reads) if getattr(self, name) != defaults[name]]
        if self.job != "train" and self.devices.drafters != self.devices.target:
            stray.append("devices.drafters")
        if stray:
            raise ValueError(f"job: {self.job} does not read {', '.join(stray)}: remove "
                             f"{'it' if len(stray) == 1 else 'them'} (or set the job that does)")
        for name in JOB_REQUIRES[self.job]:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: missing required key for job: {self.job}")

    def _check_evaluation(self) -> None:
        assert self.evaluate is not None
        if self.target.tiny is not None and (self.data is None or self.data.synthetic is None):
            raise ValueError("job: evaluate with target.tiny needs data.synthetic (the tiny target is built with it)")
        if self.evaluate.prompts is None and self.target.tiny is None and (self.data is None or self.data.eval is None):
            raise ValueError("job: evaluate needs evaluate.prompts (a jsonl of prompts) or data.eval")

    def _check_training(self) -> None:
        assert self.data is not None
        if self.compile == "cudagraphs" and self.devices.cpu_only:
            raise ValueError("compile: cudagraphs needs CUDA devices, but this config runs on CPU only "
                             f"(devices.drafters: {', '.join(self.devices.drafters)}); "
                             "use compile: off or default")
        if self.compile == "cudagraphs" and (problem := self.data.too_many_cudagraph_buckets()):
            raise ValueError(problem)
        if self.compile == "off" and self.drafter.attention == "flex":
            # Uncompiled, FlexAttention compiles a wrapper of its own for every new shape, in
            # whichever drafter thread meets it first: a compile in a worker thread.
            raise ValueError("drafter.attention: flex needs compile: default or cudagraphs (uncompiled, FlexAttention "
                             "compiles a kernel wrapper per shape inside the drafter threads); use sdpa or auto")
        if self.compile_shapes is not None and self.compile != "cudagraphs":
            raise ValueError(f"compile_shapes applies to compile: cudagraphs (its shape buckets); compile: "
                             f"{self.compile} {'compiles nothing' if self.compile == 'off' else 'is always dynamic'}")
        if self.data.block_token_budget is not None:
            longest = padded_length(self.data.max_length, self.data.pad_multiple)
            one_row = self.drafter.block_size * blocks_per_row(longest - 2, self.drafter.num_anchors)
            if self.data.block_token_budget < one_row:
                raise ValueError(f"data.block_token_budget ({self.data.block_token_budget}) must hold one sequence "
                                 f"of max_length: {one_row} block tokens (drafter.num_anchors "
                                 f"{self.drafter.num_anchors} blocks of drafter.block_size {self.drafter.block_size})")
        if self.data.synthetic is not None and self.target.tiny is None:
            raise ValueError("data.synthetic needs target.tiny (responses come from the tiny target)")
        if self.target.tiny is not None and self.drafter.target_layer_ids is not None and (
                problem := last_layer_refusal(self.drafter.target_layer_ids, self.target.tiny.num_layers)):
            raise ValueError(problem)

    @property
    def uses_flex(self) -> bool:
        """Whether the drafter attends with FlexAttention (else dense-mask SDPA).

        `auto` picks by measurement (bench/RESULTS-h200.md, "Drafter step time per mode"):
        under cudagraphs at the Qwen3-8B drafter shape flex's step is the faster; eager flex
        is unfused (slow, dense scores), and compile: default with flex failed in Inductor
        at that shape, so everything else keeps sdpa."""
        if self.drafter.attention == "auto":
            return self.compile == "cudagraphs"
        return self.drafter.attention == "flex"

    @property
    def compiled_shapes(self) -> CompileShapes:
        """`compile_shapes` with its default resolved. Static under cudagraphs: measured on an
        H200 its step replays faster than dynamic's, which outweighs dynamic's shorter
        start-up over a run of hours (docs/trainer.md, "Compile shapes")."""
        return self.compile_shapes or ("static" if self.compile == "cudagraphs" else "dynamic")

    @property
    def export_dtype(self) -> str:
        """The dtype the drafter is exported in: `export.dtype`, with auto resolved."""
        if self.export.dtype == "auto":
            return "float32" if self.devices.cpu_only else "bfloat16"
        return self.export.dtype

    def thread_names(self) -> tuple[str, ...]:
        targets = tuple(f"target-{i}" for i in range(len(self.devices.target)))
        if self.job == "regenerate":
            return ("coordinator", *targets)  # target-i answers batches on devices.target[i]
        return ("coordinator", "prefetch", *targets,
                *(f"drafter-{i}" for i in range(len(self.devices.drafters))), "eval")

    def resources(self) -> tuple[str, ...]:
        """The devices the run occupies: ("cpu",) or ("gpu0", "gpu1", ...)."""
        if self.devices.cpu_only:
            return ("cpu",)
        indices = {int(d.split(":")[1]) if ":" in d else 0
                   for d in self.devices.target + self.devices.drafters}
        return tuple(f"gpu{i}" for i in sorted(indices))


def load_job_config(path: str | os.PathLike[str], overrides: tuple[dflash_schema.Override, ...] = ()) -> JobConfig:
    """Load and check a training config, `overrides` (`--set KEY=VALUE`) merged in first;
    raises dflash_schema.SchemaError naming the file (or the `--set`) and the key."""
    return dflash_schema.load_file(JobConfig, path, overrides)


def resolved_yaml(config: JobConfig) -> str:
    """The config as YAML with every default filled in: the run directory's config.yaml
    and each checkpoint's. It loads back to an equal JobConfig. The sections of other
    jobs are left out (the config was refused unless they were at their defaults); values
    the trainer derives from the model at run time (drafter.target_layer_ids when null)
    stay null."""
    data = dflash_schema.dump(config)
    for name in _JOB_SPECIFIC - JOB_SECTIONS[config.job]:
        del data[name]
    return dflash_schema.dump_yaml({"job": data.pop("job"), **data})  # what it runs, first


def workspace_path(path: str) -> Path:
    """An output path of a config: absolute, ~/..., or relative to the host's workspace
    (DFLASH_WORKSPACE, which the agent sets; the current directory without it)."""
    candidate = Path(os.path.expanduser(path))
    if candidate.is_absolute():
        return candidate
    base = os.environ.get(WORKSPACE_ENV)
    return (Path(base) if base else Path.cwd()) / candidate


def cache_root(run_dir: Path) -> Path:
    """The trainer's caches (tiny targets, tokenized data, compiled steps): the workspace's
    (DFLASH_WORKSPACE), or the run directory's of a run without one."""
    workspace = os.environ.get(WORKSPACE_ENV)
    return Path(workspace) / CACHE_DIR if workspace else run_dir / CACHE_DIR


def resolve_path(path: str) -> Path:
    """Relative paths in a config are relative to the release root when the agent runs
    us (DFLASH_RELEASE_DIR), else to the current directory (the repo root locally).
    Never the config file's own folder: the agent runs a copy from the run directory."""
    candidate = Path(os.path.expanduser(path))
    if candidate.is_absolute():
        return candidate
    base = os.environ.get(RELEASE_DIR_ENV)
    return (Path(base) if base else Path.cwd()) / candidate
