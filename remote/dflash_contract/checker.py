"""The one strict checker: whether a value is of an annotated type (`convert`), and
whether an object gives only its declared keys and every one it must (`check_keys`). Its
refusal is a Mismatch that each reader phrases in its own words: the contract's JSON
below, dflash_schema's YAML configs and the events' fields (dflash_contract.events).

The contract's JSON: every reply, follow message and record is a frozen dataclass whose
fields are the keys of its JSON object, in the order they are written. `to_json()` is the object written; `from_json()` reads one strictly: a missing
or unknown key, or a value of another type, is a ProtocolError naming the type and the
key, so that a CLI and an agent of different releases (or a record another release
wrote) fail clearly instead of misreading each other. A field made with `optional()` is
a key left out rather than written as null.
"""
import collections.abc
import dataclasses
import enum
import math
import types
from typing import (Any, Dict, Iterable, Literal, Mapping, Optional, Tuple, Type, TypeVar, Union, get_args,
                    get_origin)


class ProtocolError(ValueError):
    """A JSON object that is not the type it was read as."""


_MAY_LACK = "dflash: a key that may be missing"
_OMITTED = "dflash: left out when None"
M = TypeVar("M", bound="Message")
_NONE = type(None)
# `X | Y` is a types.UnionType from Python 3.10 on, a typing.Union before.
UNIONS = (Union, getattr(types, "UnionType", Union))


def optional(written: bool = False) -> Any:
    """A field whose key may be missing (read as None). Its writer leaves it out when it
    is None, or, `written`, writes null: a key an older writer's record lacks."""
    return dataclasses.field(default=None, metadata={_MAY_LACK: True, _OMITTED: not written})


class Message:
    """The JSON (de)serialisation of every type below."""

    @classmethod
    def describe(cls) -> str:
        """How a ProtocolError names what it was reading."""
        return cls.__name__

    def to_json(self) -> Dict[str, Any]:
        out = {}  # type: Dict[str, Any]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.metadata.get(_OMITTED):
                continue
            out[field.name] = _dump(value)
        return out

    @classmethod
    def from_json(cls: Type[M], obj: Any) -> M:
        return read(cls, obj, cls.describe())


# -- the one judge: is this value of this annotated type --------------------------------------

class Keys:
    """A JSON object's (or YAML mapping's) declared keys: each key's type, and those that
    may be left out. A dataclass is read through the Keys its reader declares for it, a
    TypedDict through its annotations."""

    def __init__(self, types: Mapping[str, Any], optional: Iterable[str] = ()):
        self.types, self.optional = dict(types), frozenset(optional)


class Mismatch(ValueError):
    """`value`, at `path` (keys and list indexes from the outermost value), is not of
    `kind`. `reason` says how; `keys` are the keys at fault (UNKNOWN, MISSING); `inner`
    is why the one option of an Optional refused it; `problem` a record's own check's
    words (INVALID). Each reader phrases it in its own words."""

    WRONG_TYPE, NOT_ONE_OF, NOT_FINITE, UNKNOWN, MISSING, INVALID = (
        "wrong type", "not one of", "not finite", "unknown keys", "missing keys", "invalid")

    def __init__(self, reason: str, path: Tuple[Any, ...], kind: Any, value: Any, keys: Tuple[Any, ...] = (),
                 inner: "Optional[Mismatch]" = None, problem: str = ""):
        super().__init__("%s at %r: %s" % (reason, path, problem or shown(value)))
        self.reason, self.path, self.kind, self.value = reason, path, kind, value
        self.keys, self.inner, self.problem = keys, inner, problem


class Rules:
    """What differs between the readers (a record's keys, what is built), never what a
    value of a type is. The defaults read JSON into plain values."""

    finite_floats = False  # refuse inf and nan (YAML can spell them, JSON cannot)
    none_is_empty = False  # a record given as null reads as one given no keys

    def is_record(self, kind: Any) -> bool:
        return dataclasses.is_dataclass(kind) and isinstance(kind, type)

    def keys(self, cls: Any) -> Keys:
        raise NotImplementedError

    def build(self, cls: Any, values: Dict[str, Any], path: Tuple[Any, ...]) -> Any:
        return cls(**values)

    def number(self, value: Any) -> Any:
        return value

    def mapping(self, items: Dict[Any, Any]) -> Any:
        return items


