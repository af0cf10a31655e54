"""dflash --version: this dflash's version and the release the current tree would deploy."""
from __future__ import annotations

import dataclasses

from ..deployment import source_tree


@dataclasses.dataclass(frozen=True)
class Version:
    dflash_version: str | None  # None: not installed
    release_id: str  # the release the current tree would deploy


def version() -> Version:
    """The tree is chosen as `deploy` without --source chooses it, and said on stderr
    (its `source:` line) as `deploy` says it."""
    tree, source = source_tree(None)
    return Version(source.dflash_version, tree.release_id)
