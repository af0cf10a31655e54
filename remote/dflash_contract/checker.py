"""The one strict reader of the contract's JSON: every reply, follow message and record
is a frozen dataclass whose fields are the keys of its JSON object, in the order they are
written. `to_json()` is the object written; `from_json()` reads one strictly: a missing
or unknown key, or a value of another type, is a ProtocolError naming the type and the
key, so that a CLI and an agent of different releases (or a record another release
wrote) fail clearly instead of misreading each other. A field made with `optional()` is
a key left out rather than written as null.
"""
import dataclasses
import enum
from typing import Any, Dict, Type, TypeVar, Union, get_args, get_origin


class ProtocolError(ValueError):
    """A JSON object that is not the type it was read as."""


_MAY_LACK = "dflash: a key that may be missing"
_OMITTED = "dflash: left out when None"
M = TypeVar("M", bound="Message")


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


# -- reading and writing -------------------------------------------------------------------

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


def read(cls: Type[M], obj: Any, what: str, path: str = "") -> M:
    """`obj` read strictly as `cls`; `what` and `path` name it in a ProtocolError."""
    if not isinstance(obj, dict):
        raise _problem(what, path, "expected a JSON object, got %s" % shown(obj))
    fields = dataclasses.fields(cls)
    unknown = sorted(set(obj) - {field.name for field in fields})
    if unknown:
        raise _problem(what, path, "unknown key%s %s" % ("s" * (len(unknown) > 1), ", ".join(map(repr, unknown))))
    missing = [field.name for field in fields if field.name not in obj and not field.metadata.get(_MAY_LACK)]
    if missing:
        raise _problem(what, path, "missing key%s %s" % ("s" * (len(missing) > 1), ", ".join(map(repr, missing))))
    return cls(**{field.name: _value(field.type, obj[field.name], what, _key(path, field.name))
                  for field in fields if field.name in obj})


_NONE = type(None)


def _value(kind: Any, value: Any, what: str, path: str) -> Any:
    origin = get_origin(kind)
    if kind is Any:
        return value
    if origin is Union:
        options = [option for option in get_args(kind) if option is not _NONE]
        if value is None and len(options) < len(get_args(kind)):
            return None
        (only,) = options  # the protocol's unions are Optional[X]
        return _value(only, value, what, path)
    if origin is tuple:
        item = get_args(kind)[0]
        if not isinstance(value, list):
            raise _problem(what, path, "expected a list, got %s" % shown(value))
        return tuple(_value(item, entry, what, "%s[%d]" % (path, i)) for i, entry in enumerate(value))
    if origin is dict:
        item = get_args(kind)[1]
        if not isinstance(value, dict):
            raise _problem(what, path, "expected a JSON object, got %s" % shown(value))
        return {key: _value(item, entry, what, _key(path, key)) for key, entry in value.items()}
    if isinstance(kind, type) and issubclass(kind, Message):
        return read(kind, value, what, path)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise _problem(what, path, "%s is not one of %s" % (shown(value), ", ".join(m.value for m in kind)))
    # JSON has one kind of number: a float field may hold an integer; bool is no number.
    accepted = (int, float) if kind is float else (kind,)
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        raise _problem(what, path, "expected %s, got %s" % (kind.__name__, shown(value)))
    return value


def _key(path: str, key: str) -> str:
    return "%s.%s" % (path, key) if path else key


def shown(value: Any) -> str:
    text = repr(value)
    return "%s %s" % (type(value).__name__, text if len(text) <= 60 else text[:57] + "...")


def _problem(what: str, path: str, problem: str) -> ProtocolError:
    return ProtocolError("%s: %s%s" % (what, path + ": " if path else "", problem))
