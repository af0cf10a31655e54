#!/usr/bin/env python3
"""dflash agent launcher, shipped in every release next to dflash_agent/.

    <python> <workspace>/current/remote/agent.py --workspace <workspace> VERB [options]

Only the standard library is needed (see dflash_agent's docstring for the verbs).
"""
import os
import sys

# The script's folder is normally sys.path[0] already, but not under -P/-I
# (PYTHONSAFEPATH); the agent must find its package either way.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Nothing is ever written into a release, bytecode included (docs/layout.md);
# the environment carries this to the supervisor and the trainer.
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"

from dflash_agent.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
