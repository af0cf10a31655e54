"""`python -m dflash_contract.events > docs/events.md`: the events' reference, made from the schema."""
from __future__ import annotations

import sys
from typing import List, Tuple

from . import BY_TRAINER, TYPES
from .fields import EventType, Field, Kind, ListOf, MapOf, Nullable, Record

HEADER = """\
# events.jsonl

<!-- Made by `python -m dflash_contract.events > docs/events.md` from remote/dflash_contract/events, which is
the authority (the trainer checks every event against it before writing it); a test holds
this file equal to what the command prints. -->

A run's events, one JSON object per line in `runs/<run-id>/events.jsonl` on its host
(layout.md); `dflash watch` mirrors them (cli.md). A field marked optional may be left
out; "or null" means it is always there and may be null.
"""


def _table(fields: Tuple[Field, ...]) -> List[str]:
    lines = ["| field | value | |", "| --- | --- | --- |"]
    for field in fields:
        required = "" if field.required else "optional: "
        lines.append("| `%s` | %s | %s%s |" % (field.name, field.kind.text, required, field.doc))
    return lines


def _section(kind: EventType) -> List[str]:
    missing = [f.name for f in BY_TRAINER if f not in kind.envelope]
    writer = "the trainer" if not missing else "the agent's supervisor (no %s)" % ", ".join(
        "`%s`" % name for name in missing)
    lines = ["", "## `%s`" % kind.name, "", "%s Written by %s." % (kind.doc, writer), ""]
    lines += _table(kind.own_fields)
    for value, detail in kind.details.items():
        lines += ["", "### `%s`: `%s`" % (kind.detail_of, value), "", detail.doc]
        if detail.fields:
            lines += [""] + _table(detail.fields)
    return lines


def _records(kind: Kind) -> List[Record]:
    """The Record kinds inside `kind`."""
    if isinstance(kind, Record):
        return [kind]
    if isinstance(kind, ListOf):
        return _records(kind.item)
    if isinstance(kind, Nullable):
        return _records(kind.inner)
    if isinstance(kind, MapOf):
        return _records(kind.value)
    return []


def markdown() -> str:
    lines = [HEADER.rstrip("\n"), "", "## Every event", ""]
    lines += _table(BY_TRAINER)
    fields = [f for kind in TYPES.values() for f in kind.own_fields + tuple(
        f for detail in kind.details.values() for f in detail.fields)]
    records = {id(r): r for f in fields for r in _records(f.kind)}
    for record in records.values():
        keys = ", ".join("`%s`: %s" % (key, kind.text) for key, kind in record.keys.items())
        lines += ["", "%s%s is a JSON object of %s." % (record.text[0].upper(), record.text[1:], keys)]
    for kind in TYPES.values():
        lines += _section(kind)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
