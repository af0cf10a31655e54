"""`dflash launch`'s checks of a host before anything is deployed, in one round trip per
host: what the `launch` verb's preflight will check there (free space, the config's
paths, the trainer's packages), the devices the config names against nvidia-smi's
GPUs, and the fit check's facts (docs/runs.md "What `launch` checks"). A launch
refuses on any problem before its deploy; `launch --dry-run` prints every verdict.

The host may have no release yet (or another one): dflash_agent/host_check.py and the
few modules it imports travel as sources on stdin, run by a loader sent with `python
-c`, so the checks made are the agent's own code of this tree. Relative paths are the
release's, which is this tree: they are checked here, in the files the deploy sends.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import dflash_contract
from dflash_contract.names import MODULE_CHECK_TIMEOUT_S, NVIDIA_SMI_TIMEOUT_S, TRAINER_PACKAGES
from dflash_contract.replies import HostCheck
from dflash_files.config_paths import PathRequirement, path_problem
from dflash_files.hub import is_hub_id
from dflash_train.config import JobConfig

from . import console, fit_check
from .agent_client import run_probe
from .errors import DflashError, ExitCode
from .inventory import Host
from .release import list_files
from .session import Session

# The packages the host's sources come from: remote/ of this tree (dflash_contract's
# folder's parent, where an installed dflash has them side by side too).
_REMOTE = Path(dflash_contract.__file__).resolve().parent.parent
# What the agent's gpus.py imports, by module name, and whether each is a package;
# host_check.py imports those and a few more.
PROBE_MODULES = {"dflash_contract": True, "dflash_contract.names": False, "dflash_files": True,
                 "dflash_files.hub": False, "dflash_agent": True, "dflash_agent.gpus": False}
_MODULES = {**PROBE_MODULES, "dflash_files.checkpoint_files": False, "dflash_files.checksums": False,
            "dflash_files.config_paths": False, "dflash_agent.jsonio": False, "dflash_agent.preflight": False,
            "dflash_agent.host_check": False}


def loader(module: str, function: str) -> str:
    """A source for `python -c` that serves the modules of stdin's {name: [source,
    is_package]} before any installed copy, then prints `module.function(argv)`. No
    bytecode is written on the host."""
    return (
        "import importlib.abc, importlib.util, json, sys\n"
        "sys.dont_write_bytecode = True\n"
        "_sources = json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
        "class _Sources(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name not in _sources:\n"
        "            return None\n"
        "        return importlib.util.spec_from_loader(name, self, is_package=_sources[name][1])\n"
        "    def create_module(self, spec):\n"
        "        return None\n"
        "    def exec_module(self, module):\n"
        "        source = _sources[module.__name__][0]\n"
        "        exec(compile(source, '<dflash ' + module.__name__ + '>', 'exec'), module.__dict__)\n"
        "sys.meta_path.insert(0, _Sources())\n"
        f"from {module} import {function}\n"
        f"print(json.dumps({function}(sys.argv[1:])))\n"
    )


_LOADER = loader("dflash_agent.host_check", "main")
TIMEOUT_S = NVIDIA_SMI_TIMEOUT_S + MODULE_CHECK_TIMEOUT_S + 45


def sources(modules: dict[str, bool]) -> bytes:
    """The stdin of a loader serving `modules` ({name: is_package}) from this tree."""
    served = {}
    for name, is_package in modules.items():
        path = _REMOTE / name.replace(".", "/")
        path = path / "__init__.py" if is_package else path.with_suffix(".py")
        served[name] = [path.read_text(), is_package]
    return json.dumps(served).encode()


@dataclasses.dataclass(frozen=True)
class Verdict:
    check: str  # what was checked
    problem: str | None  # None: it passed


@dataclasses.dataclass(frozen=True)
class HostReport:
    """One host's verdicts and its part of the run against its GPUs (None: a config the
    fit check does not plan, fit_check.unchecked)."""
    host: str
    verdicts: tuple[Verdict, ...]
    fit: fit_check.HostFit | None

    def problems(self) -> list[str]:
        """Every problem: the preflight's as the host's agent words its refusal (`host H:
        P; P`), the devices' and the memory estimate's as the fit check words them (`H:
        cuda:N …`), the estimate's only when every device is there (a missing one is said
        once)."""
        preflight_problems = [v.problem for v in self.verdicts if v.problem and not v.check.startswith("devices")]
        found = [f"host {self.host}: " + "; ".join(preflight_problems)] if preflight_problems else []
        devices = [v.problem for v in self.verdicts if v.problem and v.check.startswith("devices")]
        found += [f"{self.host}: {problem}" for problem in devices]
        if self.fit is not None and not devices:
            found += self.fit.problems()
        return found


def _devices(config: JobConfig) -> dict[int, list[str]]:
    """The CUDA devices the config names, by nvidia-smi index, with the threads on each."""
    roles: dict[int, list[str]] = {}
    for kind, devices in (("target", config.devices.target), ("drafter", config.devices.drafters)):
        for i, device in enumerate(devices):
            if device.startswith("cuda"):
                roles.setdefault(int(device.split(":")[1]) if ":" in device else 0, []).append(f"{kind}-{i}")
    return roles


def _devices_verdict(config: JobConfig, answer: HostCheck) -> Verdict | None:
    wanted = _devices(config)
    if not wanted:
        return None
    names = ", ".join(f"cuda:{index}" for index in sorted(wanted))
    if answer.fit.problem:
        return Verdict(f"devices {names}: not checked ({answer.fit.problem})", None)
    have = sorted(gpu.index for gpu in answer.fit.gpus if gpu.index is not None)
    has = (f"{len(have)} GPU(s): {', '.join(f'cuda:{i}' for i in have)}" if have
           else "no GPU (nvidia-smi lists none)")
    missing = [f"cuda:{index} ({', '.join(roles)}) is not there: the host has {has}"
               for index, roles in sorted(wanted.items()) if index not in have]
    return Verdict(f"devices {names}", "; ".join(missing) or None)


def _in_tree(path: str, files: frozenset[str]) -> bool:
    """Whether the release (the files the deploy sends) holds `path`, a file or a folder."""
    normal = os.path.normpath(path)
    return normal in files or any(name.startswith(normal + "/") for name in files)


def _split_paths(paths: list[PathRequirement],
                 tree_root: Path) -> tuple[list[Verdict], list[PathRequirement]]:
    """The relative paths' verdicts, made here; the other paths, for the host."""
    relative = [entry for entry in paths if not entry[2].startswith(("/", "~"))]
    files = frozenset(path for path, _, _ in list_files(tree_root).files) if relative else frozenset()
    here, there = [], []
    for kind, key, path in paths:
        if (kind, key, path) not in relative:
            there.append((kind, key, path))
        elif _in_tree(path, files):
            here.append(Verdict(f"{key} {path} (in this tree)",
                                path_problem(kind, key, path, str(tree_root), {})))
        elif kind == "model" and is_hub_id(path):
            there.append((kind, key, path))
        else:
            here.append(Verdict(f"{key} {path}", f"{key}: {path} is not in the release: the deploy sends what "
                                                 f"git would commit of remote/ and configs/ of {tree_root}, "
                                                 "which holds no such file or folder"))
    return here, there


