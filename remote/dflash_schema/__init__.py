"""One strict loader: YAML mappings -> frozen dataclasses.

Shared by the CLI (host inventory) and the trainer (training configs), and shipped
in every release, so it depends on the standard library, PyYAML and the contract's
checker (dflash_contract.checker, which judges every value; this module phrases it).

Rules: unknown keys, missing required keys and wrong types are errors; each error
names the file, the path of keys that led to it ("hosts.ct200.container") and what
was expected. Nothing is coerced except int -> float. A float is finite: YAML's `.inf`,
`-.inf` and `.nan` (and numbers too large for a float) are refused for every float field,
since no setting of this project means anything when infinite or NaN. Numbers in exponent
form without a dot (`1e-4`) are floats, as in YAML 1.2 (PyYAML's YAML 1.1 reads them as
strings).

Overrides (`--set optim.lr=1e-4`) are merged into the parsed mapping before it is
checked, so they meet the same rules; an error they cause names the `--set`. `dump` is
the inverse of `load`: a dataclass back to plain data that loads to an equal object.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from dflash_contract.checker import UNIONS, Keys, Mismatch, Rules, convert, dotted

T = TypeVar("T")


class SchemaError(ValueError):
    """Bad configuration input: `source` is the file, `where` the dotted key path."""

    def __init__(self, source: str, where: str, problem: str):
        self.source, self.where, self.problem = source, where, problem
        location = f"{source}: {where}" if where else source
        super().__init__(f"{location}: {problem}")


class DuplicateKey(Exception):
    """A mapping gives one key twice; lines count from 1."""

    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"line {line}: key {key!r} given twice (first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


# YAML 1.2's float (core schema) where YAML 1.1 wants a dot: 1e-4, 5E+3. Tried after
# PyYAML's own resolvers, so ints and YAML 1.1 floats resolve as before.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _with_exponent_floats(cls: type) -> type:
    cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
    return cls


@functools.lru_cache(maxsize=None)
def _strict_dumper() -> type:
    """PyYAML's SafeDumper resolving scalars as the loader does, so a string such as
    '1e-4' is written quoted and reads back as the string it was."""
    import yaml

    return _with_exponent_floats(type("StrictDumper", (yaml.SafeDumper,), {}))


@functools.lru_cache(maxsize=None)
def _strict_loader() -> type:
    """PyYAML's SafeLoader, refusing a key given twice in one mapping at any depth
    (SafeLoader keeps the last one, so a second `ct200:` would replace the first
    without a word). Built on first use: yaml is imported only when a file is read."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                first_lines: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *base` keys may be overridden: that is what merging is for
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        if key in first_lines:
                            raise DuplicateKey(key, line, first_lines[key])
                        first_lines[key] = line
                    except TypeError:
                        continue  # an unhashable key: SafeLoader's own error names it
            return super().construct_mapping(node, deep=deep)

    return _with_exponent_floats(StrictLoader)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file, turning I/O and syntax errors and keys given twice into SchemaError."""
    import yaml  # imported here so modules that only define schemas stay import-light

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(str(path), "", f"cannot read file ({exc.strerror or exc})") from exc
    try:
        return yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except DuplicateKey as exc:
        raise SchemaError(str(path), "", str(exc)) from exc
    except yaml.YAMLError as exc:
        raise SchemaError(str(path), "", f"invalid YAML: {exc}") from exc


def load(cls: type[T], data: Any, source: str, where: str = "") -> T:
    """Build dataclass `cls` from `data` (a mapping), checking every key and type."""
    return _convert(cls, data, source, where)


def load_file(cls: type[T], path: str | Path, overrides: tuple[Override, ...] = ()) -> T:
    """`cls` from the YAML file at `path` with `overrides` merged in first. An error an
    override caused names it instead of the file: `--set optim.lrr=1: optim.lrr: unknown key`."""
    data = read_yaml(path)
    if not overrides:
        return load(cls, data, str(path))
    merged = apply_overrides(data, overrides, str(path))
    try:
        return load(cls, merged, str(path))
    except SchemaError as exc:
        raise _blame(exc, overrides, lambda: load(cls, data, str(path))) from None


@dataclasses.dataclass(frozen=True)
class Override:
    """One `--set KEY=VALUE`: `keys` the dotted KEY split, `value` VALUE read as YAML."""

    text: str  # KEY=VALUE as given
    keys: tuple[str, ...]
    value: Any

    @property
    def key(self) -> str:
        return ".".join(self.keys)

    @property
    def label(self) -> str:
        return f"--set {self.text}"


def parse_override(text: str) -> Override:
    """`KEY=VALUE` -> Override. VALUE is one YAML value, read as the file loader reads one:
    1e-4 a number, true a boolean, [a, b] a list, {k: v} a mapping, nothing at all null;
    quote a string that would read as something else ('off', '1e-4')."""
    import yaml

    key, equals, value_text = text.partition("=")
    keys = tuple(key.split("."))
    if not equals or not all(part and not any(c.isspace() for c in part) for part in keys):
        raise SchemaError(f"--set {text}", "", "expected KEY=VALUE, KEY a dotted path of config keys "
                                               "such as optim.lr")
    try:
        value = yaml.load(value_text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except (DuplicateKey, yaml.YAMLError) as exc:
        raise SchemaError(f"--set {text}", key, f"invalid YAML value: {exc}") from None
    return Override(text, keys, value)


def apply_overrides(data: Any, overrides: tuple[Override, ...], source: str) -> dict[str, Any]:
    """A copy of `data` (the file's mapping) with each override's value put at its key, in
    order. A missing or null mapping on the way is created; a key given by two overrides,
    or one leading through a value that is not a mapping, is an error naming the override."""
    if data is not None and not isinstance(data, dict):
        raise SchemaError(source, "", f"expected a mapping, got {_type_name(data)}")
    merged: dict[str, Any] = _unshared(data or {})
    given: dict[str, Override] = {}
    for override in overrides:
        if override.key in given:
            raise SchemaError(override.label, override.key, f"set twice (also by {given[override.key].label})")
        given[override.key] = override
        node = merged
        for depth, key in enumerate(override.keys[:-1]):
            if node.get(key) is None:
                node[key] = {}
            elif not isinstance(node[key], dict):
                through = ".".join(override.keys[:depth + 1])
                raise SchemaError(override.label, through, f"is {_type_name(node[key])} ({node[key]!r}), not a "
                                                           f"mapping, so it has no key {override.keys[depth + 1]!r}")
            node = node[key]
        node[override.keys[-1]] = override.value
    return merged


def _unshared(data: Any) -> Any:
    """A copy sharing no mapping or list: YAML aliases (`*base`) make several keys hold one
    object, and an override of one of them must not change the others."""
    if isinstance(data, dict):
        return {k: _unshared(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_unshared(v) for v in data]
    return data


def _within(path: str, prefix: str) -> bool:
    """Whether the key path `path` is `prefix` or under it (`optim.lr` under `optim`)."""
    return not prefix or path == prefix or path.startswith((f"{prefix}.", f"{prefix}["))


def _blame(exc: SchemaError, overrides: tuple[Override, ...], load_file_alone: Callable[[], Any]) -> SchemaError:
    """`exc` (raised with the overrides merged) said by whoever caused it. An error at or
    under an override's key is the override's. An error of a mapping an override changed
    (a section's cross-field check) is the file's when the file alone gives it too, else
    the overrides' under that mapping. Anything else is the file's."""
    at = [o for o in overrides if _within(exc.where, o.key)]
    if at:
        return SchemaError(max(at, key=lambda o: len(o.keys)).label, exc.where, exc.problem)
    inside = [o for o in overrides if _within(o.key, exc.where)]
    if inside:
        try:
            load_file_alone()
        except SchemaError as alone:
            if (alone.where, alone.problem) == (exc.where, exc.problem):
                return exc
        return SchemaError(", ".join(o.label for o in inside), exc.where, exc.problem)
    return exc


def dump(value: Any) -> Any:
    """Plain data (mappings, lists, scalars) that `load` turns back into an equal `value`:
    every field, defaults included, in declaration order; internal fields left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.init and not f.metadata.get("internal")}
    if isinstance(value, (tuple, list)):
        return [dump(v) for v in value]
    if isinstance(value, collections.abc.Mapping):
        return {k: dump(v) for k, v in value.items()}
    return value


def dump_yaml(data: Any) -> str:
    """YAML text of plain data that `read_yaml` reads back the same, keys in their order."""
    import yaml

    return yaml.dump(data, Dumper=_strict_dumper(), sort_keys=False, allow_unicode=True,
                     default_flow_style=False)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in UNIONS:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin in (dict, collections.abc.Mapping):
        return f"a mapping of {_describe(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


class _YamlRules(Rules):
    """A config's dataclass: its fields given in YAML, those with a default may be left out,
    fields marked metadata={"internal": True} are filled in by code, never from YAML; its
    __post_init__ cross-field checks are the config's errors too. A section given as null
    is one given no keys; a float is finite."""

    finite_floats = True
    none_is_empty = True

    def keys(self, cls: Any) -> Keys:
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]
        return Keys({f.name: hints[f.name] for f in fields},
                    (f.name for f in fields if f.default is not dataclasses.MISSING
                     or f.default_factory is not dataclasses.MISSING))

    def build(self, cls: Any, values: dict[str, Any], path: tuple[Any, ...]) -> Any:
        try:
            return cls(**values)
        except SchemaError:
            raise
        except (ValueError, TypeError) as exc:
            raise Mismatch(Mismatch.INVALID, path, cls, values, problem=str(exc)) from exc

    def mapping(self, items: dict[Any, Any]) -> Any:
        return types.MappingProxyType(items)


