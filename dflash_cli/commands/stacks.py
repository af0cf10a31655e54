"""dflash stacks: where every thread of a run is, by thread name.

Short for `dflash fetch-traceback --stacks`: a live run dumps its stacks now, a run
whose process is gone shows the last dump it left in faulthandler.log.
"""
from __future__ import annotations

from ..errors import ExitCode
from ..local_state import RunRef
from ..session import Session
from . import fetch_traceback


def run(session: Session, ref: RunRef) -> ExitCode:
    return fetch_traceback.run(session, ref, thread=None, all_records=False, output=None, stacks=True)
