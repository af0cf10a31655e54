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

import faulthandler
import signal
import threading
import time
from pathlib import Path

import torch

from .compile_cache import compile_key_facts, use_compile_cache
from .compile_policy import CompilePlan, build_train_step, configure_compiler, example_inputs, plan_compile
from .config import TrainConfig
from .devices import is_cuda
from .model import NonFiniteWeights
from .pipeline import Channels, EvalRequest, average_gradients, drafter_body, eval_body, prefetch_body, target_body
from .replica import Replica, verify_replicas_identical
from .runlog import EventLog, dump_header, say
from .startup import Prepared, prepare
from .threads import JobControl, Rendezvous, RunState, StopRequested, StoppableQueue, Worker

EXIT_OK, EXIT_FAILED = 0, 1


class ThreadFailed(RuntimeError):
    """The coordinator's own error when a worker failed; chained from the worker's exception."""


class Coordinator(JobControl):
    def __init__(self, config: TrainConfig, run_dir: Path, events: EventLog, state: RunState, fault_log):
        super().__init__(events, state, config.runtime.heartbeat_s)
        self.config = config
        self.run_dir = run_dir
        self.fault_log = fault_log
        self.step: int | None = None
        self.workers: list[Worker] = []
        self.alive: list[str] = []  # threads still running at exit
        self.replicas: dict[int, Replica] = {}
        self.prepared: Prepared | None = None
        self.compile_plan: CompilePlan | None = None  # set before the first drafter starts

    def poll(self) -> None:
        self.act_on_signal("stopping")
        lead = self.replicas.get(0)
        self.heartbeat_if_due(step=lead.completed_step if lead else None)

    def run(self) -> int:
        try:
            self._set_phase("startup")
            self.prepared = prepare(self.config, self.run_dir, self.events, self.state)
            if self.config.pipeline.mode == "sequential":
                self._run_sequential(self.prepared)
            else:
                self._run_threaded(self.prepared)
            self._verify_replicas()
            self._set_phase("shutdown")
            self._teardown()
            return EXIT_OK
        except StopRequested:
            if self.state.failure is not None:  # a worker outside the drafters failed (the checkpoint writer)
                self._teardown()
                self._finish_checkpoints()
                return EXIT_FAILED
            return self._stopped()
        except BaseException as exc:  # noqa: BLE001 - the coordinator's own failure is recorded too
            self.state.record_failure(exc, thread="coordinator", thread_ident=threading.get_ident(), phase=self.phase,
                                      step=self.step)
            self._teardown()
            self._finish_checkpoints()
            return EXIT_FAILED

    def _finish_checkpoints(self) -> bool:
        """Wait for the checkpoint being written, if any; False if its write failed."""
        if self.prepared is None:
            return True
        try:
            self.prepared.run.checkpoints.wait()
            return True
        except StopRequested:
            return False

    def _start_replica(self, index: int) -> Replica:
        """Runs in the drafter's thread (or the main thread when sequential)."""
        assert self.prepared is not None and self.compile_plan is not None
        replica = self.prepared.make_replica(index)
        run = self.prepared.run
        example = example_inputs(replica.objective, self.config.data.pad_multiple,
                                 replica.drafter.fc.in_features, replica.device)
        replica.train_step = build_train_step(self.compile_plan, replica.objective, example)
        self.replicas[index] = replica
        say(f"drafter {index} ready on {replica.device} (compile {self.config.compile}, "
            f"{sum(p.numel() for p in replica.drafter.parameters()):,} parameters, from step {run.start_step})")
        return replica

    def _verify_replicas(self) -> None:
        """After the last step: all replicas must hold the same weights (checksums in events)."""
        replicas = [self.replicas[i] for i in sorted(self.replicas)]
        checksums = verify_replicas_identical(replicas)
        step = replicas[0].completed_step
        self.events.emit("replicas", step=step, devices=[r.device for r in replicas], sha256=checksums)
        say(f"{len(replicas)} drafter replica(s) identical after step {step}: weights sha256 {checksums[0]}")

    def _configure_compiler(self) -> None:
        """Decide what every drafter compiles and set the compiler up for it, in the main
        thread, before any drafter starts (compiler settings are process-wide)."""
        self.compile_plan = plan = plan_compile(self.config)
        if plan.mode != "off" and self.prepared is not None:
            use_compile_cache(self.run_dir, compile_key_facts(self.prepared.run.drafter_devices[0]))
        configure_compiler(plan.mode, plan.num_drafters, plan.shapes_per_drafter)
        if plan.buckets:
            say(f"compile: cudagraphs captures {len(plan.buckets)} shape bucket(s) per drafter: "
                f"{', '.join(f'{b.rows}x{b.length} ({b.blocks} blocks)' for b in plan.buckets)}")

    def _run_threaded(self, prepared: Prepared) -> None:
        run, state, pipe = prepared.run, self.state, self.config.pipeline
        drafters, targets = len(run.drafter_devices), len(run.target_devices)
        channels = Channels(
            target_queues=[StoppableQueue(f"target-{t}", pipe.queue_size, state, pipe.poll_s) for t in range(targets)],
            drafter_queues=[StoppableQueue(f"drafter-{r}", pipe.queue_size, state, pipe.poll_s)
                            for r in range(drafters)],
            eval_queue=StoppableQueue("eval", 2, state, pipe.poll_s) if run.evaluator else None,
            rendezvous=Rendezvous(drafters, state))
        run.queues = [*channels.target_queues, *channels.drafter_queues]
        self._configure_compiler()
        for index in range(drafters):
            worker = self._start(f"drafter-{index}", drafter_body(run, channels, index, self._start_replica))
            worker.wait_until_ready(self.config.runtime.ready_timeout_s, poll=self.poll)
        for index in range(targets):
            self._start(f"target-{index}", target_body(run, channels, index))
        self._start("prefetch", prefetch_body(run, channels))
        evaluator = self._start("eval", eval_body(run, channels)) if run.evaluator else None
        self._set_phase("train")
        run.training_started()
        drafter_workers = self.workers[:drafters]
        while True:
            self.poll()
            if state.failure is not None:
                name, exc = state.failure
                raise ThreadFailed(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            state.check()
            if all(w.done.is_set() for w in drafter_workers):
                if evaluator is None or evaluator.done.is_set():
                    return
                if self.phase != "eval":
                    self._set_phase("eval")  # training is over; the final evaluation runs
            time.sleep(0.1)

    def _start(self, name: str, body) -> Worker:
        worker = Worker(name, self.state, body)
        self.workers.append(worker)
        worker.start()
        return worker

    def _run_sequential(self, prepared: Prepared) -> None:
        """The same work in the main thread, one part after another (for comparison)."""
        run, faults = prepared.run, prepared.run.faults
        drafters, targets = len(run.drafter_devices), len(run.target_devices)
        for name in self.config.thread_names()[1:]:
            faults.fire(name)
        self._configure_compiler()
        replicas = [self._start_replica(index) for index in range(drafters)]

        def evaluate(request: EvalRequest) -> None:
            if request.final:
                self._set_phase("eval")
            if not request.baseline:
                faults.fire("eval", request.step)
            run.evaluator.measure(request)

        run.before_training(replicas[0], evaluate)
        self._set_phase("train")
        run.training_started()
        for step in range(run.start_step + 1, run.total_steps + 1):
            self.step = step
            self.poll()
            self.state.check()
            faults.fire("prefetch", step)
            stats, batches = [], []
            for replica in replicas:
                batch = run.host_batch(step, replica.index)
                faults.fire(f"target-{replica.index % targets}", step)
                features = run.features(replica.index % targets, batch)
                faults.fire(f"drafter-{replica.index}", step)
                stats.append(replica.run_step(features, poison=faults.poisons(f"drafter-{replica.index}", step)))
                batches.append(batch)
            posted = [replica.gradients() for replica in replicas]
            losses = [s.loss for s in stats]
            for replica in replicas:  # a non-finite step fails in the first, before any replica applied it
                applied = replica.apply(average_gradients(posted, replica.device), step, losses)
            self.state.progressed()
            run.after_step(step, replicas[0], stats, batches, applied, evaluate)
        self._set_phase("shutdown")
        run.after_training(replicas[0], evaluate)

    def _teardown(self) -> None:
        """Stop every thread; wait at most stop_grace_s for them to finish their step."""
        self.state.request_stop(self.state.stop_reason or "run over")
        deadline = time.monotonic() + self.config.runtime.stop_grace_s
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        self.alive = [w.name for w in self.workers if w.is_alive()]
        report_threads_still_running(self.alive, self.config.runtime.stop_grace_s, self.fault_log)

    def _stopped(self) -> int:
        """SIGTERM (or SIGINT): stop, checkpoint if the lead replica stopped cleanly, exit 128+signal."""
        self._set_phase("shutdown")
        self._teardown()
        run = self.prepared.run if self.prepared else None
        lead = self.replicas.get(0)
        lead_thread = next((w for w in self.workers if w.name == "drafter-0"), None)
        # Sequential runs stop between steps; a lead thread that ended stopped between steps too.
        lead_stopped = lead is not None and (lead_thread is None or not lead_thread.is_alive())
        if (run is not None and lead_stopped and self.config.checkpoint.on_stop
                and lead.completed_step > max(run.last_checkpoint, run.start_step)):
            if is_cuda(lead.device):  # its last update ran on the lead thread's stream, not this one's
                torch.cuda.synchronize(lead.device)
            try:
                run.save_checkpoint(lead)
            except NonFiniteWeights as exc:  # the newest finite checkpoint stays `latest`
                say(f"no checkpoint on stop: {exc}")
            except StopRequested:  # the previous checkpoint's write failed (recorded by its writer)
                pass
        if not self._finish_checkpoints():
            return EXIT_FAILED
        signum = self._signal or signal.SIGTERM
        return 128 + int(signum)


def report_threads_still_running(alive: list[str], grace_s: float, fault_log) -> None:
    """Say which threads outlived the stop and dump every thread's stack to faulthandler.log."""
    if not alive:
        return
    say(f"threads still running after {grace_s:.0f}s: {', '.join(alive)}; their stacks are in faulthandler.log")
    fault_log.write(dump_header(f"threads still running after the stop: {', '.join(alive)}"))
    fault_log.flush()  # faulthandler writes to the descriptor, past this buffer
    faulthandler.dump_traceback(file=fault_log, all_threads=True)


def install_signal_handlers(job) -> None:
    """`job`: the job's coordinator (Coordinator, regenerate.Regeneration,
    evaluation.EvaluationJob), whose on_signal notes the signal for its main loop."""
    signal.signal(signal.SIGTERM, job.on_signal)
    signal.signal(signal.SIGINT, job.on_signal)

