"""How an event type is declared and checked: its fields, each with a kind (the JSON
values it may hold) and whether it must be there.

A check refuses an unknown field, a missing required field and a value of the wrong
kind, naming the event type and the field. Reading is by name: `STEP.loss` is the
string "loss", and a field the type does not declare is an AttributeError, so a reader
of a renamed field fails where it is read (under test), not in a chart drawn later.

Stdlib only and Python 3.8, like the agent that imports it.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Tuple, TypedDict

from ..checker import Keys, Mismatch, Rules, check_keys, convert


class EventError(ValueError):
    """An event that does not fit its type: `event` is its type's name, `field` the field
    at fault (None when the type itself is unknown)."""

    def __init__(self, event: str, field: Optional[str], problem: str):
        self.event, self.field, self.problem = event, field, problem
        where = "%s event" % event if field is None else "%s event: field %r" % (event, field)
        super().__init__("%s: %s" % (where, problem))


def _shown(value: Any) -> str:
    text = repr(value)
    return "%s (%s)" % (text if len(text) <= 60 else text[:57] + "...", type(value).__name__)


class Kind:
    """The JSON values a field may hold: `annotation` the type the contract's checker judges
    them by, `text` says which in docs and errors."""

    def __init__(self, text: str, annotation: Any):
        self.text, self.annotation = text, annotation

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with `value`, or None when it fits."""
        try:
            convert(self.annotation, value, _EVENTS)
        except Mismatch as refused:
            return self._phrase(refused)
        return None

    def _phrase(self, refused: Mismatch) -> str:
        """"item 1: key 'bytes': expected an integer, got '1' (str)": the steps into the
        value, then what the kind there holds."""
        kind, steps = self, ""  # type: Kind, str
        for step in refused.path:
            while isinstance(kind, Nullable):
                kind = kind.inner
            if isinstance(step, int):
                kind, steps = kind.item, steps + "item %d: " % step  # type: ignore[attr-defined]
            else:
                inner = kind.value if isinstance(kind, MapOf) else kind.keys[step]  # type: ignore[attr-defined]
                kind, steps = inner, steps + "key %r: " % step
        keys = " {%s}" % ", ".join(kind.keys) if isinstance(kind, Record) else ""
        return "%sexpected %s%s, got %s" % (steps, kind.text, keys, _shown(refused.value))


_EVENTS = Rules()  # events are plain JSON: no records but Record's, nothing built

INT = Kind("an integer", int)
NUMBER = Kind("a number", float)
STR = Kind("a string", str)
BOOL = Kind("true or false", bool)


class Nullable(Kind):
    def __init__(self, inner: Kind):
        super().__init__("%s or null" % inner.text, Optional[inner.annotation])
        self.inner = inner


class OneOf(Kind):
    def __init__(self, *values: str):
        super().__init__("one of %s" % ", ".join(map(repr, values)), Literal[values])
        self.values = values


class ListOf(Kind):
    def __init__(self, item: Kind):
        super().__init__("a list of %s" % _plural(item.text), List[item.annotation])  # type: ignore[name-defined]
        self.item = item


class MapOf(Kind):
    """A JSON object of any keys (strings), every value of one kind."""

    def __init__(self, value: Kind):
        super().__init__("an object of %s" % _plural(value.text), Dict[str, value.annotation])  # type: ignore
        self.value = value


class Record(Kind):
    """A JSON object of exactly these keys, each of its kind."""

    def __init__(self, text: str, keys: Mapping[str, Kind]):
        annotation = TypedDict(text.title().replace(" ", ""), {key: kind.annotation for key, kind in keys.items()})
        super().__init__(text, annotation)
        self.keys = dict(keys)


def _plural(text: str) -> str:
    """"an integer" -> "integers", "a list of strings" -> "lists of strings", "a number
    or null" -> "numbers or null"."""
    article, _, rest = text.partition(" ")
    if article not in ("a", "an"):
        return text
    for joint in (" of ", " or "):
        noun, found, tail = rest.partition(joint)
        if found:
            return noun + "s" + found + tail
    return rest + "s"


