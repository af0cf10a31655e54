"""A run's events.jsonl as a test reads it while the trainer may still be writing it."""
from __future__ import annotations

import json
from pathlib import Path


def read_events(path: Path, kind: str | None = None) -> list[dict]:
    """The events written so far, of `kind` if given: none before the trainer made the file,
    and not a line it is still writing (only lines that end in a newline are whole)."""
    text = path.read_text() if path.exists() else ""
    events = [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]
    return [e for e in events if kind is None or e.get("type") == kind]
