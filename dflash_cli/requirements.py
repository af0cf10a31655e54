"""What the trainer needs on a host (remote/requirements.txt of the release) and whether
a host's interpreter has it: the readiness rule of `dflash hosts --check` (docs/hosts.md
"Host environments")."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version


from dflash_contract.replies import HostProbe

from . import release
from .errors import DflashError, ExitCode

REQUIREMENTS_FILE = "remote/requirements.txt"
#: the packages the readiness check imports (the others come with transformers)
IMPORTED = ("torch", "transformers")


@dataclasses.dataclass(frozen=True)
class TrainerRequirements:
    path: Path
    text: str
    by_name: dict[str, Requirement]

    def torch_pin(self, version: str) -> str:
        """`version` if the supported torch range holds it; DflashError otherwise."""
        supported = self.by_name["torch"].specifier
        try:
            if Version(version) in supported:
                return version
        except InvalidVersion:
            pass
        raise DflashError(f"--torch {version}: the trainer supports torch{supported} "
                          f"({self.path})", ExitCode.USAGE)


def load(root: Path | None = None) -> TrainerRequirements:
    """The requirements of the tree deploy would send (or of `root`)."""
    path = (root or release.find_source().root) / REQUIREMENTS_FILE
    try:
        text = path.read_text()
    except OSError as exc:
        raise DflashError(f"{path}: cannot read the trainer's requirements: {exc.strerror}", ExitCode.USAGE)
    by_name: dict[str, Requirement] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                requirement = Requirement(line)
            except InvalidRequirement as exc:
                raise DflashError(f"{path}:{number}: {exc}", ExitCode.USAGE) from None
            by_name[requirement.name] = requirement
    missing = [name for name in IMPORTED if name not in by_name]
    if missing:
        raise DflashError(f"{path}: names no {', '.join(missing)}", ExitCode.USAGE)
    return TrainerRequirements(path, text, by_name)


def readiness_problems(facts: HostProbe, requirements: TrainerRequirements) -> list[str]:
    """Why the host's interpreter cannot run the trainer, from the facts its probe
    reported ([] when it can): torch and transformers import in supported versions and
    torch sees every GPU nvidia-smi lists."""
    imported = facts.imports
    if "error" in imported:
        return [f"{facts.python_executable} cannot import {', '.join(IMPORTED)}: {imported['error']}"]
    problems = []
    for name in IMPORTED:
        specifier = requirements.by_name[name].specifier
        if not specifier.contains(imported[name], prereleases=True):
            problems.append(f"{name} {imported[name]} is not {name}{specifier}")
    listed = len(facts.gpus)
    if imported["cuda_devices"] != listed:
        problems.append(f"torch sees {imported['cuda_devices']} of the {listed} GPUs nvidia-smi lists "
                        "(a CPU build of torch, or one too new for the driver)")
    return problems
