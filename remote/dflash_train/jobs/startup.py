"""The coordinator's startup: everything a run needs before its threads start, as one
`Session`.

Config -> target (built for the tiny path) -> tokenizer and mask token -> data and batch
plan -> target model(s) and feature taps -> drafter config and initial weights (fresh,
or from the checkpoint being resumed) -> evaluator -> the pipeline's channels and rank
0's schedule -> the compile plan, its cache and the compiler's settings.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from dflash_contract.events import TOKENIZING

from ..checkpoint.folders import LoadedCheckpoint, load_checkpoint, resolve_resume
from ..checkpoint.state import fits
from ..compiling.cache import CompileCache, compile_key_facts, open_compile_cache
from ..compiling.policy import CompilePlan, configure_compiler, plan_compile
from ..compiling.precompiled import unsupported_reason
from ..config import JobConfig, cache_root
from ..data.batches import (BatchPlan, BatchShape, PlanEntry, anchor_counts, first_chat_row, load_prompts,
                            load_samples, micro_batch_shapes)
from ..data.chat import check_chat_template
from ..devices import canonical
from ..faults import FaultInjector
from ..memory import ledger
from ..model.drafter import default_target_layer_ids, drafter_hf_config, fresh_weights
from ..model.target import FeatureTap, load_target
from ..runlog import EventLog, say
from ..startup_phases import phase
from ..threads import StopLatch
from ..training.distributed import Layout, Peers
from ..training.gradients import GradientExchange
from ..training.pipeline import Channels, make_channels
from ..training.replica import FrozenTargetWeights, Replica
from ..training.run_context import Run
from ..training.schedule import Evaluator, OutputSchedule
from .common import sources, stop_ids, torch_threads


@dataclasses.dataclass(frozen=True)
class Session:
    """A training run ready to start its workers: nothing in it is filled in later."""

    run: Run
    hf_config: Any  # the drafter's Qwen3Config (with the DFlash fields)
    initial_weights: dict[str, torch.Tensor]
    resumed: LoadedCheckpoint | None
    frozen: FrozenTargetWeights
    evaluator: Evaluator | None  # None without eval prompts, and on ranks other than 0
    shapes: tuple[BatchShape, ...]  # every micro-batch shape this process's drafters train on, largest first
    channels: Channels | None  # the threaded pipeline's; None in a sequential run
    schedule: OutputSchedule
    compile_plan: CompilePlan  # what every drafter builds
    compile_cache: CompileCache | None  # None under compile: off

    def make_replica(self, index: int) -> Replica:
        replica = Replica(index, self.run.drafter_devices[index], self.run.config, self.hf_config,
                          self.initial_weights, self.frozen, self.run.total_steps, self.run.layout)
        if self.resumed is not None:
            replica.load_training_state(self.resumed.optimizer, self.resumed.scheduler, self.resumed.state.step)
        return replica


def _mask_token_id(tokenizer, mask_token: str, vocab_size: int) -> int:
    if mask_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"mask_token": mask_token})
    mask_id = tokenizer.convert_tokens_to_ids(mask_token)
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"drafter.mask_token {mask_token!r} has id {mask_id}, outside the target's "
                         f"embedding (vocab_size {vocab_size}); pick a token the embedding has a row for")
    return mask_id


def resume_point(config: JobConfig, run_dir: Path, peers: Peers | None, device: str) -> LoadedCheckpoint | None:
    """The checkpoint `checkpoint.resume` names, or None for a fresh start. Rank 0 writes
    the checkpoints, so in a multi-host run it reads this one and sends it to the others."""
    resumed = None
    if config.checkpoint.resume is not None and (peers is None or peers.rank == 0):
        folder = resolve_resume(config.checkpoint.resume, run_dir)
        if folder is None:
            say("checkpoint.resume: latest, but this run has no checkpoint yet: starting fresh")
        else:
            resumed = load_checkpoint(folder)
    if config.checkpoint.resume is not None and peers is not None:
        plain = peers.share_from_rank0(resumed.to_plain() if resumed else None,
                                       device if peers.backend == "nccl" else "cpu")
        resumed = LoadedCheckpoint.from_plain(plain) if plain is not None else None
    return resumed


def _build_data(config: JobConfig, run_dir: Path, events: EventLog, layout: Layout, target_source: str,
                train_path: Path | None, eval_path: Path | None):
    """(tokenizer, samples, eval prompts, batch plan)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_source)
    template_kwargs = config.data.template_kwargs()
    first = first_chat_row(train_path)
    if first is not None:  # a template the loss mask cannot read is refused before a row is tokenized
        target = f"target.path {target_source}" if config.target.path is not None else f"target.tiny ({target_source})"
        check_chat_template(tokenizer, target, first[1], f"{train_path}:{first[0]}", template_kwargs)
    samples = load_samples(train_path, tokenizer, config.data.max_length, cache_root(run_dir) / "tokenized",
                           progress=lambda fraction, count: events.emit(TOKENIZING, fraction=round(fraction, 4),
                                                                        samples=count),
                           template_kwargs=template_kwargs)
    # Rank 0 alone evaluates (the replicas are identical).
    prompts = (load_prompts(eval_path, tokenizer, config.eval.num_prompts, template_kwargs)
               if eval_path and layout.rank == 0 else [])
    plan = BatchPlan(samples, config.data, layout.global_replicas, config.optim.epochs, config.optim.max_steps,
                     config.seed, config.optim.accumulate, config.drafter)
    return tokenizer, samples, prompts, plan


