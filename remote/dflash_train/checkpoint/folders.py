"""Checkpoints: DIR/checkpoints/step_000100/ and a `latest` symlink, both replaced atomically.

A checkpoint is written into a temp folder (files fsynced), then moved into place with
os.replace; `latest` is a new symlink renamed over the old one. A reader therefore sees
either the previous checkpoint or the complete new one, never a half-written folder.
Every such folder (checkpoints and the export) ends with SHA256SUMS, written after its
other files: `sha256sum -c` lines (`<hex>  <path>`, sorted), so that `dflash pull`
verifies a download without the host hashing gigabytes on every call.

Contents: model.safetensors (drafter weights), optimizer.pt (optimizer and scheduler
states), state.json (state.TrainingState: step, data cursor, loss history,
replicas, world size, accumulate) and config.yaml (the resolved config of the run that
wrote it, config.resolved_yaml). No global RNG state:
every random draw in training takes a generator seeded from the config, the epoch and the
step, so a resumed run repeats them without it (and a checkpoint written where 8 GPUs were
visible still loads where fewer are).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_files.atomic import fsync_path
from dflash_files.checkpoint_files import (CHECKPOINTS_DIR, CONFIG_FILE, LATEST, OPTIMIZER_FILE, SHA256SUMS, STATE_FILE,
                                          WEIGHTS_FILE, step_folder)
from dflash_files.checksums import sums_text
from dflash_files.diskspace import DiskFull, free_bytes, is_no_space

from ..config import resolve_path
from ..model.drafter import refuse_non_finite
from .state import TrainingState


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def write_sha256sums(folder: Path) -> None:
    """SHA256SUMS of every other file under `folder`, in `sha256sum -c` format: what
    makes the folder intact (dflash_files.checksums)."""
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    (folder / SHA256SUMS).write_text(sums_text(str(folder), [name for name in files if name != SHA256SUMS]))


def replace_dir(final: Path, fill: Callable[[Path], None], needed: int = 0) -> None:
    """Fill a staging folder beside `final` with `fill(staging)`, fsync it, then move it
    into place. A previous `final` stays whole until the new one is; it is missing only
    between two renames (a folder cannot be renamed over a non-empty one), never while
    one is being deleted. A failure for want of space raises DiskFull naming `final`:
    told by less free at the start than the `needed` bytes, or, where the disk filled
    while `fill` wrote (another writer on it), by the OS error in the exception's chain
    (dflash_files.diskspace.is_no_space: ENOSPC raised, or quoted as safetensors quotes
    it). `fill` must let it through: torch.save into a path says only `[enforce fail at
    inline_container.cc:…] . unexpected pos …`, into a file object of ours its
    RuntimeError is raised during our write's OSError (save_torch). Free space after the
    failure tells nothing: the failed writer, which the exception's frames hold, keeps
    its unlinked file's blocks."""
    free = free_bytes(str(final.parent))
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; these folders are for others to read
    old = final.parent / f".old-{final.name}-{os.getpid()}"
    try:
        fill(staging)
        write_sha256sums(staging)
        _fsync_tree(staging)
        if final.exists():  # written again (a resumed run re-saving a step, a re-export)
            final.rename(old)
        os.replace(staging, final)
    except Exception as exc:
        if free < needed:
            raise DiskFull(str(final), needed, free) from exc
        if is_no_space(exc):
            raise DiskFull(str(final)) from exc
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)  # only once the new one is in place


@dataclasses.dataclass
class CheckpointSnapshot:
    """What a checkpoint holds, already copied off the device: training goes on while it is written."""
    state: TrainingState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # {"optimizer": state_dict, "scheduler": state_dict}, tensors on the CPU

    def nbytes(self) -> int:
        """The bytes of its tensors: the least its files take on disk."""
        sizes = [t.numel() * t.element_size() for t in self.weights.values()]
        _map_tensors(self.optimizer, "optimizer", lambda _, t: sizes.append(t.numel() * t.element_size()))
        return sum(sizes)


