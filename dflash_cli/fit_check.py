"""`dflash launch`'s fit check: the GPU memory a training config needs on every device of
a host (dflash_train.memory.plan) against that host's GPUs, before anything is deployed
or started (docs/fit-check.md).

The host's facts come in the round trip of the launch's host check (host_check.py): the
agent's gpus.fit_facts answers nvidia-smi's GPUs and the target's config.json (an
absolute folder, or a hub id in the host's HF cache), and the processes holding memory on
them (what they hold is not the run's to use). A relative target.path is the
release's, which is this tree's: its config.json is read here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflash_contract.replies import FitFacts, Gpu, GpuProcess
from dflash_train.config import JobConfig
from dflash_train.memory.plan import GIB, DevicePlan, MemoryPlan, TargetShape, estimate, usable_bytes
from rich.table import Table

from . import console
from .errors import DflashError, ExitCode

MIB = 1 << 20
# Less than this held on a GPU is not worth naming (an idle GPU's memory.used is not always 0).
HELD_SHOWN_BYTES = 64 * MIB


def unchecked(config: JobConfig) -> str | None:
    """Why a config needs no fit check, or None when it does."""
    if config.job not in ("train", "regenerate"):
        return f"job: {config.job}: no GPU memory estimate (the fit check plans training and regenerate runs)"
    if config.devices.cpu_only:
        return "the config runs on the CPU only: no GPU memory check"
    return None


@dataclasses.dataclass(frozen=True)
class HostFit:
    """One host's part of a run against its GPUs."""

    host: str
    plan: MemoryPlan | None  # None: not checked, `note` says why
    gpus: dict[int | None, Gpu]  # nvidia-smi's rows by index
    note: str | None = None
    processes: tuple[GpuProcess, ...] = ()  # holding memory on the GPUs now
    processes_problem: str | None = None  # why nvidia-smi could not list them

    def held(self, gpu: Gpu) -> float:
        """The bytes other processes hold on `gpu` now: nvidia-smi's memory.used, which
        counts those of every PID namespace, the ones it cannot name too."""
        return (gpu.memory_used_mib or 0.0) * MIB

    def available(self, gpu: Gpu) -> float:
        """What the run may use of `gpu`: its usable memory less what others hold."""
        return usable_bytes(gpu.memory_total_mib) - self.held(gpu)

    def holders(self, gpu: Gpu) -> str:
        """`16.0 GiB of it held by other processes: pid 4242 /usr/bin/python3 16.0 GiB`;
        "" when they hold next to nothing."""
        held = self.held(gpu)
        if held < HELD_SHOWN_BYTES:
            return ""
        mine = sorted((p for p in self.processes if p.gpu == gpu.index), key=lambda p: -(p.used_mib or 0.0))
        named = [f"pid {p.pid} {p.name or '(no name)'} "
                 + (_gib(p.used_mib * MIB) if p.used_mib is not None else "(how much: not reported)") for p in mine]
        unnamed = held - sum((p.used_mib or 0.0) * MIB for p in mine)
        if unnamed >= HELD_SHOWN_BYTES:
            why = f": {self.processes_problem}" if self.processes_problem else " (another PID namespace's)"
            named.append(f"{_gib(unnamed)} by processes nvidia-smi does not name{why}")
        return console.printable(f"{_gib(held)} of it held by other processes: {', '.join(named)}")

    def problems(self) -> list[str]:
        """A sentence for every device the plan puts where the host cannot hold it."""
        if self.plan is None:
            return []
        return [problem for device in self.plan.devices if (problem := self._problem(device))]

    def _problem(self, device: DevicePlan) -> str | None:
        gpu = self.gpus.get(device.index)
        if gpu is None:
            has = (f"{len(self.gpus)} GPU(s): {', '.join(f'cuda:{i}' for i in sorted(self.gpus))}" if self.gpus
                   else "no GPU (nvidia-smi lists none)")
            return f"{self.host}: {device.device} ({', '.join(device.roles)}) is not there: the host has {has}"
        available = self.available(gpu)
        if device.total <= available:
            return None
        largest = ", ".join(f"{term.name}{_times(term.count)} {_gib(term.bytes)}" for term in device.largest(3))
        drafters = sum(role.startswith("drafter-") for role in device.roles)
        knob = next((term.knob for term in device.largest() if term.knob), "")
        fewer = f"put fewer drafters on {device.device} (devices.drafters: {drafters} there)" if drafters > 1 else ""
        change = "; or ".join(part for part in (f"change {knob}" if knob else "", fewer) if part)
        holders = self.holders(gpu)
        if holders and device.total <= usable_bytes(gpu.memory_total_mib):  # it would fit the GPU alone
            change = "stop those processes, or put the run on a GPU they leave free"
        held = f", {holders}" if holders else ""
        return (f"{self.host}: {device.device} ({', '.join(device.roles)}) needs an estimated {_gib(device.total)}, "
                f"more than the {_gib(available)} usable of its {gpu.name} ({gpu.memory_total_mib:.0f} MiB{held}); "
                f"largest terms: {largest}" + (f"; {change}" if change else ""))


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _times(count: int) -> str:
    return f" x{count}" if count > 1 else ""