def prepare(config: JobConfig, run_dir: Path, events: EventLog, latch: StopLatch,
            peers: Peers | None = None) -> Session:
    layout = peers.layout if peers is not None else Layout(local_replicas=len(config.devices.drafters))
    faults = FaultInjector(config.faults, layout.rank)
    faults.fire("coordinator")
    with phase("find sources", tiny=config.target.tiny is not None):
        target_source, train_path, eval_path = sources(config, run_dir)  # building tiny assets uses every core
    torch.set_num_threads(torch_threads(config))
    target_devices = [canonical(d) for d in config.devices.target]
    drafter_devices = [canonical(d) for d in config.devices.drafters]

    with phase("build data") as data_detail:
        tokenizer, samples, prompts, plan = _build_data(config, run_dir, events, layout, target_source, train_path,
                                                        eval_path)
        data_detail.update(samples=len(samples), steps=plan.total_steps)
    say(f"{len(samples)} samples, {len(plan.entries)} micro-batches, {plan.total_steps} steps "
        f"({layout.global_replicas} x {config.optim.accumulate} micro-batches each); "
        f"{len(prompts)} eval prompts; torch threads {torch.get_num_threads()}")

    # One target per distinct device, shared by that device's target threads (a tap's capture
    # is thread-local). Each is loaded where it lives: a copy of another would first double
    # the memory on that one's GPU.
    with phase("load target", devices=list(dict.fromkeys(target_devices))) as target_detail:
        targets, target_detail["memory"] = {}, []
        for device in dict.fromkeys(target_devices):
            before = ledger.mark(device)
            targets[device] = load_target(target_source, config.target.dtype, device)
            target_detail["memory"] += ledger.note_since(before, "target")
    target_config = targets[target_devices[0]].config
    mask_id = _mask_token_id(tokenizer, config.drafter.mask_token, target_config.vocab_size)
    layer_ids = config.drafter.target_layer_ids or default_target_layer_ids(
        target_config.num_hidden_layers, config.drafter.num_target_features or config.drafter.num_layers)
    taps_by_device = {device: FeatureTap(model, tuple(layer_ids)) for device, model in targets.items()}
    taps = [taps_by_device[device] for device in target_devices]
    hf_config = drafter_hf_config(target_config, config.drafter, tuple(layer_ids), mask_id)

    with phase("drafter weights", resume=config.checkpoint.resume is not None) as weights_detail:
        resumed = resume_point(config, run_dir, peers, drafter_devices[0])
        if resumed is not None:
            if (problem := fits(resumed.state, config, resumed.folder, layout.world_size, plan)) is not None:
                raise ValueError(problem)
            say(f"resuming from {resumed.folder} at step {resumed.state.step}")
            weights = resumed.weights
        else:
            weights = fresh_weights(hf_config, config.seed, torch.get_num_threads())
        weights_detail.update(step=resumed.state.step if resumed else 0)

    start_step = resumed.state.step if resumed else 0
    with phase("plan shapes") as shape_detail:
        shapes = micro_batch_shapes(plan, _entries_of(plan, layout, start_step), anchor_counts(samples),
                                    config.data, config.drafter)
        shape_detail.update(shapes=len(shapes))
    run = Run(config=config, run_dir=run_dir, events=events, latch=latch, faults=faults, samples=samples,
              plan=plan, pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
              taps=taps, target_devices=target_devices, drafter_devices=drafter_devices, start_step=start_step,
              exchange=GradientExchange(layout, peers), peers=peers)
    frozen = FrozenTargetWeights(targets)
    evaluator = None
    if prompts:
        with phase("set up evaluator", device=target_devices[0], prompts=len(prompts)):
            embed, head = frozen.on(target_devices[0])
            evaluator = Evaluator(events, latch, faults, config.eval, hf_config, taps[0],
                                  target_devices[0], embed, head, prompts, stop_ids(tokenizer))
    say(f"target layers {list(layer_ids)} -> drafter ({config.drafter.num_layers} layers, block "
        f"{config.drafter.block_size}, mask token id {mask_id}); compile {config.compile}; "
        f"attention {'flex' if config.uses_flex else 'sdpa'}")
    if shapes:
        say(f"{len(shapes)} micro-batch shape(s) to train on, the largest {shapes[0]}")
    channels = make_channels(run, evaluates=evaluator is not None) if config.pipeline.mode != "sequential" else None
    schedule = OutputSchedule(run, evaluator, channels.queues if channels else [],
                              losses=list(resumed.state.losses) if resumed else [], starting_weights=weights)
    compile_plan, compile_cache = _set_up_compiler(config, run_dir, shapes, drafter_devices[0])
    return Session(run, hf_config, weights, resumed, frozen, evaluator, shapes, channels, schedule, compile_plan,
                   compile_cache)


