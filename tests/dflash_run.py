"""Running the real `dflash` CLI as a subprocess, the way a user does."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dflash_argv(*args: str, hosts: Path | None = None) -> list[str]:
    """`dflash [--hosts FILE] ARGS…` as this interpreter runs it."""
    return [sys.executable, "-m", "dflash_cli", *(["--hosts", str(hosts)] if hosts is not None else []), *args]


def dflash_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Plain output (no colour, wide tables) for reading and comparing."""
    return {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(extra or {})}


def dflash(*args: str, hosts: Path | None = None, cwd: Path | None = None, timeout: float = 240,
           env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    """`dflash [--hosts FILE] ARGS…`, stdout and stderr captured separately."""
    return subprocess.run(dflash_argv(*args, hosts=hosts), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dflash_env(env), **kwargs)


def popen_dflash(*args: str, hosts: Path | None = None) -> subprocess.Popen[bytes]:
    """`dflash [--hosts FILE] ARGS…` started, its stdout and stderr as pipes."""
    return subprocess.Popen(dflash_argv(*args, hosts=hosts), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dflash_env())