def remote_model(config: JobConfig, tree_root: Path) -> str | None:
    """The target whose config.json the host is asked for: none for a tiny target or a
    folder of the tree being deployed (read here)."""
    if config.target.tiny is not None or _local_target(config, tree_root) is not None:
        return None
    return config.target.path


def assess(host_name: str, config: JobConfig, facts: FitFacts, tree_root: Path, world_size: int = 1,
           rank: int = 0) -> HostFit:
    """`host_name`'s part of the run (rank `rank` of `world_size`) planned against its
    GPUs, as `facts` (gpus.fit_facts for remote_model) report them."""
    local = _local_target(config, tree_root)
    found = {gpu.index: gpu for gpu in facts.gpus}
    if facts.problem:
        return HostFit(host_name, None, found, f"not checked: {facts.problem}")
    held = {"processes": facts.processes or (), "processes_problem": facts.processes_problem}
    if any(gpu.memory_total_mib is None for gpu in found.values()):
        return HostFit(host_name, None, found, "not checked: nvidia-smi does not report memory.total", **held)
    if config.target.tiny is not None:
        target = TargetShape.from_tiny(config.target.tiny)
    else:
        fields, where = local or (facts.target, facts.target_source or facts.target_problem)
        if fields is None:
            return HostFit(host_name, None, found, f"not checked: target.path: {where}", **held)
        try:
            target = TargetShape.from_config_json(fields)
        except ValueError as exc:
            return HostFit(host_name, None, found, f"not checked: {where}: {exc}", **held)
    return HostFit(host_name, estimate(config, target, world_size=world_size, rank=rank), found, **held)


def _local_target(config: JobConfig, tree_root: Path) -> tuple[dict, str] | None:
    """(config.json's fields, its path) of a relative target.path that is a folder of the
    tree being deployed (the trainer resolves relative paths from the release root)."""
    path = config.target.path
    if path is None or path.startswith(("/", "~")):
        return None
    config_json = tree_root / path / "config.json"
    if not config_json.is_file():
        return None  # a hub id: the host's HF cache has it
    try:
        return json.loads(config_json.read_text()), str(config_json)
    except (OSError, ValueError) as exc:
        raise DflashError(f"target.path: cannot read {config_json}: {exc}", ExitCode.USAGE) from exc


def report(fits: list[HostFit]) -> None:
    """A line per host that fits: every device's estimate against what it may use; a
    warning per host not checked, saying why."""
    for fit in fits:
        if fit.plan is None:
            console.warn(f"{fit.host}: GPU memory {fit.note}")
            continue
        parts = []
        for device in fit.plan.devices:
            gpu = fit.gpus[device.index]
            holders = fit.holders(gpu)
            parts.append(f"{device.device} {_gib(device.total)} of {_gib(fit.available(gpu))}"
                         + (f" ({holders})" if holders else ""))
        console.say(f"{fit.host}: GPU memory fits (estimated peak of usable): " + ", ".join(parts))


def show(fits: list[HostFit]) -> None:
    """A table per device (its terms, the total against the GPU) on stderr."""
    for fit in fits:
        if fit.plan is None:
            console.say(f"{fit.host}: GPU memory {fit.note}")
            continue
        if fit.plan.worst is None:
            console.say(f"{fit.host}: target {fit.plan.target_parameters:,} parameters")
        else:
            console.say(f"{fit.host}: drafter {fit.plan.drafter_parameters:,} parameters, target "
                        f"{fit.plan.target_parameters:,}; largest micro-batch {fit.plan.worst}")
        for device in fit.plan.devices:
            gpu = fit.gpus.get(device.index)
            table = Table(title=f"{fit.host} {device.device}: {', '.join(device.roles)}", title_justify="left")
            table.add_column("term")
            table.add_column("x", justify="right")
            table.add_column("GiB", justify="right")
            table.add_column("what changes it")
            rows = device.terms + device.overhead
            for i, term in enumerate(rows, 1):
                table.add_row(term.name, str(term.count), f"{term.bytes / GIB:.2f}", term.knob,
                              end_section=i == len(rows))
            if gpu is None:
                verdict = "no such GPU on the host"
            else:
                available = fit.available(gpu)
                holders = f", {fit.holders(gpu)}" if fit.holders(gpu) else ""
                verdict = (f"{'fits' if device.total <= available else 'DOES NOT FIT'}: {_gib(available)} usable of "
                           f"{gpu.name} ({gpu.memory_total_mib:.0f} MiB{holders})")
            table.add_row("total", "", f"{device.total / GIB:.2f}", verdict)
            console.human.print(table)
