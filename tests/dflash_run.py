"""Running the real `dflash` CLI: as a subprocess, the way a user does, or in this process
(`dflash_in_process`) where the process boundary is not what a test checks."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from click.testing import CliRunner

from dflash_cli import cli, console

REPO = Path(__file__).resolve().parent.parent
WIDE = 200  # columns: tables are never wrapped


def dflash_argv(*args: str, hosts: Path | None = None) -> list[str]:
    """`dflash [--hosts FILE] ARGS…` as this interpreter runs it."""
    return [sys.executable, "-m", "dflash_cli", *(["--hosts", str(hosts)] if hosts is not None else []), *args]


def dflash_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Plain output (no colour, wide tables) for reading and comparing."""
    return {**os.environ, "NO_COLOR": "1", "COLUMNS": str(WIDE), **(extra or {})}


def dflash(*args: str, hosts: Path | None = None, cwd: Path | None = None, timeout: float = 240,
           env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess[str]:
    """`dflash [--hosts FILE] ARGS…`, stdout and stderr captured separately."""
    return subprocess.run(dflash_argv(*args, hosts=hosts), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dflash_env(env), **kwargs)


def popen_dflash(*args: str, hosts: Path | None = None) -> subprocess.Popen[bytes]:
    """`dflash [--hosts FILE] ARGS…` started, its stdout and stderr as pipes."""
    return subprocess.Popen(dflash_argv(*args, hosts=hosts), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dflash_env())


@contextlib.contextmanager
def _working_directory(path: Path | None) -> Iterator[None]:
    before = os.getcwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def dflash_in_process(*args: str, hosts: Path | None = None, cwd: Path | None = None,
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`dflash [--hosts FILE] ARGS…` run by click's CliRunner in this process: the exit code,
    stdout and stderr that `dflash()` gives, without starting an interpreter. For every check
    where the process boundary is not what is tested; signals, Ctrl-C, detaching and
    following a live run need `dflash()` / `popen_dflash()`."""
    argv = [*(["--hosts", str(hosts)] if hosts is not None else []), *args]
    # The console is made at its first use and reads COLUMNS then: each invocation makes its
    # own, as a new process would, and leaves none behind pinned to its width.
    console.__dict__.pop("human", None)
    try:
        with _working_directory(cwd):
            result = CliRunner().invoke(cli.main, argv, prog_name="python -m dflash_cli", catch_exceptions=False,
                                        env={"NO_COLOR": "1", "COLUMNS": str(WIDE), **(env or {})})
    finally:
        console.__dict__.pop("human", None)
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)
