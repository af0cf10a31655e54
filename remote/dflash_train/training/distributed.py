"""One run over several processes (one per host), joined by torch.distributed.

Every host's supervisor starts one trainer process with the standard variables RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT (what `torchrun --nproc-per-node 1` sets too);
`join` makes the process group from them (init_method env://: rank 0 hosts the c10d
TCPStore). Without WORLD_SIZE, or with 1, there is no group and nothing here runs.

A failure must stop every host within seconds, whatever collective the others wait in.
On the store, under dflash/<run id>/:

    abort      {rank, kind: failed|stopped, exc_type, message}: written by the first rank
               that fails or stops, before it tears down (compare_set: the first one wins)
    alive/<r>  rank r's watchdog counts up every WATCH_S
    left/<r>   rank r ended its part normally (its count stops for a good reason)
    acked      peers that saw `abort` (the failed rank 0 waits for them before leaving)

Every rank runs a watchdog thread that reads them, from before the process group forms:
a peer's `failed` record, a peer silent for peer_timeout_s once it has been heard, the
store gone (rank 0 gone), or the store silent for peer_timeout_s (its host cut off by the
network, or frozen) make this rank's run stop with ONE errors.jsonl record, PeerFailed,
whose detail names the peer and its root cause (and how long it was silent, for a
silence); a peer's `stopped` record
stops this rank as a signal would (exit 143). A rank that has not ended its part
`exit_after_s` later (busy in a startup step that does not look at the stop event, say
loading a target; or still in the join, which nothing can wake: then JOIN_EXIT_S) is
ended by the watchdog (`on_stuck`). A trainer killed outright writes no `abort`: its
supervisor does (peer_notice.py), so its peers end in seconds even while they wait in
the join; a collective broken by a peer that died names the peer whose `alive` count
stopped.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import queue
import threading
import signal
import time
from typing import Any, Callable

import torch

from dflash_contract.names import ABORT_KEY, RUN_ID_ENV
from dflash_contract.records import AbortRecord

from ..config import DistributedConfig
from ..runlog import say
from ..startup_phases import phase
from ..threads import StopLatch, StopRequested

WATCH_S = 0.5  # the watchdog's period: how fast a peer's failure is seen
ACK_S = 5.0  # how long a failed rank 0 keeps its store up for the others to read why
COLLECTIVE_CAUSE_S = 2.0  # after a broken collective, how long to look for the peer's abort record
JOIN_EXIT_S = 1.0  # a peer failed while this rank waits in the join: no call of ours can end that wait
# A store call past its deadline gets this much more before it counts as silence: a process
# stopped (SIGSTOP) while it waited resumes with its clock past the deadline, and the answer
# (or the error of a store that went away meanwhile) comes in moments.
LATE_S = 2.0


class JoinFailed(RuntimeError):
    """The process group could not be formed (no rendezvous, a peer that never came)."""


class CollectiveFailed(RuntimeError):
    """A collective failed and no peer said why (it died without a record, or the network broke)."""


class PeerFailed(RuntimeError):
    """This rank stopped because another one failed; `detail` names that rank and its root
    cause, and `silence_s` how long nothing was heard from it (None: it failed, or went away)."""

    def __init__(self, peer_rank: int, peer_exc_type: str | None, peer_message: str, silence_s: float | None = None):
        cause = f"{peer_exc_type}: {peer_message}" if peer_exc_type else peer_message
        super().__init__(f"rank {peer_rank} failed ({cause}); this rank stopped")
        self.detail = {"peer_rank": peer_rank, "peer_exc_type": peer_exc_type, "peer_message": peer_message,
                       "silence_s": silence_s}


class StoreSilent(Exception):
    """A store call that was not answered by its deadline."""


class StoreCalls:
    """Store calls made in a thread of their own, each waited for until a deadline. c10d's
    store client waits for an answer without end (its timeout bounds the connect only):
    a rank cut off from the store by the network would wait in a call until the network
    returned. A call that misses its deadline leaves that thread waiting; the calls after
    it queue behind it and miss theirs too."""

    def __init__(self, name: str):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, answered, box = self._requests.get()
            try:
                box["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
                box["error"] = exc
            answered.set()

    def call(self, call: Callable[[], Any], deadline_s: float) -> Any:
        """call()'s value (or its exception); StoreSilent when none came within `deadline_s`."""
        answered, box = threading.Event(), {}
        self._requests.put((call, answered, box))
        if not (answered.wait(deadline_s) or answered.wait(LATE_S)):
            raise StoreSilent(f"no answer within {deadline_s:.0f}s")
        if "error" in box:
            raise box["error"]
        return box["value"]


