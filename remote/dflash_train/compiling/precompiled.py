"""The train step's graphs as Dynamo's own saved graphs: a warm start loads them instead
of tracing the step again, under `compile: default` and under `compile: cudagraphs`
(whole_step) alike.

Each graph of the step is compiled ahead of time by torch (`torch.compile(fullgraph=True,
dynamic=...).aot_compile`), which gives a function holding the compiled forward and
backward and the guards Dynamo made for it; torch serializes it, and
`torch.compiler.load_compiled_function` makes it again in another process without a trace.
Each build follows the rules of its traced twin: compile: default's (policy._build_precompiled)
one graph per specialization class at its largest shape, then one more for each shape of
the data whose guards no graph passes; cudagraphs' (cudagraphs._precompiled_objective) one
graph per bucket with `compile_shapes: static`, or one serving every bucket with the
dimensions that differ between them dynamic. A call runs the first graph whose guards pass
its inputs; under compile: default one that none passes, after the build, is a
StrayCompile naming its shape (nothing ever compiles there: an AOT-compiled function
never traces); under cudagraphs only the captured buckets' shapes ever run.

Saved in the key folder of the compile cache (cache.py): train_step/<16 hex>.aot, the
serialized graphs, and <16 hex>.json {size, sha256, torch, graphs, saved_at} beside it.
The 16 hex name what the graphs were traced from: the sources of dflash_train/model, the
transformers version, the objective's parameters, settings and input dtypes, the drafter's
config, and the way the step is built (its variant). A file whose manifest does not name
its bytes, or that torch cannot load, is moved aside (`.corrupt`), said in the log, and
the step is traced as if none were there: never a failure of the run.

Used on torch >= 2.11; on older releases, or one without these APIs, the step is traced
as before, and the log says so once. Verified: compile: default on 2.11 and 2.13 (CPU,
sdpa); cudagraphs' whole_step with sdpa and with flex attention, static and dynamic
shapes, on 2.11 (H200). compile: default with flex attention has not run on a GPU: should
its ahead-of-time compile fail, the process traces (give_up).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
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
from .step_build import torch_version

PRECOMPILED_DIR = "train_step"  # in the compile cache's key folder
VERIFIED_TORCH = (2, 11)
LOADED, ABSENT, CORRUPT, UNSUPPORTED = "loaded", "absent", "corrupt", "unsupported"
_MODEL_SOURCES = Path(objective_module.__file__).parent


def unsupported_reason(version: tuple[int, int] | None = None) -> str | None:
    """Why this torch's step is traced on every start, or None where it can be precompiled."""
    version = version or torch_version()
    if version < VERIFIED_TORCH:
        return (f"torch {version[0]}.{version[1]}: a precompiled train step is used from torch "
                f"{VERIFIED_TORCH[0]}.{VERIFIED_TORCH[1]} on")
    if not hasattr(torch.compiler, "load_compiled_function") \
            or importlib.util.find_spec("torch._dynamo.aot_compile") is None:
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function / aot_compile"
    return None


