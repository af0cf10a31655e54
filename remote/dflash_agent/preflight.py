"""What only the host can check before a run starts, in the `launch` verb itself (so it
costs no extra round trip): the trainer's interpreter finds the packages it needs,
the config's paths exist here (the training data is not empty, and its first row is
one), and the workspace has room.

The CLI validates everything it can locally; the config's paths are host paths and
the interpreter is the host's, so these checks happen here, before anything of the run
is created. Every problem names the config key or package and the host path; all of
them are reported at once, as one AgentError of kind "host".

The checks: at least MIN_FREE_MIB free in the workspace; each --require-module found by
the trainer's interpreter (run with the trainer's environment); each --require-path
KIND:KEY=PATH, PATH as the trainer resolves it (~ expanded, relative to the release
root), KEY the config key it came from, KIND one of dflash_files.config_paths' kinds.

`problems` gives every check's verdict by name; `dflash launch` runs it on the host
before anything is deployed (host_check.py), the `launch` verb again, as `check`.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import List, Optional, Sequence, Tuple

from dflash_contract.names import MODULE_CHECK_TIMEOUT_S
from dflash_files.config_paths import PathRequirement, path_problem

from .jsonio import AgentError

# Below this a run cannot even be sure to write its logs and a tiny model's checkpoint;
# a run that needs more fails on its own when it writes (and says where).
MIN_FREE_MIB = 64
# Run by the trainer's interpreter: which of argv's top-level modules it cannot find.
# find_spec locates a package without importing it, so this stays fast.
_FIND_MODULES = ("import importlib.util, json, sys\n"
                 "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))\n")


def check(workspace: str, release_root: str, python: str, env: Sequence[Tuple[str, str]],
          modules: Sequence[str], paths: Sequence[PathRequirement]) -> None:
    """Raise AgentError(kind="host") listing every problem found; return when none."""
    found = [problem for _, problem in problems(workspace, release_root, python, env, modules, paths) if problem]
    if found:
        raise AgentError("; ".join(found), "host")


def problems(workspace: str, release_root: str, python: str, env: Sequence[Tuple[str, str]],
             modules: Sequence[str], paths: Sequence[PathRequirement]) -> List[Tuple[str, Optional[str]]]:
    """(what was checked, the problem or None) of every check, in order: free space,
    each path, the modules."""
    verdicts = [("free space in %s" % workspace, _free_space_problem(workspace))]
    verdicts += [("%s %s" % (key, path), path_problem(kind, key, path, release_root, dict(env)))
                 for kind, key, path in paths]
    if modules:
        verdicts.append(("%s imports %s" % (python, ", ".join(modules)), _module_problem(python, env, modules)))
    return verdicts


def _module_problem(python: str, env: Sequence[Tuple[str, str]], modules: Sequence[str]) -> Optional[str]:
    """Run the trainer's interpreter with the trainer's environment and ask it."""
    try:
        done = subprocess.run([python, "-c", _FIND_MODULES] + list(modules), env=dict(env), cwd="/",
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=MODULE_CHECK_TIMEOUT_S)
    except OSError as exc:
        return "the trainer's interpreter %s cannot run: %s" % (python, exc.strerror or exc)
    except subprocess.TimeoutExpired:
        return "the trainer's interpreter %s did not answer within %.0f s" % (python, MODULE_CHECK_TIMEOUT_S)
    try:
        missing = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = done.stderr.decode("utf-8", "replace").strip()[-500:]
        return "the trainer's interpreter %s failed (exit %d): %s" % (python, done.returncode, detail)
    if not missing:
        return None
    return ("the trainer's interpreter %s cannot import %s, which the trainer needs"
            % (python, ", ".join(missing)))


def _free_space_problem(workspace: str) -> Optional[str]:
    folder = workspace
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # a workspace not made yet: the filesystem it will be on
    stat = os.statvfs(folder)
    free_mib = stat.f_bavail * stat.f_frsize / (1 << 20)
    if free_mib >= MIN_FREE_MIB:
        return None
    return ("only %.1f MiB free on the filesystem of %s; a run needs at least %d MiB"
            % (free_mib, workspace, MIN_FREE_MIB))
