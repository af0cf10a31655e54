"""What every part of a training run shares (`Run`): config, data, devices, the stop
latch, the faults and the gradient exchange, and the micro-batches made from them.

The threaded pipeline (pipeline.py) and rank 0's schedule (schedule.py) both build on
it; it imports neither.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..config import JobConfig
from ..data.batches import BatchPlan, HostBatch, Sample, collate
from ..devices import Fence, handoff, is_cuda
from ..faults import FaultInjector
from ..model.target import FeatureTap
from ..runlog import EventLog
from ..threads import StopLatch
from .distributed import Layout, Peers
from .gradients import GradientExchange
from .replica import FeatureBatch


class WaitMeter:
    """Seconds each thread spent blocked (on queues or peers) since the last step report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[str, float] = {}

    def add(self, thread: str, seconds: float) -> None:
        with self._lock:
            self._waits[thread] = self._waits.get(thread, 0.0) + seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            taken, self._waits = self._waits, {}
        return {k: round(v, 4) for k, v in sorted(taken.items())}


@dataclasses.dataclass
class Run:
    """What every part of a run shares: config, data, devices, the stop latch, the
    gradient exchange. What rank 0 does besides training is schedule.OutputSchedule's."""

    config: JobConfig
    run_dir: Path
    events: EventLog
    latch: StopLatch
    faults: FaultInjector
    samples: Sequence[Sample]  # a data.batches.StoredSamples in a run
    plan: BatchPlan
    pad_id: int
    taps: list[FeatureTap]  # one per target device
    target_devices: list[str]
    drafter_devices: list[str]
    start_step: int
    exchange: GradientExchange
    peers: Peers | None = None  # the other processes of the run, if any
    waits: WaitMeter = dataclasses.field(default_factory=WaitMeter)

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps

    @property
    def layout(self) -> Layout:
        return self.exchange.layout

    def host_batch(self, step: int, replica: int, micro: int = 0) -> HostBatch:
        entry = self.plan.entry(step, self.layout.global_index(replica), micro)
        batch = collate(self.samples, entry, step, replica, self.config.data, self.config.drafter,
                        self.pad_id, self.config.seed, micro)
        return batch.pin() if is_cuda(self.target_devices[0]) else batch

    def features(self, target: int, batch: HostBatch) -> FeatureBatch:
        device, drafter_device = self.target_devices[target], self.drafter_devices[batch.replica]
        features = self.taps[target].features(batch.input_ids.to(device, non_blocking=True))
        return FeatureBatch(batch, handoff(features, drafter_device), Fence(device))

    def micro_batches(self, step: int, replica: int) -> Iterator[FeatureBatch]:
        """Replica `replica`'s micro-batches of `step`, each made in the calling thread
        when asked for, as prefetch and target-(replica % T) make them in the threaded
        pipeline, that target's fault included (a sequential run)."""
        target = replica % len(self.target_devices)
        for micro in range(self.plan.accumulate):
            batch = self.host_batch(step, replica, micro)
            if micro == 0:
                self.faults.fire(f"target-{target}", step)
            yield self.features(target, batch)
