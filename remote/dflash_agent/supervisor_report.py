"""What a supervisor tells the agent process that started it, on the report pipe, read
through the contract's one checker. Annotations here are evaluated (no
`from __future__ import annotations`): the checker reads them as types."""
import dataclasses
from typing import Optional

from dflash_contract.checker import Message, optional


@dataclasses.dataclass(frozen=True)
class SupervisorReport(Message):
    """The one line a supervisor sends its launcher on the report pipe: the trainer
    started (its pid, also its process group's), or why not."""

    ok: bool
    pid: Optional[int] = optional()
    pgid: Optional[int] = optional()
    error: Optional[str] = optional()
    errno: Optional[int] = optional()  # the failure's, when it was an OSError (a full disk)
    filename: Optional[str] = optional()

    @classmethod
    def describe(cls) -> str:
        return "supervisor report"
