"""Scripts the CLI runs on a host as `python -c SOURCE ARG...`: deploy's receiver
(deploy_receiver.py) and setup's installer (host_setup.py). Each is one file of the
standard library only, for Python 3.8 and newer (tests/test_sent_sources.py holds them to
it), since it runs before anything of dflash is installed there.

They are the CLI's, not remote/'s: remote/ is the release, which the receiver installs
and whose trainer runs in the environment setup makes, so these must work on a host that
has no release yet, in the version of the CLI that sends them (a change to them changes
no release id, and they are not deployed).
"""
from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def source(script: str) -> str:
    """The text of `script`, a file of this folder, read when it is first sent."""
    return Path(__file__).with_name(script).read_text()