_YAML = _YamlRules()


def _convert(tp: Any, value: Any, source: str, where: str) -> Any:
    try:
        return convert(tp, value, _YAML)
    except Mismatch as refused:
        raise _schema_error(refused, source, where) from refused.__cause__


def _schema_error(refused: Mismatch, source: str, where: str) -> SchemaError:
    at = dotted(refused.path, where)
    if refused.inner is not None:  # an Optional's one option: said as that option's refusal
        refused = refused.inner
    kind, value = refused.kind, refused.value
    if refused.reason == Mismatch.UNKNOWN:
        known = ", ".join(sorted(_YAML.keys(kind).types))
        return SchemaError(source, _join(at, refused.keys[0]), f"unknown key (known keys: {known})")
    if refused.reason == Mismatch.MISSING:
        return SchemaError(source, _join(at, refused.keys[0]), "missing required key")
    if refused.reason == Mismatch.INVALID:
        return SchemaError(source, at, refused.problem)
    if refused.reason == Mismatch.NOT_FINITE:
        if not isinstance(value, float):
            return SchemaError(source, at, f"expected a finite number, got {value!r} (too large)")
        yaml_spelling = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
        return SchemaError(source, at, f"expected a finite number, got {yaml_spelling}")
    if refused.reason == Mismatch.NOT_ONE_OF:
        return SchemaError(source, at, f"expected one of {_describe(kind)}, got {value!r}")
    if typing.get_origin(kind) in UNIONS or dataclasses.is_dataclass(kind) or typing.get_origin(kind) in (
            tuple, list, dict, collections.abc.Mapping):
        return SchemaError(source, at, f"expected {_describe(kind)}, got {_type_name(value)}")
    return SchemaError(source, at, f"expected {_describe(kind)}, got {_type_name(value)} {value!r}")
