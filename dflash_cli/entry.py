"""The `dflash` command (the console script, and `python -m dflash_cli`).

`dflash deploy` starts each host's probe before the click layer and the rest of the CLI
are imported (deploy_early), from the command line the last such deploy ran before
anything else (probe_cache); every command then runs through the click layer (cli.py).
"""
from __future__ import annotations

import os
import sys

from . import probe_cache  # a few modules of the standard library, and only for a deploy


def main() -> None:
    # the probes kept from the last deploy of this command line start first of all: what
    # follows (deploy_early's imports, the inventory, `ssh -G`) runs while they connect
    probe_cache.start(sys.argv[1:])
    from . import deploy_early  # the standard library only, until a deploy is started

    deploying = False
    try:
        deploying = deploy_early.start(sys.argv[1:])
        from .cli import main as cli
        from .completion import COMPLETE_VAR

        # One variable whatever the command is called (dflash, dflash-trainer, python -m
        # dflash_cli): the completion script `dflash completion` prints sets it.
        cli(complete_var=COMPLETE_VAR)
    except KeyboardInterrupt:  # before the click layer took over; it says so itself after
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except SystemExit as done:
        if not deploying:
            raise
        _exit_now(done.code)
    finally:
        deploy_early.abandon()
        probe_cache.abandon()


def _exit_now(code: object) -> None:
    """Exit as SystemExit(code) would, without tearing down the interpreter's modules one
    by one (~20 ms, a tenth of an unchanged deploy over a ControlMaster). Only for deploy:
    once its hosts answered and its output is written, nothing is left to do at exit
    (its session was closed, no tracker or other atexit work is pending)."""
    from . import deploy_early

    deploy_early.abandon()
    probe_cache.abandon()
    if code is not None and not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: as Python itself reports a failed flush at exit
        code = 120
    os._exit(code or 0)
