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

import functools
import signal
import threading
import time
from pathlib import Path

import torch
from dflash_contract.events import REPLICAS

from ..compiling.cache import is_warm, save_after_first_compile
from ..compiling.policy import build_train_step, example_inputs, forbid_compiles
from ..config import JobConfig
from ..devices import is_cuda
from ..memory import ledger
from ..model.drafter import NonFiniteWeights
from ..runlog import EventLog, say
from ..startup_phases import phase
from ..threads import StopLatch, StopRequested, JobThread
from ..training.distributed import PeerFailed, Peers, join
from ..training.loop import run_steps
from ..training.pipeline import READY, Channels, drafter_body, eval_body, prefetch_body, target_body
from ..training.replica import Replica, ReplicasDiverged, verify_replicas_identical
from ..training.schedule import EvalRequest
from .common import EXIT_FAILED, EXIT_OK, JobControl, ThreadFailed, end_now, report_threads_still_running
from .startup import Session, prepare


class Coordinator(JobControl):
    def __init__(self, config: JobConfig, run_dir: Path, events: EventLog, latch: StopLatch, fault_log):
        super().__init__(events, latch, config.runtime.heartbeat_s)
        self.config = config
        self.run_dir = run_dir
        self.fault_log = fault_log
        self.step: int | None = None  # the step the main thread trains (a sequential run)
        self.workers: list[JobThread] = []
        self.alive: list[str] = []  # threads still running at exit
        self.replicas: dict[int, Replica] = {}  # this process's, each once it is built

    def poll(self) -> None:
        self.act_on_signal("stopping")
        lead = self.replicas.get(0)
        self.heartbeat_if_due(step=lead.completed_step if lead else None)

    def run(self) -> int:
        peers: Peers | None = None
        session: Session | None = None
        done = False
        try:
            self._set_phase("startup")
            peers = join(self.config.distributed, len(self.config.devices.drafters),
                         not self.config.devices.cpu_only, self.latch, where=lambda: (self.phase, self.step),
                         on_stuck=self._end_now, exit_after_s=self.config.runtime.stop_grace_s + 10.0)
            session = prepare(self.config, self.run_dir, self.events, self.latch, peers)
            if session.channels is None:
                checksums = self._run_sequential(session)
            else:
                checksums = self._run_threaded(session, session.channels)
            self._verify_replicas(session, checksums)
            self._set_phase("shutdown")
            if peers is not None:  # before the stop below, which would tell the peers this rank stopped
                peers.leave(ok=True)
            done = True
        except (StopRequested, PeerFailed):
            pass  # a stop, or a failure recorded where it was found (a worker, a peer): the shutdown tells which
        except BaseException as exc:  # noqa: BLE001 - the coordinator's own failure is recorded too
            self.latch.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(), phase=self.phase,
                                      step=self.step)
        return self._shut_down(session, peers, done)

    def _shut_down(self, session: Session | None, peers: Peers | None, done: bool) -> int:
        """How every run ends: its threads stopped (each given stop_grace_s to finish its
        step), then the exit code. A run that is `done` exits 0. One that failed (a record
        is on file: a worker's, a peer's or the coordinator's own) exits 1 once the
        checkpoint being written is complete; one that was stopped (a signal, a peer that
        stopped) first writes the stop checkpoint, then exits 128+signal, or 1 if a write
        failed. Either way this rank then leaves its peers."""
        stopped = not done and self.latch.failure is None
        if stopped:
            self._set_phase("shutdown")
        self._stop_threads()
        if done:
            return EXIT_OK
        code = EXIT_FAILED
        if stopped:
            if session is not None:
                self._checkpoint_on_stop(session)
            code = 128 + int(self._signal or signal.SIGTERM)
        if session is not None and not _checkpoints_written(session):
            code = EXIT_FAILED
        if peers is not None:
            peers.leave(ok=False)
        return code

    def _stop_threads(self) -> None:
        """Stop every thread; wait at most stop_grace_s for them to finish their step."""
        self.latch.request_stop(self.latch.stop_reason or "run over")
        deadline = time.monotonic() + self.config.runtime.stop_grace_s
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        self.alive = [w.name for w in self.workers if w.is_alive()]
        report_threads_still_running(self.alive, self.config.runtime.stop_grace_s, self.fault_log)

    def _checkpoint_on_stop(self, session: Session) -> None:
        """Rank 0's checkpoint of the lead replica, if it stopped between steps past the newest one."""
        schedule, lead = session.schedule, self.replicas.get(0)
        lead_thread = next((w for w in self.workers if w.name == "drafter-0"), None)
        # Sequential runs stop between steps; a lead thread that ended stopped between steps too.
        lead_stopped = lead is not None and (lead_thread is None or not lead_thread.is_alive())
        if not (schedule.writes_outputs and lead_stopped and self.config.checkpoint.on_stop
                and lead.completed_step > schedule.last_checkpoint):
            return
        if is_cuda(lead.device):  # its last update ran on the lead thread's stream, not this one's
            torch.cuda.synchronize(lead.device)
        try:
            schedule.save_checkpoint(lead)
        except NonFiniteWeights as exc:  # the newest finite checkpoint stays `latest`
            say(f"no checkpoint on stop: {exc}")
        except StopRequested:  # the previous checkpoint's write failed (recorded by its writer)
            pass

    def _end_now(self, code: int) -> None:
        end_now(self.events, self.fault_log, self.config.runtime.stop_grace_s + 10.0, code)

    def _start_replica(self, session: Session, index: int) -> Replica:
        """Runs in the drafter's thread (or the main thread when sequential)."""
        run, cache = session.run, session.compile_cache
        before = ledger.mark(run.drafter_devices[index])  # what the drafter holds, from here
        with phase("set up", drafter=index, device=run.drafter_devices[index]):
            replica = session.make_replica(index)
            example = example_inputs(replica.objective, self.config.data.pad_multiple,
                                     replica.drafter.fc.in_features, replica.device)
        cache_state = None if cache is None else "warm" if cache.warm or is_warm(cache.folder) else "cold"
        with phase("build train step", drafter=index, compile=self.config.compile, cache=cache_state) as detail:
            built = build_train_step(session.compile_plan, replica.objective, example)
            detail.update(built.report.event_detail())
            replica.train_step = built
            started = time.perf_counter()
            replica.prepare_optimizer()  # under cudagraphs, captures the optimizer step too
            detail["optimizer_s"] = round(time.perf_counter() - started, 3)
        ledger.note_since(before, f"drafter-{index}")
        say(f"drafter {index}: {built.report.describe()}")
        if index == 0 and cache is not None:  # the first compile is done: what it made can serve the next run
            save_after_first_compile(cache)
        self.replicas[index] = replica
        say(f"drafter {index} ready on {replica.device} (compile {self.config.compile}, "
            f"{sum(p.numel() for p in replica.drafter.parameters()):,} parameters, from step {run.start_step})")
        return replica

    def _replicas_done(self, session: Session) -> list[str]:
        """Once the drafters are done: this process's replicas must hold the same weights;
        their checksums go to the other ranks (before rank 0's final evaluation, which the
        others need not wait for)."""
        replicas = [self.replicas[i] for i in sorted(self.replicas)]
        # The step this process reached, in its events now: heartbeats come at most every
        # heartbeat_s, and only rank 0 reports steps, so another rank's status would show
        # an older one for good.
        self.heartbeat(step=replicas[0].completed_step)
        checksums = verify_replicas_identical(replicas)
        if session.run.peers is not None:
            session.run.peers.publish("sha256", checksums)
        return checksums

    def _verify_replicas(self, session: Session, checksums: list[str]) -> None:
        """After the last step: every replica of every rank holds the same weights (checksums in events)."""
        peers = session.run.peers
        replicas = [self.replicas[i] for i in sorted(self.replicas)]
        step = replicas[0].completed_step
        by_rank = [checksums]
        fields = {}
        if peers is not None:
            by_rank = peers.collect("sha256", self.config.distributed.timeout_s)
            fields = {"rank": peers.rank, "world_size": peers.layout.world_size, "sha256_by_rank": by_rank}
            reference = by_rank[0][0]
            differing = [f"rank {r} drafter-{i}" for r, sums in enumerate(by_rank) for i, c in enumerate(sums)
                         if c != reference]
            if differing:
                raise ReplicasDiverged(
                    f"drafter replicas differ across ranks after step {step}: {', '.join(differing)} differ from rank 0 "
                    f"drafter-0 (sha256 by rank: {'; '.join(', '.join(c[:16] for c in sums) for sums in by_rank)})")
        self.events.emit(REPLICAS, step=step, devices=[r.device for r in replicas], sha256=checksums, **fields)
        count = sum(len(sums) for sums in by_rank)
        say(f"{count} drafter replica(s) identical after step {step}: weights sha256 {checksums[0]}")

    def _run_threaded(self, session: Session, channels: Channels) -> list[str]:
        """The pipeline's threads (training/pipeline.py), watched until the drafters and the final evaluation
        are done."""
        run, schedule, latch = session.run, session.schedule, self.latch
        start_replica = functools.partial(self._start_replica, session)
        drafters = []
        for index in range(len(run.drafter_devices)):
            drafters.append(self._start(f"drafter-{index}", drafter_body(run, schedule, channels, index, start_replica)))
            drafters[-1].wait_until_ready(self.config.runtime.ready_timeout_s, poll=self.poll)
        forbid_compiles()  # before any drafter trains: every shape of the data is built
        if run.peers is not None:
            run.peers.arrive(READY)
        for index in range(len(run.target_devices)):
            self._start(f"target-{index}", target_body(run, channels, index))
        self._start("prefetch", prefetch_body(run, channels))
        evaluator = self._start("eval", eval_body(run, channels, session.evaluator)) if session.evaluator else None
        self._set_phase("train")
        schedule.training_started()
        checksums = None
        while True:
            self.poll()
            if latch.failure is not None:
                name, exc = latch.failure
                if isinstance(exc, PeerFailed):
                    raise exc  # recorded once, where it was found
                raise ThreadFailed(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            latch.check()
            if all(w.done.is_set() for w in drafters):
                if checksums is None:
                    checksums = self._replicas_done(session)
                if evaluator is None or evaluator.done.is_set():
                    return checksums
                if self.phase != "eval":
                    self._set_phase("eval")  # training is over; the final evaluation runs
            time.sleep(0.1)

    def _start(self, name: str, body) -> JobThread:
        worker = JobThread(name, self.latch, body)
        self.workers.append(worker)
        worker.start()
        return worker

    def _run_sequential(self, session: Session) -> list[str]:
        """The same work in the main thread, one part after another (for comparison)."""
        run, schedule, faults = session.run, session.schedule, session.run.faults
        for name in self.config.thread_names()[1:]:  # every thread's start-up faults, in the one thread there is
            faults.fire(name)
        replicas = [self._start_replica(session, index) for index in range(len(run.drafter_devices))]
        lead = replicas[0]
        forbid_compiles()
        if run.peers is not None:
            run.peers.arrive(READY)
            run.peers.wait_for_all(READY, self.config.runtime.ready_timeout_s)

        def evaluate(request: EvalRequest) -> None:
            if request.final:
                self._set_phase("eval")
            session.evaluator.measure(request)

        def before_step(step: int) -> None:
            self.step = step
            self.poll()
            self.latch.check()
            faults.fire("prefetch", step)

        self._set_phase("train")
        schedule.training_started()
        run_steps(run, schedule, replicas, lambda step, replica: run.micro_batches(step, replica.index),
                  run.exchange.average, evaluate, before_step)
        self._set_phase("shutdown")
        checksums = self._replicas_done(session)
        schedule.after_training(lead, evaluate)
        return checksums


def _checkpoints_written(session: Session) -> bool:
    """Wait for the checkpoint being written, if any; False if its write failed."""
    try:
        session.schedule.checkpoints.wait()
        return True
    except StopRequested:
        return False