def check_host(session: Session, host: Host, config: JobConfig, paths: list[PathRequirement],
               tree_root: Path, world_size: int = 1, rank: int = 0) -> HostReport:
    """`host`'s verdicts for rank `rank` of a run of `world_size` hosts; `paths` are the
    --require-path the launch sends this host's agent."""
    here, there = _split_paths(paths, tree_root)
    model = fit_check.remote_model(config, tree_root) if fit_check.unchecked(config) is None else None
    args = [*(f"--model={model}" for _ in [model] if model is not None),
            *(f"--env={key}={value}" for key, value in host.env.items()),
            *(f"--require-module={package}" for package in TRAINER_PACKAGES),
            *(f"--require-path={kind}:{key}={path}" for kind, key, path in there)]
    answer = run_probe(session.transport(host), host, _LOADER, HostCheck, *args, doing=" checking the launch",
                       stdin=sources(_MODULES), timeout=TIMEOUT_S)
    verdicts = [Verdict(v.check, v.problem) for v in answer.checks] + here
    if (devices := _devices_verdict(config, answer)) is not None:
        verdicts.append(devices)
    fit = None
    if fit_check.unchecked(config) is None:
        fit = fit_check.assess(host.name, config, answer.fit, tree_root, world_size, rank)
    return HostReport(host.name, tuple(verdicts), fit)


def show(reports: list[HostReport]) -> None:
    """Every verdict, a line each on stderr: `HOST: CHECK: ok` or `HOST: CHECK: REFUSED: why`."""
    for report in reports:
        for verdict in report.verdicts:
            console.say(f"{report.host}: {verdict.check}: " +
                        ("ok" if verdict.problem is None else f"REFUSED: {verdict.problem}"))


def refusal(reports: list[HostReport], consequence: str, hint: str | None = None) -> DflashError | None:
    """The DflashError (exit 2) naming every problem of every host; None when none has any."""
    problems = [problem for report in reports for problem in report.problems()]
    return DflashError("; ".join(problems) + f" ({consequence})", ExitCode.USAGE, hint=hint) if problems else None


def refuse(reports: list[HostReport], consequence: str, hint: str | None = None) -> None:
    if (error := refusal(reports, consequence, hint)) is not None:
        raise error