class SnapshotBuffers:
    """The CPU tensors snapshots are copied into: made once (ahead of the first snapshot by
    `reserve`, else by it), reused by every later one (a tensor of another shape or dtype
    gets a new one). Pinned where the source is on CUDA: pinning the 12.6 GB of an 8B-shape
    drafter with its AdamW state takes seconds, a copy into pinned memory runs at the bus's
    speed. They hold one snapshot at a time: the next may be taken only once the previous
    one is written (CheckpointWriter.save waits for it first)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _buffer(self, key: str, shape: torch.Size, dtype: torch.dtype, pinned: bool) -> tuple[torch.Tensor, int]:
        """The buffer `key` for that shape and dtype, and the bytes made for it (0: reused)."""
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.shape == shape and buffer.dtype == dtype:
            return buffer, 0
        buffer = self._buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        return buffer, buffer.numel() * buffer.element_size()

    def copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into the buffer `key`, asynchronously from CUDA (the caller syncs)."""
        buffer, _ = self._buffer(key, tensor.shape, tensor.dtype, tensor.is_cuda)
        return buffer.copy_(tensor.detach(), non_blocking=True)

    def reserve(self, layout: list[tuple[str, torch.Size, torch.dtype, bool]]) -> int:
        """Make the buffers of `layout` (snapshot_layout's) ahead of the first snapshot: a
        background thread pays the seconds of pinning, not training. The bytes made."""
        return sum(self._buffer(*entry)[1] for entry in layout)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream the copies from `device` run on, made once."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _map_tensors(value: Any, key: str, each: Callable[[str, torch.Tensor], Any]) -> Any:
    """A state_dict with `each(key, tensor)` in place of every tensor; the key names the
    tensor's path in it (the buffer key of SnapshotBuffers)."""
    if isinstance(value, torch.Tensor):
        return each(key, value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, f"{key}/{k}", each) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, f"{key}/{i}", each) for i, v in enumerate(value))
    return value  # numbers, strings, None: immutable


def _optimizer_states(optimizer, scheduler) -> dict[str, Any]:
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def snapshot_layout(model: torch.nn.Module, optimizer, scheduler) -> list[tuple[str, torch.Size, torch.dtype, bool]]:
    """(buffer key, shape, dtype, pinned) of every tensor take_snapshot copies, read
    without copying anything; the optimizer's state must exist (after its first step)."""
    layout = [(f"weights/{name}", t.shape, t.dtype, t.is_cuda) for name, t in model.state_dict().items()]
    _map_tensors(_optimizer_states(optimizer, scheduler), "optimizer",
                 lambda key, t: layout.append((key, t.shape, t.dtype, t.is_cuda)))
    return layout