def first_line(exc: BaseException) -> str:
    """c10d errors carry a C++ backtrace after their first line."""
    return str(exc).strip().split("\n")[0]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this process sits: replicas are numbered rank * local + i over the whole run."""

    rank: int = 0
    world_size: int = 1
    local_replicas: int = 1

    @property
    def global_replicas(self) -> int:
        return self.world_size * self.local_replicas

    def global_index(self, local: int) -> int:
        return self.rank * self.local_replicas + local

    def replica_name(self, global_index: int) -> str:
        """drafter-i, and the rank that runs it when there are several."""
        if self.world_size == 1:
            return f"drafter-{global_index}"
        return f"drafter-{global_index % self.local_replicas} of rank {global_index // self.local_replicas}"


def requested_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or "1")


def run_store_prefix() -> str:
    """Where this run's keys live on the rendezvous store (the module docstring's)."""
    return f"dflash/{os.environ.get(RUN_ID_ENV, 'run')}/"


def pick_backend(config: DistributedConfig, cuda: bool) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if cuda else "gloo"


def join(config: DistributedConfig, local_replicas: int, cuda: bool, latch: StopLatch, *,
         where: Callable[[], tuple[str, int | None]], on_stuck: Callable[[int], None],
         exit_after_s: float) -> "Peers | None":
    """The process group of this run, or None for a one-process run (WORLD_SIZE unset or 1).
    `where` gives the (phase, step) of a PeerFailed record the watchdog writes, and
    `on_stuck(code)` ends the process when it does not end by itself after a peer's end."""
    world = requested_world_size()
    if world <= 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise JoinFailed(f"WORLD_SIZE is {world} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not set (a multi-process run needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    rank, host, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    backend = pick_backend(config, cuda)
    if backend == "nccl":
        # wait() then blocks on the CPU and raises at the timeout instead of leaving a hung
        # kernel on the stream, and an abort (a peer failed) wakes it.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    with phase("join peers", rank=rank, world_size=world, backend=backend):
        return _join(config, local_replicas, latch, (rank, world, host, port, backend), where, on_stuck, exit_after_s)


def _join(config: DistributedConfig, local_replicas: int, latch: StopLatch, group: tuple[int, int, str, int, str],
          where: Callable[[], tuple[str, int | None]], on_stuck: Callable[[int], None], exit_after_s: float) -> "Peers":
    """join's work, once the group is known: (rank, world size, MASTER_ADDR, MASTER_PORT, backend)."""
    import torch.distributed as dist

    rank, world, host, port, backend = group
    address = f"{host}:{port}"
    say(f"joining the process group at {address} as rank {rank} of {world} ({backend})")
    joining = datetime.timedelta(seconds=config.join_timeout_s)
    try:
        # The store is made here rather than by init_process_group's env://, so the
        # watchdog reads it while the group forms. Two connections: the group's rendezvous
        # holds its own in a blocking wait, which would hold up the watchdog's.
        group_store = dist.TCPStore(host, port, world, rank == 0, joining, wait_for_workers=False)
        store = dist.TCPStore(host, port, None, False, joining)
    except Exception as exc:  # noqa: BLE001 - c10d raises several types for the same thing
        raise JoinFailed(f"rank {rank} could not join the process group of {world} at {address} within "
                         f"{config.join_timeout_s:.0f}s: its store did not answer "
                         f"({type(exc).__name__}: {first_line(exc)})") from exc
    peers = Peers(Layout(rank, world, local_replicas), config, backend,
                  dist.PrefixStore(run_store_prefix(), store), address, latch,
                  where, on_stuck, exit_after_s)
    peers.start_watchdog()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("group/", group_store), rank=rank,
                                world_size=world, timeout=joining)
        # The collectives' own group: the join may wait long for a slow host, a step may not.
        peers.group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=config.timeout_s),
                                     backend=backend)
    except Exception as exc:  # noqa: BLE001 - as above
        if peers.peer_failure is not None:  # a peer's end broke the join: that is on record
            raise peers.peer_failure from exc
        raise JoinFailed(f"rank {rank} could not join the process group of {world} at {address} within "
                         f"{config.join_timeout_s:.0f}s ({type(exc).__name__}: {first_line(exc)})") from exc
    peers.joined.set()
    peers.check_same_replicas()
    say(f"rank {rank} of {world} joined ({local_replicas} drafter replica(s) here, "
        f"{peers.layout.global_replicas} in the run)")
    return peers


