"""One strict loader: YAML mappings -> frozen dataclasses.

Shared by the CLI (host inventory) and the trainer (training configs), and shipped
in every release, so it depends on the standard library plus PyYAML only.

Rules: unknown keys, missing required keys and wrong types are errors; each error
names the file, the path of keys that led to it ("hosts.ct200.container") and what
was expected. Nothing is coerced except int -> float. A float is finite: YAML's `.inf`,
`-.inf` and `.nan` (and numbers too large for a float) are refused for every float field,
since no setting of this project means anything when infinite or NaN.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

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

    return StrictLoader


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


def load_file(cls: type[T], path: str | Path) -> T:
    return load(cls, read_yaml(path), str(path))


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
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


def _convert(tp: Any, value: Any, source: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, source, where)
            except SchemaError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise SchemaError(source, where, f"expected {_describe(tp)}, got {_type_name(value)}")
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise SchemaError(source, where, f"expected one of {_describe(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, source, where)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise SchemaError(source, where, f"expected {_describe(tp)}, got {_type_name(value)}")
        item_tp = typing.get_args(tp)[0]
        items = [_convert(item_tp, v, source, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, collections.abc.Mapping):
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise SchemaError(source, where, f"expected {_describe(tp)}, got {_type_name(value)}")
        out = {}
        for k, v in value.items():
            out[_convert(key_tp, k, source, _join(where, k))] = _convert(val_tp, v, source, _join(where, k))
        return types.MappingProxyType(out)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite_float(value, source, where)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise SchemaError(source, where, f"expected {_describe(tp)}, got {_type_name(value)} {value!r}")


def _finite_float(value: int | float, source: str, where: str) -> float:
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        raise SchemaError(source, where, f"expected a finite number, got {value!r} (too large)") from None
    if not math.isfinite(number):
        yaml_spelling = ".nan" if math.isnan(number) else (".inf" if number > 0 else "-.inf")
        raise SchemaError(source, where, f"expected a finite number, got {yaml_spelling}")
    return number


def _convert_dataclass(cls: Any, value: Any, source: str, where: str) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise SchemaError(source, where, f"expected a mapping, got {_type_name(value)}")
    hints = typing.get_type_hints(cls)
    # Fields marked metadata={"internal": True} are filled in by code, never from YAML.
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")}
    unknown = [k for k in value if k not in fields]
    if unknown:
        known = ", ".join(sorted(fields))
        raise SchemaError(source, _join(where, unknown[0]), f"unknown key (known keys: {known})")
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], source, _join(where, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(source, _join(where, name), "missing required key")
    try:
        return cls(**kwargs)
    except SchemaError:
        raise
    except (ValueError, TypeError) as exc:  # __post_init__ cross-field checks
        raise SchemaError(source, where, str(exc)) from exc