def convert(kind: Any, value: Any, rules: Rules, path: Tuple[Any, ...] = ()) -> Any:
    """`value` read as `kind` (int, float, str, bool, None, Any, Optional and Union, Literal,
    an Enum, lists and tuples, dicts and Mappings, a TypedDict, a record `rules` knows), or Mismatch."""
    origin = get_origin(kind)
    if kind is Any:
        return value
    if kind is _NONE:
        if value is None:
            return None
        raise Mismatch(Mismatch.WRONG_TYPE, path, kind, value)
    if origin in UNIONS:
        return _one_of_union(kind, value, rules, path)
    if origin is Literal:
        choices = get_args(kind)
        if value in choices and type(value) in {type(choice) for choice in choices}:
            return value
        raise Mismatch(Mismatch.NOT_ONE_OF, path, kind, value)
    if _is_typed_dict(kind) or rules.is_record(kind):
        return _record(kind, value, rules, path)
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(value, list):
            raise Mismatch(Mismatch.WRONG_TYPE, path, kind, value)
        item = get_args(kind)[0]
        items = [convert(item, entry, rules, path + (i,)) for i, entry in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin in (dict, collections.abc.Mapping):
        key_kind, item = get_args(kind)
        if not isinstance(value, dict):
            raise Mismatch(Mismatch.WRONG_TYPE, path, kind, value)
        return rules.mapping({convert(key_kind, key, rules, path + (key,)): convert(item, entry, rules, path + (key,))
                              for key, entry in value.items()})
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise Mismatch(Mismatch.NOT_ONE_OF, path, kind, value) from None
    # One kind of number: a float may be given as an integer; a bool is no number.
    accepted = (int, float) if kind is float else (kind,)
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        raise Mismatch(Mismatch.WRONG_TYPE, path, kind, value)
    return _finite(value, kind, path) if kind is float and rules.finite_floats else rules.number(value)


def _one_of_union(kind: Any, value: Any, rules: Rules, path: Tuple[Any, ...]) -> Any:
    options = get_args(kind)
    if value is None and _NONE in options:
        return None
    refusals = []
    for option in options:
        if option is _NONE:
            continue
        try:
            return convert(option, value, rules, path)
        except Mismatch as refused:
            refusals.append(refused)
    if len(refusals) == 1 and refusals[0].path != path:
        raise refusals[0]  # the value is of the option's type; something inside it is not
    raise Mismatch(Mismatch.WRONG_TYPE, path, kind, value, inner=refusals[0] if len(refusals) == 1 else None)


def _finite(value: Any, kind: Any, path: Tuple[Any, ...]) -> float:
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        raise Mismatch(Mismatch.NOT_FINITE, path, kind, value) from None
    if not math.isfinite(number):
        raise Mismatch(Mismatch.NOT_FINITE, path, kind, number)
    return number


def check_keys(keys: Keys, obj: Mapping[str, Any], kind: Any, path: Tuple[Any, ...] = ()) -> None:
    """Mismatch unless `obj` gives only declared keys and every one it may not leave out.
    UNKNOWN's keys are in `obj`'s order, MISSING's in the declaration's."""
    unknown = tuple(key for key in obj if key not in keys.types)
    if unknown:
        raise Mismatch(Mismatch.UNKNOWN, path, kind, obj, keys=unknown)
    missing = tuple(key for key in keys.types if key not in obj and key not in keys.optional)
    if missing:
        raise Mismatch(Mismatch.MISSING, path, kind, obj, keys=missing)


def _record(kind: Any, value: Any, rules: Rules, path: Tuple[Any, ...]) -> Any:
    if value is None and rules.none_is_empty:
        value = {}
    if not isinstance(value, dict):
        raise Mismatch(Mismatch.WRONG_TYPE, path, kind, value)
    plain = _is_typed_dict(kind)
    keys = Keys(kind.__annotations__, () if kind.__total__ else kind.__annotations__) if plain else rules.keys(kind)
    check_keys(keys, value, kind, path)
    values = {key: convert(keys.types[key], value[key], rules, path + (key,)) for key in keys.types if key in value}
    return values if plain else rules.build(kind, values, path)


def _is_typed_dict(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, dict) and hasattr(kind, "__total__")


# -- the contract's JSON -------------------------------------------------------------------

def _dump(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_dump(item) for item in value]
    if isinstance(value, dict):
        return {key: _dump(item) for key, item in value.items()}
    return value


class _JsonRules(Rules):
    def is_record(self, kind: Any) -> bool:
        return isinstance(kind, type) and issubclass(kind, Message)

    def keys(self, cls: Any) -> Keys:
        fields = dataclasses.fields(cls)
        return Keys({field.name: field.type for field in fields},
                    (field.name for field in fields if field.metadata.get(_MAY_LACK)))


_JSON = _JsonRules()


def read(cls: Type[M], obj: Any, what: str) -> M:
    """`obj` read strictly as `cls`; `what` names it in a ProtocolError."""
    try:
        return convert(cls, obj, _JSON)
    except Mismatch as refused:
        raise ProtocolError("%s: %s" % (what, _json_problem(refused))) from None


def _json_problem(refused: Mismatch) -> str:
    path = dotted(refused.path)
    where = path + ": " if path else ""
    if refused.inner is not None:
        refused = refused.inner
    kind, value = refused.kind, refused.value
    if refused.reason in (Mismatch.UNKNOWN, Mismatch.MISSING):
        keys = sorted(refused.keys) if refused.reason == Mismatch.UNKNOWN else refused.keys
        word = "unknown" if refused.reason == Mismatch.UNKNOWN else "missing"
        return "%s%s key%s %s" % (where, word, "s" * (len(keys) > 1), ", ".join(map(repr, keys)))
    if refused.reason == Mismatch.NOT_ONE_OF:
        return "%s%s is not one of %s" % (where, shown(value), ", ".join(member.value for member in kind))
    origin = get_origin(kind)
    if origin in (tuple, list):
        return "%sexpected a list, got %s" % (where, shown(value))
    if origin is dict or isinstance(kind, type) and issubclass(kind, Message):
        return "%sexpected a JSON object, got %s" % (where, shown(value))
    return "%sexpected %s, got %s" % (where, kind.__name__, shown(value))


def dotted(path: Tuple[Any, ...], start: str = "") -> str:
    """`path` as the readers name a key: runs[0].step, hosts.box.env.A."""
    text = start
    for step in path:
        text = "%s[%d]" % (text, step) if isinstance(step, int) else ("%s.%s" % (text, step) if text else str(step))
    return text


def shown(value: Any) -> str:
    text = repr(value)
    return "%s %s" % (type(value).__name__, text if len(text) <= 60 else text[:57] + "...")
