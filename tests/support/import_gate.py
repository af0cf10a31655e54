"""A stand-in for a module the CLI imports, first on its path: the import waits until the
test creates a gate file, then loads the real module. What the CLI starts before that
import can make the file appear; what it starts after it never can."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

_GATE = '''\
import importlib, os, sys, time
gate = os.environ["TEST_IMPORT_GATE"]
deadline = time.monotonic() + 60
while not os.path.exists(gate):
    if time.monotonic() > deadline:
        raise SystemExit("{module} was imported before any probe started")
    time.sleep(0.01)
sys.path.remove(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
del sys.modules["{module}"]
sys.modules["{module}"] = importlib.import_module("{module}")
'''


def gated_import(folder: Path, module: str) -> tuple[Path, dict[str, str]]:
    """`module` held at its import until the returned gate file exists: (the gate file, the
    variables that put the stand-in first on a process's path)."""
    shim = folder / f"{module} gate"
    (shim / module).mkdir(parents=True, exist_ok=True)
    (shim / module / "__init__.py").write_text(_GATE.format(module=module))
    gate = folder / "gate"
    return gate, {"TEST_IMPORT_GATE": str(gate),
                  "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """The gated process's exit code, stdout and stderr, once it ends (killed after 120 s)."""
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err
