"""faulthandler.log as people read it: threads named, and the newest dump on its own.

faulthandler writes without the GIL (so it works while a hung thread holds it) and
therefore names a thread only by its ident: `Thread 0x00007f3a1b2c3700 (most recent call
first):`. The trainer records {ident: name} of its threads in threads.json as they start;
`name_threads` turns that line into `Thread 0x00007f3a1b2c3700 [drafter-1] (most recent
call first):`.

A dump begins with a header line `=== stacks of every thread: <reason> at <time> ===`
(written by whoever asks for one: the agent's `stacks` before SIGUSR1, the trainer before
its own dump of threads that outlived a stop) or, for a hard crash, with faulthandler's
`Fatal Python error: …`.
"""
from __future__ import annotations

import re
import time
from typing import Dict

from .jsonio import read_json
from .layout import RunDir

HEADER_PREFIX = "=== stacks of every thread: "
_THREAD_LINE = re.compile(r"^((?:Current thread|Thread) 0x([0-9a-fA-F]+))", re.MULTILINE)
_DUMP_START = re.compile(r"^(?:%s|Fatal Python error)" % re.escape(HEADER_PREFIX), re.MULTILINE)


def header(reason: str) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return "%s%s at %s ===\n" % (HEADER_PREFIX, reason, stamp)


def thread_names(run: RunDir) -> Dict[int, str]:
    """threads.json as {ident: name}; {} when absent or unreadable (torn files are not
    expected, as it is replaced atomically, but a dump must never fail over names)."""
    try:
        names = read_json(run.threads_json)
    except ValueError:
        return {}
    if not isinstance(names, dict):
        return {}
    out = {}
    for ident, name in names.items():
        try:
            out[int(ident)] = str(name)
        except ValueError:
            continue
    return out


def name_threads(text: str, names: Dict[int, str]) -> str:
    def label(match: "re.Match[str]") -> str:
        name = names.get(int(match.group(2), 16))
        return match.group(1) + (" [%s]" % name if name else "")

    return _THREAD_LINE.sub(label, text)


def last_dump(text: str) -> str:
    """The newest dump of a faulthandler.log (all of it when no dump start is marked)."""
    starts = [m.start() for m in _DUMP_START.finditer(text)]
    return text[starts[-1]:] if starts else text