class Field:
    def __init__(self, name: str, kind: Kind, doc: str, required: bool = True):
        self.name, self.kind, self.doc, self.required = name, kind, doc, required


def optional(name: str, kind: Kind, doc: str) -> Field:
    """A field an event of its type may leave out."""
    return Field(name, kind, doc, required=False)


class Detail:
    """The fields an event has besides its type's own when a field holds one value (a
    start-up event's, by phase), and what that value means."""

    def __init__(self, doc: str, *fields: Field):
        self.doc, self.fields = doc, fields


class EventType:
    """One type of event: its name (the `type` field), who writes it, its fields.

    `details` (start-up only): {value of field `detail_of`: its Detail}; a value not
    among them is refused, so every variant is declared."""

    def __init__(self, name: str, doc: str, envelope: Tuple[Field, ...], fields: Tuple[Field, ...] = (),
                 detail_of: Optional[str] = None, details: Optional[Mapping[str, Detail]] = None):
        self.name, self.doc, self.envelope, self.own_fields = name, doc, envelope, fields
        self.detail_of, self.details = detail_of, dict(details or {})
        self._fields = {f.name: f for f in envelope + fields}
        self._required = tuple(f.name for f in envelope + fields if f.required)
        self._details = {value: {f.name: f for f in detail.fields} for value, detail in self.details.items()}
        clash = set(self._fields) & (set(dir(type(self))) | set(vars(self)))
        if clash:
            raise ValueError("%s event: field(s) %s hide attributes of EventType" % (name, sorted(clash)))

    def __getattr__(self, name: str) -> str:
        """A declared field's name (STEP.loss == "loss"); any other is an AttributeError."""
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return name
        raise AttributeError("%s events have no field %r" % (self.__dict__.get("name", "?"), name))

    def matches(self, record: Mapping[str, Any]) -> bool:
        """Whether `record` says it is an event of this type (its fields unchecked)."""
        return record.get("type") == self.name

    def check(self, record: Mapping[str, Any]) -> None:
        """Raise EventError unless `record` is a whole, well-typed event of this type."""
        if record.get("type") != self.name:
            raise EventError(self.name, "type", "expected %r, got %s" % (self.name, _shown(record.get("type"))))
        fields: Dict[str, Field] = self._fields
        if self.detail_of is not None:
            value = record.get(self.detail_of)
            if value not in self._details:
                raise EventError(self.name, self.detail_of, "%s is not one of the schema's: %s"
                                 % (_shown(value), ", ".join(map(repr, self._details))))
            fields = dict(fields, **self._details[value])
        keys = Keys({name: field.kind.annotation for name, field in fields.items()},
                    (name for name in fields if name not in self._required))
        try:
            check_keys(keys, record, self)
        except Mismatch as refused:
            problem = "unknown field" if refused.reason == Mismatch.UNKNOWN else "required but missing"
            raise EventError(self.name, refused.keys[0], problem) from None
        for name, value in record.items():
            found = fields[name].kind.problem(value)
            if found is not None:
                raise EventError(self.name, name, found)

    def record(self, ts: float, fields: Mapping[str, Any], thread: Optional[str] = None) -> Dict[str, Any]:
        """The event as it is written: envelope first, then `fields`; checked."""
        event: Dict[str, Any] = {"ts": ts, "type": self.name}
        if thread is not None:
            event["thread"] = thread
        event.update(fields)
        self.check(event)
        return event


def by_name(types: Iterable[EventType]) -> Dict[str, EventType]:
    table: Dict[str, EventType] = {}
    for kind in types:
        if kind.name in table:
            raise ValueError("event type %r declared twice" % kind.name)
        table[kind.name] = kind
    return table
