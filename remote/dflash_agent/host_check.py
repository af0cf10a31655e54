"""What `dflash launch` (and `launch --dry-run`) asks a host before anything is deployed,
in one round trip: the fit check's facts (gpus.fit_facts: the GPUs, the target's
config.json) and the verdict of each of the `launch` verb's own preflight checks
(preflight.problems: free space, the config's paths, the trainer's packages), so that
a launch the host would refuse is refused before its deploy, and a dry run says
what the launch would. replies.HostCheck is the answer.

Not run from a release: the CLI sends the sources of this module and of the few it
imports (dflash_cli/host_check.py) with `python -c`, on stdin, to hosts where
nothing may be deployed yet. argv: WORKSPACE [--model=PATH] [--env=KEY=VALUE]...
[--require-module=NAME]... [--require-path=KIND:KEY=PATH]...: the options of the
`launch` verb of the same names. Relative paths are the release's, which is not on the
host yet: the CLI checks those in its own tree and sends only the others (absolute
ones, hub ids), which are looked up here as from the current release.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from dflash_files.config_paths import PathRequirement

from . import gpus, preflight


def host_check(workspace: str, release_root: str, modules: Sequence[str],
               paths: Sequence[PathRequirement], model: Optional[str]) -> Dict[str, Any]:
    """The answer, with this process's environment as the trainer's (the caller put the
    inventory's `env` into it)."""
    env = tuple(sorted(os.environ.items()))
    verdicts = preflight.problems(workspace, release_root, sys.executable, env, modules, paths)
    return {"fit": gpus.fit_facts(model),
            "checks": [{"check": check, "problem": problem} for check, problem in verdicts]}


def _options(argv: List[str], name: str) -> List[str]:
    return [option[len(name) + 3:] for option in argv if option.startswith("--%s=" % name)]


def main(argv: List[str]) -> Dict[str, Any]:
    """The answer to argv (the module docstring's), as the CLI's loader calls it."""
    workspace = os.path.abspath(os.path.expanduser(argv[0]))
    options = argv[1:]
    os.environ.update(pair.split("=", 1) for pair in _options(options, "env"))
    paths = []
    for requirement in _options(options, "require-path"):
        kind, rest = requirement.split(":", 1)
        key, path = rest.split("=", 1)
        paths.append((kind, key, path))
    models = _options(options, "model")
    return host_check(workspace, os.path.join(workspace, "current"), _options(options, "require-module"), paths,
                      models[0] if models else None)