def take_snapshot(state: TrainingState, model: torch.nn.Module, optimizer, scheduler,
                  buffers: SnapshotBuffers | None = None) -> CheckpointSnapshot:
    """Copy the checkpoint's content off the device into `buffers` (fresh ones if None);
    refuses non-finite weights.

    On CUDA every copy, and the finiteness of every weight tensor (computed on the
    device: no pass over gigabytes on the host), is queued on a side stream that first
    waits for this thread's stream, then one synchronize: training is held as long as
    the bus takes to carry the state (the optimizer's step counts, on the device when
    captured, included)."""
    device = next(model.parameters()).device
    buffers = buffers if buffers is not None else SnapshotBuffers()
    weights = model.state_dict()
    floating = [name for name, tensor in weights.items() if tensor.is_floating_point()]
    side = buffers.stream(device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        finite = buffers.copy("finite", torch.stack([weights[name].isfinite().all() for name in floating]))
        copies = {name: buffers.copy(f"weights/{name}", tensor) for name, tensor in weights.items()}
        optimizer_states = _map_tensors(_optimizer_states(optimizer, scheduler), "optimizer", buffers.copy)
    if side is not None:
        side.synchronize()  # the one wait: every copy above is done
    refuse_non_finite([name for name, ok in zip(floating, finite.tolist()) if not ok], len(weights))
    return CheckpointSnapshot(dataclasses.replace(state, losses=list(state.losses)), copies, optimizer_states)


def save_torch(value: Any, path: Path) -> None:
    """torch.save(value, path) through a file of ours: a write that fails for want of
    space raises its OSError, and torch's own error is raised during it (replace_dir)."""
    with open(path, "wb") as handle:
        torch.save(value, handle)


def write_checkpoint(root: Path, snapshot: CheckpointSnapshot, keep: int, config_yaml: str) -> Path:
    """Write `snapshot` as root/step_NNNNNN (atomically), point `latest` at it, prune."""
    from safetensors.torch import save_file

    def fill(staging: Path) -> None:
        save_file(snapshot.weights, str(staging / WEIGHTS_FILE))
        save_torch(snapshot.optimizer, staging / OPTIMIZER_FILE)
        snapshot.state.write(staging)
        (staging / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")

    root.mkdir(parents=True, exist_ok=True)
    final = root / step_folder(snapshot.state.step)
    replace_dir(final, fill, snapshot.nbytes())
    link = root / f".{LATEST}-{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(final.name)
    os.replace(link, root / LATEST)
    _prune(root, keep, final)
    return final


def save_checkpoint(root: Path, state: TrainingState, model: torch.nn.Module, optimizer, scheduler,
                    keep: int, config_yaml: str) -> Path:
    """Snapshot and write in the calling thread."""
    return write_checkpoint(root, take_snapshot(state, model, optimizer, scheduler), keep, config_yaml)


def _prune(root: Path, keep: int, written: Path) -> None:
    """Keep `written` (what `latest` points at) and the newest `keep - 1` others. A run
    resumed from an older checkpoint writes steps below ones already there."""
    others = sorted(p for p in root.glob("step_*") if p.is_dir() and p != written)
    for old in others[:max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """"latest" -> this run's newest checkpoint (None if there is none yet); else a folder
    (relative paths follow the config rule: release root, else current directory)."""
    if resume == LATEST:
        link = run_dir / CHECKPOINTS_DIR / LATEST
        return link.resolve() if link.exists() else None
    folder = resolve_path(resume)
    if not (folder / STATE_FILE).exists():
        raise FileNotFoundError(f"checkpoint.resume: {folder} is not a checkpoint (no {STATE_FILE})")
    return folder.resolve()


@dataclasses.dataclass
class LoadedCheckpoint:
    folder: Path
    state: TrainingState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]

    def to_plain(self) -> dict[str, Any]:
        """As plain data, which torch.load(weights_only=True) reads back: what rank 0 sends
        the other ranks of a multi-host resume."""
        return {"folder": str(self.folder), "state": dataclasses.asdict(self.state), "weights": self.weights,
                "optimizer": self.optimizer, "scheduler": self.scheduler}

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> LoadedCheckpoint:
        return cls(Path(plain["folder"]), TrainingState(**plain["state"]), plain["weights"], plain["optimizer"],
                   plain["scheduler"])


def _load_plain(path: Path) -> Any:
    """torch.load of plain data only (tensors, dicts, lists, tuples, numbers, strings), so
    that nothing in the file runs while it loads."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        raise ValueError(f"{path}: refused: it holds not only tensors, dicts, lists, numbers and strings"
                         f"{f' (it names {found.group(1)})' if found else ''}, as this trainer writes it; "
                         f"unpickling the rest could run code from the file") from exc


def load_checkpoint(folder: Path) -> LoadedCheckpoint:
    from safetensors.torch import load_file

    state = TrainingState.read(folder)
    extra = _load_plain(folder / OPTIMIZER_FILE)
    return LoadedCheckpoint(folder, state, load_file(str(folder / WEIGHTS_FILE)),
                            extra["optimizer"], extra["scheduler"])
