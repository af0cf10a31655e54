"""dflash --version: this dflash's version and the release the current tree would deploy."""
from __future__ import annotations

from .. import console
from ..deployment import source_tree
from ..errors import ExitCode


def run() -> ExitCode:
    """`dflash X.Y.Z` and `release <id>` on stdout; the `source:` line on stderr, as
    `deploy` says it: the tree is chosen as `deploy` without --source chooses it."""
    tree, source = source_tree(None)
    console.data(f"dflash {source['dflash_version'] or '(version unknown: not installed)'}\n"
                 f"release {tree.release_id}\n")
    return ExitCode.OK
