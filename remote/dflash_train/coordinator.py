"""The coordinator (main thread): startup, the threads' lifecycle, and the exit code.

Drafters start one at a time, each awaited with `wait_until_ready()` (their compile
warm-up is serialized anyway); then the target(s), prefetch and eval threads. The
coordinator then watches: on the first failure it records its own error (naming the
failed thread, chained from its exception), stops the run, gives threads
`stop_grace_s` to finish their step, and returns 1. SIGTERM stops the run the same way
(a checkpoint is written if cheap) and returns 143. It never waits on a thread without
a timeout, so a hung thread cannot hang the exit.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
from dflash_events import REPLICAS

from . import memory_ledger
from .compile_cache import CompileCache, compile_key_facts, is_warm, open_compile_cache, save_after_first_compile
from .compile_policy import (CompilePlan, build_train_step, configure_compiler, example_inputs, forbid_compiles,
                             plan_compile)
from .config import TrainConfig
from .devices import is_cuda
from .distributed import PeerFailed, Peers, join
from .jobs import EXIT_FAILED, EXIT_OK, JobControl, ThreadFailed, report_threads_still_running
from .model import NonFiniteWeights
from .pipeline import READY, Channels, drafter_body, eval_body, prefetch_body, target_body
from .replica import NonFiniteStep, Replica, ReplicasDiverged, verify_replicas_identical
from .runlog import EventLog, emit_done, say
from .schedule import EvalRequest, OutputSchedule
from .startup import Prepared, prepare
from .startup_phases import phase
from .threads import Rendezvous, StopLatch, StopRequested, StoppableQueue, JobThread


class Coordinator(JobControl):
    def __init__(self, config: TrainConfig, run_dir: Path, events: EventLog, latch: StopLatch, fault_log):
        super().__init__(events, latch, config.runtime.heartbeat_s)
        self.config = config
        self.run_dir = run_dir
        self.fault_log = fault_log
        self.step: int | None = None
        self.workers: list[JobThread] = []
        self.alive: list[str] = []  # threads still running at exit
        self.replicas: dict[int, Replica] = {}
        self.prepared: Prepared | None = None
        self.schedule: OutputSchedule | None = None  # made before the first drafter starts
        self.compile_plan: CompilePlan | None = None  # set before the first drafter starts
        self.compile_cache: CompileCache | None = None  # with it, unless compile: off
        self.peers: Peers | None = None  # the other processes of a multi-process run
        self.checksums: list[str] | None = None  # of this process's replicas, once they are done

    def poll(self) -> None:
        self.act_on_signal("stopping")
        lead = self.replicas.get(0)
        self.heartbeat_if_due(step=lead.completed_step if lead else None)

    def run(self) -> int:
        try:
            self._set_phase("startup")
            self.peers = join(self.config.distributed, len(self.config.devices.drafters),
                              not self.config.devices.cpu_only, self.latch, where=lambda: (self.phase, self.step),
                              on_stuck=self._end_now, exit_after_s=self.config.runtime.stop_grace_s + 10.0)
            self.prepared = prepare(self.config, self.run_dir, self.events, self.latch, self.peers)
            if self.config.pipeline.mode == "sequential":
                self._run_sequential(self.prepared)
            else:
                self._run_threaded(self.prepared)
            self._verify_replicas()
            self._set_phase("shutdown")
            self._leave(ok=True)
            self._teardown()
            return EXIT_OK
        except (StopRequested, PeerFailed):
            # A peer failed (its PeerFailed record is written), or a worker outside the
            # drafters did (the checkpoint writer): the run fails.
            if self.latch.failure is not None:
                self._teardown()
                self._finish_checkpoints()
                self._leave(ok=False)
                return EXIT_FAILED
            code = self._stopped()
            self._leave(ok=False)
            return code
        except BaseException as exc:  # noqa: BLE001 - the coordinator's own failure is recorded too
            self.latch.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(), phase=self.phase,
                                      step=self.step)
            self._teardown()
            self._finish_checkpoints()
            self._leave(ok=False)
            return EXIT_FAILED

    def _finish_checkpoints(self) -> bool:
        """Wait for the checkpoint being written, if any; False if its write failed."""
        if self.schedule is None:
            return True
        try:
            self.schedule.checkpoints.wait()
            return True
        except StopRequested:
            return False

    def _end_now(self, code: int) -> None:
        """A peer ended the run, and this process did not follow (the main thread is in a
        startup step that does not look at the stop event): stacks, the done event, exit."""
        alive = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        report_threads_still_running(alive, self.config.runtime.stop_grace_s + 10.0, self.fault_log)
        emit_done(self.events, code, alive)
        os._exit(code)

    def _leave(self, ok: bool) -> None:
        if self.peers is not None:
            self.peers.leave(ok)

    def _start_replica(self, index: int) -> Replica:
        """Runs in the drafter's thread (or the main thread when sequential)."""
        assert self.prepared is not None and self.compile_plan is not None
        before = memory_ledger.mark(self.prepared.run.drafter_devices[index])  # what the drafter holds, from here
        replica = self.prepared.make_replica(index)
        run = self.prepared.run
        example = example_inputs(replica.objective, self.config.data.pad_multiple,
                                 replica.drafter.fc.in_features, replica.device)
        cache = self.compile_cache
        with phase("build train step", drafter=index, compile=self.config.compile,
                   cache=None if cache is None else "warm" if cache.warm or is_warm(cache.folder) else "cold"):
            built = build_train_step(self.compile_plan, replica.objective, example)
            replica.train_step = built
            replica.prepare_optimizer()  # under cudagraphs, captures the optimizer step too
        memory_ledger.note_since(before, f"drafter-{index}")
        say(f"drafter {index}: {built.report.describe()}")
        if index == 0 and cache is not None:  # the first compile is done: what it made can serve the next run
            save_after_first_compile(cache)
        self.replicas[index] = replica
        say(f"drafter {index} ready on {replica.device} (compile {self.config.compile}, "
            f"{sum(p.numel() for p in replica.drafter.parameters()):,} parameters, from step {run.start_step})")
        return replica

    def _replicas_done(self) -> None:
        """Once the drafters are done: this process's replicas must hold the same weights;
        their checksums go to the other ranks (before rank 0's final evaluation, which the
        others need not wait for)."""
        replicas = [self.replicas[i] for i in sorted(self.replicas)]
        # The step this process reached, in its events now: heartbeats come at most every
        # heartbeat_s, and only rank 0 reports steps, so another rank's status would show
        # an older one for good.
        self.heartbeat(step=replicas[0].completed_step)
        self.checksums = verify_replicas_identical(replicas)
        if self.peers is not None:
            self.peers.publish("sha256", self.checksums)

    def _verify_replicas(self) -> None:
        """After the last step: every replica of every rank holds the same weights (checksums in events)."""
        if self.checksums is None:
            self._replicas_done()
        assert self.checksums is not None
        replicas = [self.replicas[i] for i in sorted(self.replicas)]
        step = replicas[0].completed_step
        by_rank = [self.checksums]
        fields = {}
        if self.peers is not None:
            by_rank = self.peers.collect("sha256", self.config.distributed.timeout_s)
            fields = {"rank": self.peers.rank, "world_size": self.peers.layout.world_size, "sha256_by_rank": by_rank}
            reference = by_rank[0][0]
            differing = [f"rank {r} drafter-{i}" for r, sums in enumerate(by_rank) for i, c in enumerate(sums)
                         if c != reference]
            if differing:
                raise ReplicasDiverged(
                    f"drafter replicas differ across ranks after step {step}: {', '.join(differing)} differ from rank 0 "
                    f"drafter-0 (sha256 by rank: {'; '.join(', '.join(c[:16] for c in sums) for sums in by_rank)})")
        self.events.emit(REPLICAS, step=step, devices=[r.device for r in replicas], sha256=self.checksums, **fields)
        count = sum(len(sums) for sums in by_rank)
        say(f"{count} drafter replica(s) identical after step {step}: weights sha256 {self.checksums[0]}")

    def _configure_compiler(self) -> None:
        """Decide what every drafter compiles and set the compiler up for it, in the main
        thread, before any drafter starts (compiler settings are process-wide)."""
        assert self.prepared is not None
        self.compile_plan = plan = plan_compile(self.config, self.prepared.shapes)
        if plan.mode != "off":
            self.compile_cache = open_compile_cache(self.run_dir,
                                                    compile_key_facts(self.prepared.run.drafter_devices[0]))
        configure_compiler(plan.mode, plan.num_drafters, plan.shapes_per_drafter, plan.dynamic_shapes)
        if plan.buckets:
            say(f"compile: cudagraphs captures {len(plan.buckets)} shape bucket(s) per drafter: "
                f"{', '.join(f'{b.rows}x{b.length} ({b.blocks} blocks)' for b in plan.buckets)}")

    def _run_threaded(self, prepared: Prepared) -> None:
        run, latch, pipe = prepared.run, self.latch, self.config.pipeline
        drafters, targets = len(run.drafter_devices), len(run.target_devices)
        channels = Channels(
            target_queues=[StoppableQueue(f"target-{t}", pipe.queue_size, latch, pipe.poll_s) for t in range(targets)],
            drafter_queues=[StoppableQueue(f"drafter-{r}", pipe.queue_size, latch, pipe.poll_s)
                            for r in range(drafters)],
            eval_queue=StoppableQueue("eval", 2, latch, pipe.poll_s) if prepared.evaluator else None,
            rendezvous=Rendezvous(drafters, latch))
        schedule = self.schedule = prepared.output_schedule([*channels.target_queues, *channels.drafter_queues])
        self._configure_compiler()
        for index in range(drafters):
            worker = self._start(f"drafter-{index}", drafter_body(run, schedule, channels, index, self._start_replica))
            worker.wait_until_ready(self.config.runtime.ready_timeout_s, poll=self.poll)
        forbid_compiles()  # before any drafter trains: every shape of the data is built
        if self.peers is not None:
            self.peers.arrive(READY)
        for index in range(targets):
            self._start(f"target-{index}", target_body(run, channels, index))
        self._start("prefetch", prefetch_body(run, channels))
        evaluator = self._start("eval", eval_body(run, channels, prepared.evaluator)) if prepared.evaluator else None
        self._set_phase("train")
        schedule.training_started()
        drafter_workers = self.workers[:drafters]
        while True:
            self.poll()
            if latch.failure is not None:
                name, exc = latch.failure
                if isinstance(exc, PeerFailed):
                    raise exc  # recorded once, where it was found
                raise ThreadFailed(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            latch.check()
            if all(w.done.is_set() for w in drafter_workers):
                if self.checksums is None:
                    self._replicas_done()
                if evaluator is None or evaluator.done.is_set():
                    return
                if self.phase != "eval":
                    self._set_phase("eval")  # training is over; the final evaluation runs
            time.sleep(0.1)

    def _start(self, name: str, body) -> JobThread:
        worker = JobThread(name, self.latch, body)
        self.workers.append(worker)
        worker.start()
        return worker

    def _run_sequential(self, prepared: Prepared) -> None:
        """The same work in the main thread, one part after another (for comparison)."""
        run, faults = prepared.run, prepared.run.faults
        schedule = self.schedule = prepared.output_schedule([])
        drafters, targets = len(run.drafter_devices), len(run.target_devices)
        for name in self.config.thread_names()[1:]:
            faults.fire(name)
        self._configure_compiler()
        replicas = [self._start_replica(index) for index in range(drafters)]
        forbid_compiles()
        if self.peers is not None:
            self.peers.arrive(READY)
            self.peers.wait_for_all(READY, self.config.runtime.ready_timeout_s)

        def evaluate(request: EvalRequest) -> None:
            if request.final:
                self._set_phase("eval")
            if not request.baseline:
                faults.fire("eval", request.step)
            prepared.evaluator.measure(request)

        schedule.before_training(replicas[0], evaluate)
        self._set_phase("train")
        schedule.training_started()
        for step in range(run.start_step + 1, run.total_steps + 1):
            self.step = step
            self.poll()
            self.latch.check()
            faults.fire("prefetch", step)
            stats: list = [None] * drafters
            poisons = [False] * drafters
            for micro in range(run.plan.accumulate):
                for replica in replicas:
                    batch = run.host_batch(step, replica.index, micro)
                    if micro == 0:
                        faults.fire(f"target-{replica.index % targets}", step)
                    features = run.features(replica.index % targets, batch)
                    if micro == 0:
                        faults.fire(f"drafter-{replica.index}", step)
                        poisons[replica.index] = faults.poisons(f"drafter-{replica.index}", step)
                    stats[replica.index] = replica.run_step(features, poisons[replica.index], stats[replica.index])
            averaged = run.exchange.average([replica.post(s) for replica, s in zip(replicas, stats)])
            try:  # a non-finite step fails in the first, before any replica applied it
                for replica, mean in zip(replicas, averaged):
                    applied = replica.apply(mean, step)
            except NonFiniteStep as exc:
                reporter_rank = exc.reporter // len(replicas)
                if self.peers is not None and reporter_rank != self.peers.rank:  # that rank records the root cause
                    raise self.peers.peer_failed(reporter_rank, type(exc).__name__, str(exc)) from exc
                raise
            self.latch.progressed()
            schedule.after_step(step, replicas[0], applied, evaluate)
        self._set_phase("shutdown")
        self._replicas_done()
        schedule.after_training(replicas[0], evaluate)

    def _teardown(self) -> None:
        """Stop every thread; wait at most stop_grace_s for them to finish their step."""
        self.latch.request_stop(self.latch.stop_reason or "run over")
        deadline = time.monotonic() + self.config.runtime.stop_grace_s
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        self.alive = [w.name for w in self.workers if w.is_alive()]
        report_threads_still_running(self.alive, self.config.runtime.stop_grace_s, self.fault_log)

    def _stopped(self) -> int:
        """SIGTERM (or SIGINT): stop, checkpoint (rank 0) if the lead replica stopped cleanly, exit 128+signal."""
        self._set_phase("shutdown")
        self._teardown()
        schedule, lead = self.schedule, self.replicas.get(0)
        lead_thread = next((w for w in self.workers if w.name == "drafter-0"), None)
        # Sequential runs stop between steps; a lead thread that ended stopped between steps too.
        lead_stopped = lead is not None and (lead_thread is None or not lead_thread.is_alive())
        if (schedule is not None and schedule.writes_outputs and lead_stopped and self.config.checkpoint.on_stop
                and lead.completed_step > schedule.last_checkpoint):
            if is_cuda(lead.device):  # its last update ran on the lead thread's stream, not this one's
                torch.cuda.synchronize(lead.device)
            try:
                schedule.save_checkpoint(lead)
            except NonFiniteWeights as exc:  # the newest finite checkpoint stays `latest`
                say(f"no checkpoint on stop: {exc}")
            except StopRequested:  # the previous checkpoint's write failed (recorded by its writer)
                pass
        if not self._finish_checkpoints():
            return EXIT_FAILED
        signum = self._signal or signal.SIGTERM
        return 128 + int(signum)
