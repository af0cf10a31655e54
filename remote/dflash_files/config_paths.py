"""The config's paths as the trainer will find them on its host, checked before a run
starts: the agent's preflight checks them in the `launch` verb and in the host check
sent before a deploy, the CLI checks the relative ones (the release's) in its own tree.
Every problem names the config key and the path.

KIND is one of: file (an existing file), jsonl (a file that is not empty or blank and
whose first row is a JSON object with "text" or "messages": the training data),
checkpoint (a folder holding state.json whose files hold what its SHA256SUMS lists:
every byte is read), model (a folder holding config.json or, where no such path
exists, a Hugging Face hub id such as org/name whose config.json the host's Hugging
Face cache holds: the trainer loads nothing from the hub, which a host without its
network cannot reach half an hour into a launch).
"""
import json
import os
from typing import Mapping, Optional, Tuple

from .checkpoint_files import LOADED_FILES, STATE_FILE
from .checksums import verify
from .hub import hub_cache, hub_file, is_hub_id

PATH_KINDS = ("file", "jsonl", "model", "checkpoint")
# A jsonl's first row is read to see that it is training data at all (the trainer reads
# every row); a first line longer than this is left for the trainer to judge.
FIRST_ROW_MAX_BYTES = 64 << 20
PathRequirement = Tuple[str, str, str]  # (kind, config key, path as the config gives it)


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
