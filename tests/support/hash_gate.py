"""`dflash` with its hashing of the source tree held until the test creates a gate file.
`dflash deploy` starts each host's probe once the tree is listed and before it is hashed:
while the gate is shut, the probes are on the host waiting for the release id, and the
test can change the tree, or kill the deploy, in between."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HELD = '''\
import os, sys, time
from dflash_cli import release
from dflash_cli.entry import main
gate = sys.argv.pop(1)
hashed = release.Listing.hashed
def held(listing):
    deadline = time.monotonic() + 60
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise SystemExit("the gate was never opened")
        time.sleep(0.01)
    return hashed(listing)
release.Listing.hashed = held
sys.argv[0] = "dflash"
main()
'''


def held_dflash_argv(gate: Path, *args: str, hosts: Path) -> list[str]:
    """`dflash --hosts HOSTS ARGS…` as this interpreter runs it, hashing once `gate` exists."""
    return [sys.executable, "-c", _HELD, str(gate), "--hosts", str(hosts), *args]


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """The held process's exit code, stdout and stderr, once it ends (killed after 120 s)."""
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err
