"""compile: default's train step as Dynamo's own saved graphs: a warm start loads them
instead of tracing the step again.

Each graph of the step is compiled ahead of time by torch (`torch.compile(fullgraph=True,
dynamic=True).aot_compile`), which gives a function holding the compiled forward and
backward and the guards Dynamo made for it; torch serializes it, and
`torch.compiler.load_compiled_function` makes it again in another process without a trace.
The build (policy._build_compiled) follows the rules of the traced build: one graph per
specialization class at its largest shape, then one more for each shape of the data whose
guards no graph passes. A call runs the first graph whose guards pass its inputs; one that
none passes, after the build, is a StrayCompile naming its shape (nothing ever compiles
there: an AOT-compiled function never traces).

Saved in the key folder of the compile cache (cache.py): train_step/<16 hex>.aot, the
serialized graphs, and <16 hex>.json {size, sha256, torch, graphs, saved_at} beside it.
The 16 hex name what the graphs were traced from: the sources of dflash_train/model, the
transformers version, the objective's parameters, settings and input dtypes, and the
drafter's config. A file
whose manifest does not name its bytes, or that torch cannot load, is moved aside
(`.corrupt`), said in the log, and the step is traced as if none were there: never a
failure of the run.

Used on torch >= 2.13 (the first release it was verified on, on CPU); on older releases,
or one without these APIs, the step is traced as before, and the log says so once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import pickle
import time
from pathlib import Path

import torch

from dflash_files.atomic import write_atomic

from ..model import objective as objective_module
from ..model.objective import DraftObjective, DrafterInputs
from ..runlog import say

PRECOMPILED_DIR = "train_step"  # in the compile cache's key folder
VERIFIED_TORCH = (2, 13)
LOADED, ABSENT, CORRUPT, UNSUPPORTED = "loaded", "absent", "corrupt", "unsupported"
_MODEL_SOURCES = Path(objective_module.__file__).parent


def unsupported_reason(version: tuple[int, int] | None = None) -> str | None:
    """Why this torch's step is traced on every start, or None where it can be precompiled."""
    from .cudagraphs import torch_version

    version = version or torch_version()
    if version < VERIFIED_TORCH:
        return (f"torch {version[0]}.{version[1]}: a precompiled train step is used from torch "
                f"{VERIFIED_TORCH[0]}.{VERIFIED_TORCH[1]} on")
    if not hasattr(torch.compiler, "load_compiled_function") or not getattr(torch._dynamo.config,
                                                                             "enable_aot_compile", False):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function / aot_compile"
    return None


def step_key(objective: DraftObjective, like: DrafterInputs) -> str:
    """16 hex of what the graphs were traced from (see the module docstring)."""
    sources = hashlib.sha256()
    for path in sorted(_MODEL_SOURCES.glob("*.py")):
        sources.update(path.name.encode() + b"\0" + path.read_bytes())
    facts = {"sources": sources.hexdigest(), "transformers": importlib.metadata.version("transformers"),
             "parameters": [(name, list(p.shape), str(p.dtype), p.requires_grad)
                            for name, p in objective.drafter.named_parameters()],
             "embed": [list(objective.embed_weight.shape), str(objective.embed_weight.dtype)],
             "head": [list(objective.lm_head_weight.shape), str(objective.lm_head_weight.dtype)],
             "modules": repr(objective), "use_flex": objective.use_flex, "chunk": objective.loss_chunk_rows,
             # every setting a trace may take as a constant (block size, mask token, ...)
             "drafter_config": objective.drafter.config.to_json_string(use_diff=False),
             "inputs": {name: str(getattr(like, name).dtype) for name in ("input_ids", "features", "anchors",
                                                                         "anchor_valid", "labels", "weights")},
             "features": like.features.shape[-1], "device": like.input_ids.device.type}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class PrecompiledStep:
    """The graphs serving one objective's shapes, shared by the replicas of the process."""

    path: Path | None  # train_step/<key>.aot, None where nothing is saved
    functions: list  # torch._dynamo.aot_compile.AOTCompiledFunction, in the order they were compiled
    status: str  # LOADED, ABSENT or CORRUPT: what the build found saved

    def find(self, objective: DraftObjective, inputs: DrafterInputs):
        """The first graph whose guards pass these inputs, or None."""
        return next((f for f in self.functions if f.guard_check(objective, inputs)), None)

    def compile(self, objective: DraftObjective, inputs: DrafterInputs) -> None:
        """Trace and compile one more graph, for these inputs' shape (in the build only).
        Without gradients: torch 2.13 saves a parameter's gradient among the guards' state
        and cannot load it again ("assigned grad expected to be a Tensor or None")."""
        objective.drafter.zero_grad(set_to_none=True)
        compiled = torch.compile(DraftObjective.forward, fullgraph=True, dynamic=True)
        self.functions.append(compiled.aot_compile(((objective, inputs), {})))

    def refusal(self, objective: DraftObjective, inputs: DrafterInputs) -> str:
        """The guards of the first graph that fail these inputs, in Dynamo's words."""
        first = self.functions[0]
        failed = first._artifacts.guard_manager.check_verbose(first.prepare_f_locals(objective, inputs))
        return "; ".join(part.split("  #")[0].strip() for part in failed.verbose_code_parts)

    def save(self) -> int | None:
        """Write every graph to `path` (manifest last); its size. Raises OSError (disk full)."""
        if self.path is None:
            return None
        from torch._dynamo.aot_compile import AOTCompiledFunction

        data = pickle.dumps([AOTCompiledFunction.serialize(f).serialized_data for f in self.functions])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(self.path), data)
        manifest = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "torch": torch.__version__,
                    "graphs": len(self.functions), "saved_at": time.time()}
        write_atomic(str(self.path.with_suffix(".json")), json.dumps(manifest, sort_keys=True).encode())
        return len(data)


def open_precompiled(folder: Path | None, key: str) -> PrecompiledStep:
    """The saved graphs of step_key `key` in the key folder `folder`, loaded; none (traced
    by the build) where there are none or they cannot be used, said in the log."""
    if folder is None:
        return PrecompiledStep(None, [], ABSENT)
    path = folder / PRECOMPILED_DIR / f"{key}.aot"
    if not path.exists():
        return PrecompiledStep(path, [], ABSENT)
    try:
        functions = _load(path)
    except Exception as exc:  # noqa: BLE001 - whatever a bad file makes torch raise, the step is traced instead
        aside = path.with_name(f"{path.name}.{CORRUPT}")
        os.replace(path, aside)
        say(f"precompiled train step {path} not loaded: {type(exc).__name__}: {str(exc)[:300]}; moved to "
            f"{aside.name}, Dynamo traces the step")
        return PrecompiledStep(path, [], CORRUPT)
    say(f"precompiled train step loaded: {path} ({len(functions)} graph(s))")
    return PrecompiledStep(path, functions, LOADED)


def _load(path: Path) -> list:
    data = path.read_bytes()
    manifest = json.loads(path.with_suffix(".json").read_text())
    if not isinstance(manifest, dict) or manifest.get("size") != len(data) \
            or manifest.get("sha256") != hashlib.sha256(data).hexdigest():
        raise ValueError(f"{len(data)} bytes of sha256 {hashlib.sha256(data).hexdigest()[:16]}, its manifest "
                         f"says {manifest.get('size') if isinstance(manifest, dict) else manifest!r}")
    return [torch.compiler.load_compiled_function(io.BytesIO(blob), f_globals=objective_module.__dict__)
            for blob in pickle.loads(data)]
