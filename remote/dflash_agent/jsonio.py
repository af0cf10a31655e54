"""JSON on stdout and from files, and reading files from their end.

Everything the agent prints goes through `encode_line`: compact JSON, one object per
line, valid UTF-8 even when the data holds undecodable log bytes (see `decode_bytes`).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterator, Optional

BLOCK = 64 * 1024


class AgentError(Exception):
    """A problem reported to the caller as a replies.ErrorReply (`extra`: its optional
    keys), with exit 2 or 1."""

    EXIT_CODES = {"usage": 2, "not_found": 2, "conflict": 2, "host": 2, "internal": 1}

    def __init__(self, message: str, kind: str = "internal", **extra: Any):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.extra = extra

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES[self.kind]


def no_space(path: Optional[str]) -> AgentError:
    """A write that failed for want of space: the host was reached but cannot take it
    (kind "host", exit 2), naming the path."""
    return AgentError("no space left on device: cannot write %s" % (path or "in the workspace"),
                      "host", path=path)


def decode_bytes(data: bytes) -> str:
    """Log bytes -> str; undecodable bytes become lone surrogates so that
    text.encode("utf-8", "surrogateescape") gives the exact bytes back."""
    return data.decode("utf-8", "surrogateescape")


def encode_line(obj: Any) -> bytes:
    """One compact JSON line. Lone surrogates (from `decode_bytes`) cannot be written as
    UTF-8; backslashreplace turns each into the six characters \\udcXX, which inside a
    JSON string is exactly the escape that json.loads turns back into that surrogate.
    Everything else stays raw UTF-8, so non-ASCII text costs no \\u escapes."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace") + b"\n"


def emit(obj: Any) -> None:
    """Print one JSON object as the verb's answer."""
    out = sys.stdout.buffer
    out.write(encode_line(obj))
    out.flush()


def read_json(path: str) -> Optional[Any]:
    """The parsed file, or None when it does not exist."""
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except FileNotFoundError:
        return None


def lines_backwards(path: str) -> Iterator[bytes]:
    """Complete lines of a file, last first, newline stripped, read block by block from
    the end: the cost depends on how far back the caller reads, not on the file size.
    A last line without its newline (still being written) is skipped."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return
    with handle:
        pos = handle.seek(0, os.SEEK_END)
        rest = b""
        saw_newline = False
        while pos > 0:
            step = min(BLOCK, pos)
            pos -= step
            handle.seek(pos)
            rest = handle.read(step) + rest
            parts = rest.split(b"\n")
            rest = parts[0]  # may continue in the previous block
            complete = parts[1:]
            if complete and not saw_newline:
                complete = complete[:-1]  # what follows the file's last newline is unfinished
                saw_newline = True
            for line in reversed(complete):
                yield line
        if saw_newline:
            yield rest  # the file's first line


def tail_start(path: str, n_lines: int) -> int:
    """Byte offset where the last `n_lines` lines of the file begin (a final line without
    newline counts as a line), found by reading backwards from the end."""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        if n_lines <= 0:
            return size
        # A newline that ends the file terminates the last line rather than starting one.
        end = size
        if size:
            handle.seek(size - 1)
            if handle.read(1) == b"\n":
                end = size - 1
        pos = end
        found = 0
        while pos > 0:
            step = min(BLOCK, pos)
            pos -= step
            handle.seek(pos)
            block = handle.read(step)
            idx = len(block)
            while True:
                idx = block.rfind(b"\n", 0, idx)
                if idx < 0:
                    break
                found += 1
                if found == n_lines:
                    return pos + idx + 1
        return 0


def read_tail_text(path: str, n_lines: int, max_bytes: int = 8 * 1024 * 1024) -> str:
    """The last `n_lines` lines of a file as text ("" if it does not exist), at most
    `max_bytes` of them so that one giant line cannot blow up an answer."""
    try:
        start = tail_start(path, n_lines)
    except FileNotFoundError:
        return ""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        start = max(start, size - max_bytes)
        handle.seek(start)
        return decode_bytes(handle.read(size - start))
