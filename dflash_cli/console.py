"""Where output goes: data on stdout, everything for humans on stderr (docs/cli.md).

rich renders tables and progress on stderr (`human`); it honours NO_COLOR by itself.
`human` is made, and rich imported, when first used: a command reaches its hosts
before it prints, so their connections start without waiting for rich's import.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from .errors import DflashError

if TYPE_CHECKING:
    from rich.console import Console

    human: Console

_making = threading.Lock()


def _human() -> Console:
    global human
    with _making:
        if "human" not in globals():
            from rich.console import Console

            human = Console(stderr=True, highlight=False)
    return human


def __getattr__(name: str):
    if name == "human":
        return _human()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def data(text: str) -> None:
    """Write data (run ids, JSON lines) to stdout, unchanged. Text from the host goes
    through `remote_text`."""
    sys.stdout.write(text)
    sys.stdout.flush()


def json_line(value: Any) -> str:
    """One JSON document on one line, for --json: a result's `to_json()` where it has
    one, a dataclass as its fields, an enum as its value, a path as its text."""
    return json.dumps(value, default=_jsonable) + "\n"


def host_outcome(host: str, outcome: Any) -> dict[str, Any]:
    """One host's object of a verb's --json lines: its result (a dataclass or a reply),
    or its error (a DflashError) as the error object of a failed command is."""
    if isinstance(outcome, DflashError):
        return {"host": host, "error": outcome.message, "hint": outcome.hint, "exit_code": int(outcome.exit_code)}
    return {"host": host, **_jsonable(outcome)}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _escapes() -> dict[int, str]:
    """What a terminal would act on instead of showing: C0 controls but tab and newline,
    DEL, C1 controls, the bidirectional overrides, and undecodable bytes (held as lone
    surrogates, as the agent's decode_bytes makes them)."""
    table = {code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7f, 0xa0)]}
    table.update({ord("\r"): "\\r"})
    del table[ord("\t")], table[ord("\n")]
    table.update({code: f"\\u{code:04x}" for code in [*range(0x202a, 0x202f), *range(0x2066, 0x206a)]})
    table.update({0xdc00 + byte: f"\\x{byte:02x}" for byte in range(0x80, 0x100)})
    return table


_ESCAPES = _escapes()


def printable(text: str) -> str:
    """Text from the host (log lines, tracebacks) with every control character shown as
    an escape (\\x1b, \\r, \\x00, ...) so that it cannot move the cursor or hide text;
    tab and newline stay. The local mirror and --json keep the exact bytes."""
    return text.translate(_ESCAPES)


def remote_text(text: str) -> None:
    """Write text from the host to stdout for people to read: escaped (`printable`)."""
    sys.stdout.flush()
    sys.stdout.buffer.write(printable(text).encode("utf-8"))
    sys.stdout.buffer.flush()


def say(message: str) -> None:
    _human().print(message, markup=False, soft_wrap=True)


def warn(message: str) -> None:
    _human().print(f"warning: {message}", style="yellow", markup=False, soft_wrap=True)


def utc_time(ts: float | None, timespec: str = "seconds") -> str:
    """A Unix time as ISO-8601 in UTC, as the trainer's log lines and the traceback
    headers give times ("" for none): one form on every screen, whatever the zone of
    the host or of this machine."""
    if ts is None:
        return ""
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec=timespec)