def step_key(objective: DraftObjective, like: DrafterInputs, variant: str) -> str:
    """16 hex of what the graphs were traced from (see the module docstring); `variant`
    names how the step is built ("default", "cudagraphs whole_step static", ...)."""
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
             "features": like.features.shape[-1], "device": like.input_ids.device.type, "variant": variant}
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

    def compile(self, objective: DraftObjective, inputs: DrafterInputs, dynamic: bool | None = True):
        """Trace and compile one more graph, for these inputs' shape (in the build only),
        with torch.compile's `dynamic` (None: the dimensions marked dynamic on the inputs);
        the new graph. Without gradients: torch 2.13 saves a parameter's gradient among
        the guards' state and cannot load it again ("assigned grad expected to be a
        Tensor or None"); the guards do not look at them, so a call with gradients passes."""
        held = [p.grad for p in objective.drafter.parameters()]
        objective.drafter.zero_grad(set_to_none=True)
        try:
            compiled = torch.compile(DraftObjective.forward, fullgraph=True, dynamic=dynamic)
            function = compiled.aot_compile(((objective, inputs), {}))
        finally:
            for param, grad in zip(objective.drafter.parameters(), held):
                param.grad = grad
        # Held as a later process loads it: its guards as saved, which differ from the
        # compiled function's own (a dimension marked dynamic on the example is no guard
        # of the saved one, whose guards refuse a tensor so marked), so this process runs
        # by the rules the next one will, and what is saved is what ran.
        self.functions.append(_deserialize(_serialize(function)))
        return self.functions[-1]

    def refusal(self, objective: DraftObjective, inputs: DrafterInputs) -> str:
        """The guards of the first graph that fail these inputs, in Dynamo's words."""
        first = self.functions[0]
        failed = first._artifacts.guard_manager.check_verbose(first.prepare_f_locals(objective, inputs))
        return "; ".join(part.split("  #")[0].strip() for part in failed.verbose_code_parts)

    def save(self) -> int | None:
        """Write every graph to `path` (manifest last); its size. Raises OSError (disk full)."""
        if self.path is None:
            return None
        data = pickle.dumps([_serialize(f) for f in self.functions])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(self.path), data)
        manifest = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "torch": torch.__version__,
                    "graphs": len(self.functions), "saved_at": time.time()}
        write_atomic(str(self.path.with_suffix(".json")), json.dumps(manifest, sort_keys=True).encode())
        return len(data)


# The graphs of each (key folder, step key), loaded or compiled by the first drafter's
# build, found by the others'.
_SHARED: dict[tuple[Path, str], PrecompiledStep] = {}
# Why building from precompiled graphs failed in this process, once it did: the drafters
# after it trace their steps too.
FAILED: list[str] = []


def shared_step(folder: Path, key: str) -> PrecompiledStep:
    """The process's PrecompiledStep of `key` in `folder`, opened at the first ask."""
    if (folder, key) not in _SHARED:
        _SHARED[(folder, key)] = open_precompiled(folder, key)
    return _SHARED[(folder, key)]


def give_up(why: BaseException | str) -> None:
    """Building from precompiled graphs failed, or cannot work here: say why, once; this
    process traces from now on."""
    FAILED.append(why if isinstance(why, str) else f"{type(why).__name__}: {why}")
    say(f"precompiled train step not used: {FAILED[0][:500]}; Dynamo traces the step")


def save_new(step: PrecompiledStep, had: int) -> None:
    """Save `step` when its build added graphs to the `had` it found (a failed save is
    said; the run goes on)."""
    if len(step.functions) <= had:
        return
    try:
        size = step.save()
    except (OSError, RuntimeError, pickle.PicklingError) as exc:
        say(f"precompiled train step not saved to {step.path}: {type(exc).__name__}: {exc}")
    else:
        say(f"precompiled train step saved: {step.path} ({len(step.functions)} graph(s), {size:,} bytes)")


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
    return [_deserialize(blob) for blob in pickle.loads(data)]


def _serialize(function) -> bytes:
    from torch._dynamo.aot_compile import AOTCompiledFunction

    return AOTCompiledFunction.serialize(function).serialized_data


def _deserialize(blob: bytes):
    # Inside a throwaway tracing context: a graph guarded on a module reached by import
    # (flex attention's block mask is, on `__import__('torch').utils._pytree.SUPPORTED_NODES`)
    # re-makes that ImportSource when its guards are unpickled, which installs a guard in
    # the ongoing trace and raises where there is none ("TracingContext.get() must be
    # called within an ongoing trace"). The guards that check calls come from the file.
    with torch._guards.tracing(torch._guards.TracingContext(None)):
        return torch.compiler.load_compiled_function(io.BytesIO(blob), f_globals=objective_module.__dict__)