def _set_up_compiler(config: JobConfig, run_dir: Path, shapes: tuple[BatchShape, ...],
                     device: str) -> tuple[CompilePlan, CompileCache | None]:
    """Decide what every drafter compiles and set the compiler up for it, in the main
    thread, before any drafter starts (compiler settings are process-wide)."""
    plan = plan_compile(config, shapes)
    cache = open_compile_cache(run_dir, compile_key_facts(device)) if plan.mode != "off" else None
    configure_compiler(plan.mode, plan.num_drafters, plan.shapes_per_drafter, plan.dynamic_shapes)
    if cache is not None:
        reason = unsupported_reason()
        if reason is None:
            plan = dataclasses.replace(plan, precompiled=cache.folder)
        else:
            say(f"precompiled train step not used: {reason}; Dynamo traces the step")
    if plan.buckets:
        say(f"compile: cudagraphs captures {len(plan.buckets)} shape bucket(s) per drafter: "
            f"{', '.join(f'{b.rows}x{b.length} ({b.blocks} blocks)' for b in plan.buckets)}")
    return plan, cache


def _entries_of(plan: BatchPlan, layout: Layout, start_step: int) -> Iterator[PlanEntry]:
    """The micro-batches this process's drafters train on from `start_step` on."""
    for step in range(start_step + 1, plan.total_steps + 1):
        for micro in range(plan.accumulate):
            for replica in range(layout.local_replicas):
                yield plan.entry(step, layout.global_index(replica), micro)
