"""One module per verb, imported by its click command when it runs (`stacks` is
fetch_traceback's with stacks=True). A verb's core function takes the session (and the
run it acts on) positionally, everything else by keyword or in its options dataclass,
whose ranges it checks (errors.BadOption); it returns one result and prints none of it:
results.py renders it, for the CLI, and the Python API returns it. A verb's module
imports the core, never another verb's: what several verbs share lives in the core."""
from __future__ import annotations

import dataclasses

from ..errors import at_least
from ..retry import RETRY_FOR_S

#: seconds between GPU samples: defaults of `watch` and of `launch --follow` (here, so
#: that the CLI's option default does not import the watch verb)
GPU_INTERVAL_S = 5.0

#: seconds between SIGTERM and SIGKILL: `stop`'s default (here, so that the CLI's option
#: default does not import the stop verb)
GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class WatchOptions:
    """What a watch was asked for (`watch`, and `launch`/`resume --follow` with the
    defaults), checked as it is made. Here, not in the watch verb: the API's watch and
    the CLI's share it without importing the verb's printer."""
    tail: int | None = None  # first the last N lines of the log
    gpu_interval: float = GPU_INTERVAL_S  # seconds between GPU samples
    retry_for: float = RETRY_FOR_S  # seconds to keep reconnecting to an unreachable host
    trackers: bool = True  # feed the trackers of dflash.yaml

    def __post_init__(self) -> None:
        at_least("tail", self.tail, 0)
        at_least("gpu_interval", self.gpu_interval, 0.5)
        at_least("retry_for", self.retry_for, 0)
