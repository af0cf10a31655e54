"""The `dflash` command (the console script, and `python -m dflash_cli`): the click layer
(cli.py), with the completion variable every name of the command shares."""
from __future__ import annotations

import sys


def main() -> None:
    try:
        # imported here: a Ctrl-C while the CLI's modules load ends as quietly as one later
        from .cli import main as cli
        from .completion import COMPLETE_VAR

        # One variable whatever the command is called (dflash, dflash-trainer, python -m
        # dflash_cli): the completion script `dflash completion` prints sets it.
        cli(complete_var=COMPLETE_VAR)
    except KeyboardInterrupt:  # before the click layer took over; it says so itself after
        sys.stderr.write("interrupted\n")
        sys.exit(130)
