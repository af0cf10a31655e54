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
root), KEY the config key it came from, KIND one of: file (an existing file), jsonl (a
file that is not empty or blank and whose first row is a JSON object with "text" or
"messages": the training data), checkpoint (a folder holding state.json whose files hold
what its SHA256SUMS lists: every byte is read), model (a
folder holding config.json or, where no such path exists, a Hugging Face hub id such as
org/name whose config.json the host's Hugging Face cache holds: the trainer loads
nothing from the hub, which a host without its network cannot reach half an hour
into a launch).

`problems` gives every check's verdict by name; `dflash launch` runs it on the host
before anything is deployed (host_check.py), the `launch` verb again, as `check`.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import List, Mapping, Optional, Sequence, Tuple

from dflash_files.checkpoint_files import LOADED_FILES, STATE_FILE
from dflash_files.checksums import verify

from .gpus import hub_cache, hub_file, is_hub_id
from .jsonio import AgentError

# Below this a run cannot even be sure to write its logs and a tiny model's checkpoint;
# a run that needs more fails on its own when it writes (and says where).
MIN_FREE_MIB = 64
PATH_KINDS = ("file", "jsonl", "model", "checkpoint")
# A jsonl's first row is read to see that it is training data at all (the trainer reads
# every row); a first line longer than this is left for the trainer to judge.
FIRST_ROW_MAX_BYTES = 64 << 20
MODULE_CHECK_TIMEOUT_S = 60.0
# Run by the trainer's interpreter: which of argv's top-level modules it cannot find.
# find_spec locates a package without importing it, so this stays fast.
_FIND_MODULES = ("import importlib.util, json, sys\n"
                 "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))\n")

PathRequirement = Tuple[str, str, str]  # (kind, config key, path as the config gives it)


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


def resolve(path: str, release_root: str) -> str:
    """A config path as the trainer resolves it (dflash_train.config.resolve_path):
    `~` expanded, relative paths from the release root."""
    return os.path.normpath(os.path.join(release_root, os.path.expanduser(path)))


def path_problem(kind: str, key: str, path: str, release_root: str, environ: Mapping[str, str]) -> Optional[str]:
    """Why `path` (of config key `key`) cannot be what `kind` needs, or None; `environ`
    (the trainer's) says where the Hugging Face cache is."""
    where = resolve(path, release_root)
    if kind in ("file", "jsonl"):
        if not os.path.isfile(where):
            return "%s: %s %s" % (key, where, "is not a file" if os.path.exists(where) else "does not exist")
        return _rows_problem(key, where) if kind == "jsonl" else None
    if kind == "checkpoint":
        if not os.path.isfile(os.path.join(where, STATE_FILE)):
            return "%s: %s is not a checkpoint (no %s)" % (key, where, STATE_FILE)
        problem = verify(where, LOADED_FILES).problem
        return None if problem is None else "%s: %s is corrupt: %s" % (key, where, problem)
    # kind "model": a Hugging Face model folder, or a hub id when no such path exists
    if os.path.exists(where):
        if os.path.isfile(os.path.join(where, "config.json")):
            return None
        return "%s: %s is not a Hugging Face model folder (no config.json)" % (key, where)
    if not is_hub_id(path):
        return "%s: %s does not exist (and %r is not a Hugging Face hub id)" % (key, where, path)
    if hub_file(path, "config.json", environ) is not None:
        return None
    return ("%s: %s is neither a folder on the host nor in its Hugging Face cache %s (HF_HOME=%s): download it "
            "there on the host (`hf download %s`, with the host's HF_HOME), or name a model folder"
            % (key, path, hub_cache(environ), environ.get("HF_HOME", "unset"), path))


def _rows_problem(key: str, where: str) -> Optional[str]:
    """An empty file, or a first row the trainer would refuse, in the trainer's words
    (dflash_train.data.batches): the run would fail on it after its start-up."""
    try:
        with open(where, "rb") as handle:
            for number, line in enumerate(iter(lambda: handle.readline(FIRST_ROW_MAX_BYTES), b""), 1):
                if len(line) == FIRST_ROW_MAX_BYTES and not line.endswith(b"\n"):
                    return None
                if line.strip():
                    problem = _row_problem(line)
                    return None if problem is None else "%s: %s:%d: %s" % (key, where, number, problem)
    except OSError as exc:
        return "%s: %s cannot be read: %s" % (key, where, exc.strerror or exc)
    return "%s: %s is empty: it holds no conversation to train on" % (key, where)


def _row_problem(line: bytes) -> Optional[str]:
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return "not UTF-8 (%s)" % exc
    except ValueError as exc:
        return "not JSON (%s)" % exc
    if not isinstance(row, dict):
        return "expected a JSON object, got %s" % type(row).__name__
    if "text" not in row and "messages" not in row:
        return "expected a 'text' or a 'messages' key"
    return None


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
