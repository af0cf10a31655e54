"""Hugging Face hub ids and the host's hub cache, as dflash_train and the hub's own
client find them: where the agent's preflight and fit facts look for a target model
named by hub id, and where the CLI tells a hub id from a path."""
import os
import re
from typing import Mapping, Optional

# A Hugging Face hub id ("Qwen/Qwen3-8B"): dflash_train loads target.path as one when no
# such folder exists on the host, from the host's HF cache or the hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and ".." not in path


def hub_cache(environ: Optional[Mapping[str, str]] = None) -> str:
    """The folder huggingface_hub caches hub models in, by its own precedence:
    HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub,
    in `environ` (default: this process's environment)."""
    env = os.environ if environ is None else environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(cache))


def hub_file(repo_id: str, name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """`name` of hub model `repo_id` in the cache (hub_cache(environ)), at the revision
    `main` resolves to offline (refs/main), else in its newest snapshot holding it; None
    when not cached."""
    repo = os.path.join(hub_cache(environ), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main")) as handle:
            pinned = os.path.join(snapshots, handle.read().strip(), name)
        if os.path.isfile(pinned):
            return pinned
    except OSError:
        pass  # no refs/main: downloaded by revision
    try:
        found = [os.path.join(snapshots, s, name) for s in os.listdir(snapshots)]
    except OSError:
        return None
    found = [path for path in found if os.path.isfile(path)]
    return max(found, key=os.path.getmtime) if found else None
