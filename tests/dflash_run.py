"""Running the real `dflash` CLI as a subprocess, the way a user does."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dflash(*args: str, hosts: Path | None = None, cwd: Path | None = None, timeout: float = 240,
           env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    """`dflash [--hosts FILE] ARGS…`, stdout and stderr captured separately."""
    argv = [sys.executable, "-m", "dflash_cli"]
    if hosts is not None:
        argv += ["--hosts", str(hosts)]
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run(argv + list(args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env, **kwargs)
