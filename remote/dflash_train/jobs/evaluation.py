"""`job: evaluate`: one drafter folder measured against the target on a prompts file.

The drafter is any folder in the export format (config.json + model.safetensors), ours
or another tool's, so drafters can be compared on the user's own prompts with the
trainer's speculative decoding (model/fast_decode.py: static KV caches, CUDA graphs on
CUDA, lossless, both acceptance figures) and, with `evaluate.speedup` (default on), the
speed-up over the target decoding alone through the same path. Runs in the main thread on devices.target[0]; the result goes to
DIR/eval.json (written atomically) and to an "eval" event. Its exit codes are every
job's (common.py).
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from dflash_contract.events import EVAL

from ..config import JobConfig, resolve_path
from ..data.batches import load_prompts
from ..devices import canonical, is_cuda
from ..model.drafter import load_drafter
from ..model.speculative import EvalResult, evaluate, evaluation_decoder
from ..model.target import FeatureTap, load_target
from ..runlog import EventLog, say
from ..threads import StopLatch, StopRequested
from ..training.distributed import PeerFailed, Peers, join
from .common import EXIT_FAILED, EXIT_OK, JobControl, end_now, sources, stop_ids


class EvaluationJob(JobControl):
    def __init__(self, config: JobConfig, run_dir: Path, events: EventLog, latch: StopLatch, fault_log):
        """As every job's coordinator is built (__main__.JOBS); one drafter is measured in
        this thread, so no worker thread can outlive a stop (`alive` stays empty)."""
        assert config.evaluate is not None
        super().__init__(events, latch, config.runtime.heartbeat_s)
        self._heartbeat = (time.monotonic(), -1)  # the first heartbeat after heartbeat_s
        self.alive: list[str] = []
        self.config, self.spec, self.run_dir, self.fault_log = config, config.evaluate, run_dir, fault_log
        self.verify_steps = 0

    def _stepped(self) -> None:
        """After every verify forward: count it, then as after any forward."""
        self.verify_steps += 1
        self._forwarded()

    def _forwarded(self) -> None:
        """After every forward (the target alone's too): act on a signal, and send a
        heartbeat when due."""
        self.latch.progressed()
        self.act_on_signal("stopping")
        self.latch.check()
        self.heartbeat_if_due(step=None, verify_steps=self.verify_steps)

    def run(self) -> int:
        peers: Peers | None = None
        try:
            self._set_phase("startup")
            # Several hosts join as a training run's do: a failed or silent rank ends the others.
            peers = join(self.config.distributed, 1, False, self.latch, where=lambda: (self.phase, None),
                         on_stuck=self._end_now, exit_after_s=self.config.runtime.stop_grace_s + 10.0)
            self._measure(peers)
            self._set_phase("shutdown")
            if peers is not None:
                peers.leave(ok=True)
            return EXIT_OK
        except (StopRequested, PeerFailed):
            stopped = self.latch.failure is None
            self._set_phase("shutdown")
            if peers is not None:
                peers.leave(ok=False)
            return 128 + int(self._signal or signal.SIGTERM) if stopped else EXIT_FAILED
        except BaseException as exc:  # noqa: BLE001 - recorded like any run's failure
            self.latch.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(),
                                      phase=self.phase, step=None)
            if peers is not None:
                peers.leave(ok=False)
            return EXIT_FAILED

    def _end_now(self, code: int) -> None:
        end_now(self.events, self.fault_log, self.config.runtime.stop_grace_s + 10.0, code)

    def _measure(self, peers: Peers | None) -> None:
        from transformers import AutoTokenizer

        target_source, _, data_eval = sources(self.config, self.run_dir)
        prompts_path = resolve_path(self.spec.prompts) if self.spec.prompts is not None else data_eval
        assert prompts_path is not None  # the config check asks for one
        drafter_dir = resolve_path(self.spec.drafter)
        if not (drafter_dir / "config.json").is_file() or not (drafter_dir / "model.safetensors").is_file():
            raise ValueError(f"evaluate.drafter: {drafter_dir} is not a drafter folder (config.json and "
                             "model.safetensors)")
        device = canonical(self.config.devices.target[0])
        cores = len(os.sched_getaffinity(0))  # one computing thread: all of them on the CPU
        torch.set_num_threads(self.config.runtime.torch_threads or (min(cores, 8) if is_cuda(device) else cores))
        tokenizer = AutoTokenizer.from_pretrained(target_source)
        template_kwargs = self.config.data.template_kwargs() if self.config.data is not None else {}
        prompts = load_prompts(prompts_path, tokenizer, self.spec.num_prompts or sys.maxsize, template_kwargs)
        if not prompts:
            raise ValueError(f"evaluate.prompts: {prompts_path} holds no prompt")
        rank, world = (peers.rank, peers.layout.world_size) if peers is not None else (0, 1)
        total = len(prompts)
        prompts = prompts[rank::world]  # this host's share: every world-th prompt
        if world > 1:
            say(f"rank {rank} of {world}: {len(prompts)} of the {total} prompts")
        target = load_target(target_source, self.config.target.dtype, device)
        # the drafter in the target's dtype, as the reference decodes (load_drafter says why)
        drafter = load_drafter(drafter_dir, device, dtype=target.get_input_embeddings().weight.dtype).eval()
        _check_pairing(drafter.config, target.config, drafter_dir)
        tap = FeatureTap(target, drafter.target_layer_ids)
        embed = target.get_input_embeddings().weight.detach()
        head = target.get_output_embeddings().weight.detach()
        capacity = max(map(len, prompts)) + self.spec.max_new_tokens + drafter.block_size
        decoder, refused = evaluation_decoder(drafter, tap, embed, head, capacity, self.spec.cuda_graphs,
                                              self.spec.compile_steps, fuse=True)
        if refused:
            say(f"{refused}: decoding with the reference path (transformers' KV cache, eager)")
        say(f"evaluating {drafter_dir} (block {drafter.block_size}, target layers {list(drafter.target_layer_ids)}) "
            f"on {len(prompts)} prompts of {prompts_path}, max_new_tokens {self.spec.max_new_tokens}, on {device}"
            f"{', CUDA graphs' if decoder.cuda_graphs else ''}{', compiled steps' if decoder.compiled else ''}"
            f"{', and the target alone for the speed-up' if self.spec.speedup else ''}")
        self._set_phase("eval")
        started = time.perf_counter()
        result = evaluate(decoder, prompts, self.spec.max_new_tokens, stop_ids(tokenizer), on_step=self._stepped,
                          speedup=self.spec.speedup, on_target_step=self._forwarded)
        if peers is not None:  # rank 0 pools every host's share; the others' part ends here
            peers.publish("eval", result.shared())
            if rank != 0:
                say(f"rank {rank}: {result.prompts} prompts measured, sent to rank 0")
                return
            # As long as the slowest share takes: a peer that fails or goes silent ends the
            # wait through the watchdog (a stop), so no deadline of its own.
            parts = peers.collect("eval", math.inf)
            result = EvalResult.pooled([EvalResult.of(**part, speedup=self.spec.speedup) for part in parts],
                                       self.spec.speedup)
        fields = {**result.fields(time.perf_counter() - started), "drafter": str(drafter_dir),
                  "prompts_file": str(prompts_path), "max_new_tokens": self.spec.max_new_tokens,
                  "cuda_graphs": decoder.cuda_graphs, "compiled": decoder.compiled, "hosts": world}
        tmp = self.run_dir / ".eval.json.tmp"
        tmp.write_text(json.dumps(fields, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_dir / "eval.json")
        self.events.emit(EVAL, step=None, final=True, baseline=False, **fields)
        say(f"eval of {drafter_dir}: {result.summary()}; {result.new_tokens} tokens in {result.verify_steps} "
            f"verify steps, {fields['seconds']:.1f}s; written to {self.run_dir / 'eval.json'}")


def _check_pairing(drafter_config, target_config, drafter_dir: Path) -> None:
    """A drafter made for another target fails here with what differs, not deep in a matmul."""
    if drafter_config.hidden_size != target_config.hidden_size:
        raise ValueError(f"evaluate.drafter: {drafter_dir} has hidden_size {drafter_config.hidden_size}, the target "
                         f"{target_config.hidden_size}: it was made for another target")
    mask_id = drafter_config.dflash_config["mask_token_id"]
    if not 0 <= mask_id < target_config.vocab_size:
        raise ValueError(f"evaluate.drafter: {drafter_dir} has mask_token_id {mask_id}, outside the target's "
                         f"vocabulary ({target_config.vocab_size}): it was made for another target")