class Peers:
    """This rank's view of the others: the collective group, the shared store and the watchdog."""

    def __init__(self, layout: Layout, config: DistributedConfig, backend: str, store, address: str,
                 latch: StopLatch, where: Callable[[], tuple[str, int | None]], on_stuck: Callable[[int], None],
                 exit_after_s: float):
        self.layout, self.config, self.backend = layout, config, backend
        self.store, self.address, self.latch = store, address, latch
        self.where, self.on_stuck, self.exit_after_s = where, on_stuck, exit_after_s
        self.group = None  # the collectives' group, once the process group is formed (join)
        self.joined = threading.Event()
        self._closing = threading.Event()
        self._left = False
        self._peer_lock = threading.Lock()
        self._peer_failure: PeerFailed | None = None
        self._watchdog: threading.Thread | None = None
        self._store_calls: StoreCalls | None = None  # the watchdog's (start_watchdog)
        latch.on_stop(self._on_local_stop)

    @property
    def peer_failure(self) -> "PeerFailed | None":
        """The PeerFailed this rank recorded, if a peer ended its run."""
        return self._peer_failure

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def others(self) -> list[int]:
        return [r for r in range(self.layout.world_size) if r != self.rank]

    # -- collectives -------------------------------------------------------------------

    def all_reduce_sum(self, flat: torch.Tensor) -> None:
        """Sum the 1-D `flat` over every rank, in place, in buckets of bucket_mb."""
        import torch.distributed as dist

        per_bucket = max(1, int(self.config.bucket_mb * (1 << 20)) // flat.element_size())
        try:
            works = [dist.all_reduce(flat[start:start + per_bucket], group=self.group, async_op=True)
                     for start in range(0, flat.numel(), per_bucket)]
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses of their own
            raise self._collective_failed("the gradient all-reduce", exc) from exc
        self.latch.check()  # an abort may have woken the wait: never apply what it left

    def share_from_rank0(self, value: Any, device: str) -> Any:
        """Rank 0's `value` (plain data: tensors, dicts, lists, numbers, strings, None, which
        the other ranks load with weights_only=True; ignored on the other ranks), on every rank. It goes through the collective group in pieces of bucket_mb staged on
        `device` (a CUDA device for NCCL): a checkpoint is gigabytes, too much for the store."""
        import io

        import torch.distributed as dist

        data = b""
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            data = buffer.getvalue()
            self.publish("shared-bytes", len(data))
        size = self.collect("shared-bytes", self.config.timeout_s, ranks=[0])[0]
        received = bytearray(size) if self.rank != 0 else bytearray()
        per_piece = max(1, int(self.config.bucket_mb * (1 << 20)))
        try:
            for start in range(0, size, per_piece):
                count = min(per_piece, size - start)
                if self.rank == 0:
                    piece = torch.frombuffer(bytearray(data[start:start + count]), dtype=torch.uint8).to(device)
                else:
                    piece = torch.empty(count, dtype=torch.uint8, device=device)
                dist.broadcast(piece, 0, group=self.group)
                if self.rank != 0:
                    received[start:start + count] = piece.cpu().numpy().tobytes()
        except Exception as exc:  # noqa: BLE001 - as in all_reduce_sum
            raise self._collective_failed("receiving rank 0's checkpoint", exc) from exc
        self.latch.check()
        if self.rank == 0:
            return value
        return torch.load(io.BytesIO(bytes(received)), map_location="cpu", weights_only=True)

    def _collective_failed(self, what: str, exc: BaseException) -> BaseException:
        """What a broken collective means: a stop under way, a peer's failure (its own
        record, or a peer whose `alive` count stopped: it died or froze), or our own."""
        import torch.distributed as dist

        try:
            before = self._alive_counts()
            deadline = time.monotonic() + COLLECTIVE_CAUSE_S
            while not self.latch.stop.is_set() and time.monotonic() < deadline:
                record = self._abort_record()  # the peer writes it before it tears down
                if record is not None:
                    self._on_abort_record(record)
                    break
                time.sleep(0.1)
            if not self.latch.stop.is_set():
                # A live peer's watchdog counts every WATCH_S: one that did not in all this
                # time is the one that broke the collective.
                silent = [peer for peer, count in self._alive_counts().items() if count == before[peer]]
                if silent:
                    self.peer_failed(silent[0], None, f"rank {silent[0]} stopped answering in {what} "
                                                      f"({type(exc).__name__}: {first_line(exc)}); no sign "
                                                      f"of life from it for {COLLECTIVE_CAUSE_S:.0f}s "
                                                      "(killed, or frozen)")
        except dist.DistError as store_exc:  # the store's host is gone: that is rank 0
            return self._store_gone(store_exc)
        if self.latch.stop.is_set():
            return StopRequested(self.latch.stop_reason or "stop requested")
        return CollectiveFailed(f"{what} with the other {self.layout.world_size - 1} rank(s) failed and no rank "
                                f"recorded why ({type(exc).__name__}: {first_line(exc)})")

    def _alive_counts(self) -> dict[int, int]:
        """Each peer's `alive` count, but for those that ended their part (they stop counting)."""
        return {peer: self.store.add(f"alive/{peer}", 0) for peer in self.others
                if not self.store.check([f"left/{peer}"])}

    def _on_store(self, operation: Callable[[], Any]) -> Any:
        """A store operation; the store's host gone (rank 0) is a peer's failure, not ours."""
        import torch.distributed as dist

        try:
            return operation()
        except dist.DistError as exc:
            gone = self._store_gone(exc)
            if gone is exc:  # rank 0's own store failed: its own error
                raise
            raise gone from exc

    def arrive(self, name: str) -> None:
        """Count this rank into the store barrier `name` (see wait_for_all)."""
        self._on_store(lambda: self.store.add(name, 1))

    def wait_for_all(self, name: str, timeout: float) -> None:
        """A barrier on the store (no collective): wait until every rank arrived at `name`;
        wakes on the stop event."""
        self._poll(lambda: self.store.add(name, 0) >= self.layout.world_size, timeout,
                   f"not every rank reached {name!r}")

    def publish(self, name: str, value: Any) -> None:
        """This rank's `value` (JSON) under `name`, for every rank to collect."""
        self._on_store(lambda: self.store.set(f"{name}/{self.rank}", json.dumps(value)))

    def collect(self, name: str, timeout: float, ranks: list[int] | None = None) -> list[Any]:
        """The `value` every rank (or those of `ranks`) published under `name`, by rank."""
        keys = [f"{name}/{r}" for r in (range(self.layout.world_size) if ranks is None else ranks)]
        self._poll(lambda: self.store.check(keys), timeout, f"not every rank sent {name!r}")
        return [json.loads(self._on_store(lambda: self.store.get(key))) for key in keys]

    def _poll(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._on_store(done):
                return
            self.latch.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout:.0f}s")
            time.sleep(0.05)

    def _store_gone(self, exc: BaseException) -> BaseException:
        if self.rank == 0 or self.latch.stop.is_set():
            return StopRequested(self.latch.stop_reason or "stop requested") if self.latch.stop.is_set() else exc
        return self.peer_failed(0, None, f"the store that rank 0 hosts at {self.address} stopped answering "
                                         f"({first_line(exc)}): rank 0 is gone")

    def check_same_replicas(self) -> None:
        """Every rank must run as many replicas: the data plan numbers them rank * local + i."""
        self.publish("replicas", self.layout.local_replicas)
        counts = self.collect("replicas", self.config.join_timeout_s)
        if len(set(counts)) > 1:
            raise JoinFailed(f"the ranks run different numbers of drafter replicas ({counts}, by rank); "
                             "every host needs as many devices.drafters")

    # -- failure propagation --------------------------------------------------------------

    def start_watchdog(self) -> None:
        self._store_calls = StoreCalls("watchdog-store")
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._watchdog.start()
        self.latch.thread_names.add(self._watchdog)

    def _watch(self) -> None:
        code = self._watch_until_a_peer_ends()
        if code is None:
            return
        # In the join the main thread waits in c10d, which only its own timeout ends.
        grace = self.exit_after_s if self.joined.is_set() else JOIN_EXIT_S
        if not self._closing.wait(grace):
            say(f"this rank has not ended {grace:.0f}s after its peer did: ending it")
            self.on_stuck(code)

    def _watch_until_a_peer_ends(self) -> int | None:
        """None once this rank leaves; else the exit code this rank ends with (a peer failed
        or stopped, or the store went silent)."""
        heard = {peer: (0, time.monotonic()) for peer in self.others}  # peer -> (count, when it moved)
        timeout = self.config.peer_timeout_s
        while not self._closing.wait(WATCH_S):
            try:
                record, counts = self._store_calls.call(self._look, timeout)
                if record is not None:
                    self._on_abort_record(record)
                    return 128 + signal.SIGTERM if record.kind == AbortRecord.STOPPED else 1
                now = time.monotonic()
                for peer, count in counts.items():
                    if count != heard[peer][0]:
                        heard[peer] = (count, now)
                    elif count > 0 and now - heard[peer][1] > timeout:
                        # (A peer never heard has not reached the store yet: the join's own
                        # timeout waits for it.)
                        self.peer_failed(peer, None, f"no sign of life from rank {peer} for {timeout:.0f}s "
                                                     "(killed, frozen, or cut off by the network)", silence_s=timeout)
                        return 1
            except StoreSilent:
                if self._closing.is_set():
                    return None
                if self.rank != 0:  # (rank 0's store is in its own process: as for its store's errors below)
                    self.peer_failed(0, None, f"the store that rank 0 hosts at {self.address} did not answer for "
                                              f"{timeout:.0f}s (the network to its host is cut, or that host froze)",
                                     silence_s=timeout)
                return 1
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: that is rank 0
                if self._closing.is_set():
                    return None
                self._store_gone(exc)
                return 1
        return None

    def _look(self) -> tuple[AbortRecord | None, dict[int, int]]:
        """One round of the watchdog on the store: this rank's `alive` count up, then a
        peer's abort record (acknowledged) or, without one, every peer's count."""
        self.store.add(f"alive/{self.rank}", 1)
        record = self._abort_record()
        if record is not None:
            self.store.add("acked", 1)
            return record, {}
        return None, self._alive_counts()

    def _abort_record(self) -> AbortRecord | None:
        if not self.store.check([ABORT_KEY]):
            return None
        record = AbortRecord.from_json(json.loads(self.store.get(ABORT_KEY)))
        return None if record.rank == self.rank else record

    def _on_abort_record(self, record: AbortRecord) -> None:
        if record.kind == AbortRecord.STOPPED:
            say(f"rank {record.rank} stopped ({record.message}): stopping")
            self.latch.request_stop(f"rank {record.rank} stopped")
        else:
            self.peer_failed(record.rank, record.exc_type, record.message)

    def peer_failed(self, peer_rank: int, exc_type: str | None, message: str,
                    silence_s: float | None = None) -> PeerFailed:
        """Record (once, unless this rank already failed or is stopping) that a peer failed
        (or was silent for `silence_s`), and stop this rank's run. Callers then end their
        thread without a record of their own."""
        with self._peer_lock:
            if self._peer_failure is None:
                self._peer_failure = PeerFailed(peer_rank, exc_type, message, silence_s)
                if not self.latch.stop.is_set():
                    thread = threading.current_thread()
                    phase, step = self.where()
                    self.latch.record_failure(self._peer_failure, thread=thread.name, thread_ident=thread.ident,
                                              phase=getattr(thread, "phase", phase), step=getattr(thread, "step", step))
            return self._peer_failure

    def _on_local_stop(self) -> None:
        """The run stops (StopLatch.request_stop): tell the peers why, unless a peer told us,
        and free any thread blocked in a collective."""
        if self._left:
            return
        failure = self.latch.failure
        if failure is None or not isinstance(failure[1], PeerFailed):
            if failure is not None:
                thread, exc = failure
                record = AbortRecord(self.rank, AbortRecord.FAILED, type(exc).__name__, str(exc), thread)
            else:
                record = AbortRecord(self.rank, AbortRecord.STOPPED, None, self.latch.stop_reason or "stop requested")
            try:
                self.store.compare_set(ABORT_KEY, "", json.dumps(record.to_json()))
            except Exception:  # noqa: BLE001 - rank 0 is gone: the peers see that for themselves
                pass
        if self.backend == "nccl":
            try:  # a blocking NCCL wait only wakes when its communicator is aborted
                self.group.abort()
            except Exception:  # noqa: BLE001 - best effort: the timeout still bounds the wait
                pass

    def leave(self, ok: bool) -> None:
        """End this rank's part. Rank 0 hosts the store: it stays until the others have
        left (a run that ended well) or have read why it failed (at most ACK_S)."""
        if ok:
            self.store.set(f"left/{self.rank}", "1")
        self._left = True
        self._closing.set()
        if self._watchdog is not None:
            self._watchdog.join(5.0)
        if self.rank != 0:
            return
        try:
            if ok:
                self._poll(lambda: all(self.store.check([f"left/{r}"]) for r in self.others),
                           self.config.timeout_s, "not every rank left")
            elif self._peer_failure is None:
                deadline = time.monotonic() + ACK_S
                while self.store.add("acked", 0) < len(self.others) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except (TimeoutError, StopRequested):
            pass
