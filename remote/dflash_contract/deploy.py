"""The deploy receiver's answers as types (dflash_cli/host_scripts/deploy_receiver.py,
whose docstring says what each verb does).

The receiver is sent as source to a host that may have nothing of dflash installed, so
it cannot import this module: it prints plain JSON objects of these keys, and the CLI
reads each with `from_json()`, strictly. Both ends come from the CLI's own tree.
"""
import dataclasses
from typing import Dict, Optional, Tuple

from .checker import Message, optional


@dataclasses.dataclass(frozen=True)
class ProbeAnswer(Message):
    """`probe`: `status` abandoned (stdin gave no release id), unchanged, present (intact,
    not current, left so), switched (made current) or missing; a missing release's answer
    lists the current release's intact files and the problems of a modified copy."""

    ABANDONED, UNCHANGED, PRESENT, SWITCHED, MISSING = "abandoned", "unchanged", "present", "switched", "missing"

    status: str
    release_id: Optional[str] = optional()
    current: Optional[str] = optional(written=True)  # present, missing: the current release, null if none
    previous: Optional[str] = optional(written=True)  # switched: the release that was current
    current_files: Optional[Dict[str, str]] = optional()  # missing: {path: sha256}
    modified: Optional[Tuple[str, ...]] = optional()  # missing: the problems of the host's copy


@dataclasses.dataclass(frozen=True)
class InstallAnswer(Message):
    """`install`: `status` installed, or repaired (a modified copy was set aside)."""

    status: str
    release_id: str
    previous: Optional[str]
    files_received: int
    files_reused: int
    set_aside: Optional[str] = optional()


@dataclasses.dataclass(frozen=True)
class CheckAnswer(Message):
    """`check`: the current release (null if none) and its problems."""

    current: Optional[str]
    modified: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ReceiverError(Message):
    """Any verb that failed: `error` the exception and its message, `errno` its errno."""

    status: str
    error: str
    errno: Optional[int] = optional(written=True)
