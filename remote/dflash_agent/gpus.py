"""What a host has: GPUs (the `gpus` verb) and Python, package versions, GPUs and the
current release (`host_facts`, the `info` verb), and what `dflash launch` plans a run's
GPU memory with: the GPUs, the processes holding memory on them, and the target model's
config.json (`fit_facts`).

Standard library only, and nothing of this package but itself: `dflash hosts --check`
sends this module's source and those of the few it imports with `python -c`, on stdin
(dflash_cli/host_check.py's loader), to hosts where nothing may be deployed yet, and
reads what `probe` answers; `dflash launch` sends it among host_check.py's modules. No
torch import here: it must stay fast and must work where torch is broken; package
versions come from importlib.metadata. `probe` also reports `imports` (`import_check`):
what a child interpreter importing torch and transformers finds.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

from dflash_contract.names import IMPORT_TIMEOUT_S, NVIDIA_SMI_TIMEOUT_S, TRAINER_PACKAGES
from dflash_files.hub import hub_cache, hub_file, is_hub_id

QUERY_FIELDS = ("index", "name", "memory.used", "memory.total", "utilization.gpu",
                "temperature.gpu", "power.draw")
# The protocol's key for each queried field, and how to read its value.
KEYS = (("index", int), ("name", str), ("memory_used_mib", float), ("memory_total_mib", float),
        ("utilization_pct", float), ("temperature_c", float), ("power_w", float))
# The compute processes on the GPUs (`processes`): nvidia-smi names their GPU by uuid only,
# which INDEX_QUERY maps to its index.
PROCESS_QUERY = ("gpu_uuid", "pid", "process_name", "used_memory")
PROCESS_KEYS = (("gpu", str), ("pid", int), ("name", str), ("used_mib", float))
INDEX_QUERY = ("index", "uuid")
# In a child process: an import that crashes or hangs the interpreter is reported, not
# suffered. device_count() asks NVML and does not initialize CUDA.
IMPORT_CHECK = ("import json, torch, transformers\n"
                "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, "
                "'cuda_devices': torch.cuda.device_count()}))")


def _value(text: str, kind: type) -> Any:
    text = text.strip()
    if not text or (text.startswith("[") and text.endswith("]")):  # [N/A], [Not Supported]
        return None
    if kind is str:
        return text
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if kind is int or number.is_integer() else number


def parse_query(output: str, keys: Tuple[Tuple[str, type], ...] = KEYS, text_cell: int = 1) -> List[Dict[str, Any]]:
    """Rows of `nvidia-smi --query-...=... --format=csv,noheader,nounits`, a dict of
    `keys` each; the cell `text_cell` (a GPU's or a process's name) may hold commas."""
    rows = []
    for line in output.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) > len(keys):
            extra = len(cells) - len(keys)
            end = text_cell + 1 + extra
            cells = cells[:text_cell] + [",".join(cells[text_cell:end])] + cells[end:]
        if len(cells) != len(keys):
            continue
        rows.append({key: _value(cell, kind) for (key, kind), cell in zip(keys, cells)})
    return rows


def _nvidia_smi(query: str, fields: Tuple[str, ...]) -> Tuple[Optional[str], Optional[str]]:
    """(its output, problem) of `nvidia-smi --QUERY=FIELDS --format=csv,noheader,nounits`;
    (None, None) without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    argv = [exe, "--%s=%s" % (query, ",".join(fields)), "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, "nvidia-smi: %s" % exc
    if done.returncode != 0:
        text = (done.stdout + done.stderr).decode("utf-8", "replace").strip()
        return None, "nvidia-smi exited %d: %s" % (done.returncode, text[-500:])
    return done.stdout.decode("utf-8", "replace"), None


def query_gpus() -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """(gpus, problem): ([], None) without nvidia-smi; ([], message) when it fails."""
    output, problem = _nvidia_smi("query-gpu", QUERY_FIELDS)
    return (parse_query(output), None) if output is not None else ([], problem)


def query_processes() -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """(processes, problem): every compute process holding memory on a GPU, {"gpu": its
    GPU's index, "pid", "name", "used_mib"}; ([], message) when nvidia-smi cannot say."""
    output, problem = _nvidia_smi("query-gpu", INDEX_QUERY)
    if output is None:
        return [], problem
    index = {row["uuid"]: row["index"] for row in parse_query(output, (("index", int), ("uuid", str)))}
    output, problem = _nvidia_smi("query-compute-apps", PROCESS_QUERY)
    if output is None:
        return [], problem
    rows = parse_query(output, PROCESS_KEYS, text_cell=2)
    return [dict(row, gpu=index.get(row["gpu"])) for row in rows], None


def gpus() -> Dict[str, Any]:
    found, problem = query_gpus()
    answer: Dict[str, Any] = {"gpus": found}
    if problem:
        answer["problem"] = problem
    return answer


def _package_version(name: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _current_release(workspace: str) -> Optional[str]:
    root = os.path.realpath(os.path.join(workspace, "current"))
    return os.path.basename(root) if os.path.isdir(root) else None


def host_facts(workspace: str) -> Dict[str, Any]:
    import platform  # only here: `gpus` runs every few seconds, this once
    found, problem = query_gpus()
    answer = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "packages": {name: _package_version(name) for name in TRAINER_PACKAGES},
        "gpus": found,
        "current_release": _current_release(workspace),
    }
    if problem:
        answer["gpus_problem"] = problem
    return answer


def import_check() -> Dict[str, Any]:
    """{"torch": version, "transformers": version, "cuda_devices": n} as this interpreter
    imports them, or {"error": why not}."""
    try:
        done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=IMPORT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not lines:
        text = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return {"error": text[-1] if text else "exit %d" % done.returncode}
    return json.loads(lines[-1])


def model_config(path: str) -> Tuple[Optional[Dict[str, Any]], str]:
    """(config.json's fields, the file read) of the model `path` names as the trainer
    loads it: an absolute (or ~) folder, else a hub id found in the HF cache; or (None,
    why not). Relative folders are the release's: the CLI reads them from its tree."""
    folder = os.path.expanduser(path)
    if os.path.isabs(folder):
        where = os.path.join(folder, "config.json")  # type: Optional[str]
    elif is_hub_id(path):
        where = hub_file(path, "config.json")
        if where is None:
            return None, ("%s is not in the Hugging Face cache %s"
                          % (path, hub_cache()))
    else:
        return None, "%s is neither a folder nor a Hugging Face hub id" % path
    try:
        with open(where, "rb") as handle:
            fields = json.loads(handle.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        return None, "cannot read %s: %s" % (where, getattr(exc, "strerror", None) or exc)
    if not isinstance(fields, dict):
        return None, "%s holds no JSON object" % where
    return fields, where


def fit_facts(model: Optional[str]) -> Dict[str, Any]:
    """{"gpus": as `gpus` gives them (+ "problem"), "processes" holding memory on them
    (query_processes; "processes_problem" when nvidia-smi could not list them), "target":
    config.json's fields or null, "target_source": the file read, "target_problem": why it
    was not} for `model` (none: "target" null, nothing else)."""
    answer = gpus()
    if answer["gpus"]:
        found, problem = query_processes()
        answer["processes"] = found
        if problem:
            answer["processes_problem"] = problem
    answer["target"] = None
    if model is not None:
        fields, where = model_config(model)
        answer["target"] = fields
        answer["target_source" if fields is not None else "target_problem"] = where
    return answer


def probe(argv: List[str]) -> Dict[str, Any]:
    """`dflash hosts --check`'s answer (argv: WORKSPACE), as the CLI's loader calls it:
    host_facts with `imports` (import_check)."""
    facts = host_facts(os.path.abspath(os.path.expanduser(argv[0])))
    facts["imports"] = import_check()
    return facts
