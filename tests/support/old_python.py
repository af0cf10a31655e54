"""Whether a Python source runs on an unprepared host's interpreter: Python 3.8's grammar,
the standard library only (without the modules added after 3.8), and no annotation that
3.8 would evaluate and fail on (`list[int]`, `int | None` outside `from __future__ import
annotations`)."""
from __future__ import annotations

import ast
import sys

# Standard library modules added after Python 3.8: importing one fails there.
NEWER_THAN_38 = frozenset({"graphlib", "tomllib", "zoneinfo"})
_BUILTIN_GENERICS = frozenset({"dict", "frozenset", "list", "set", "tuple", "type"})


def old_python_problems(source: str, name: str, packages: frozenset[str] = frozenset(),
                        relative_imports: bool = False) -> list[str]:
    """What would fail under Python 3.8 on a host with no packages installed; `packages`
    are the top-level names the source may import besides the standard library (those
    deployed with it), `relative_imports` whether it is part of a package."""
    try:
        tree = ast.parse(source, filename=name, feature_version=(3, 8))
    except SyntaxError as exc:
        return [f"{name}:{exc.lineno}: not Python 3.8 syntax: {exc.msg}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module or ""]
        elif isinstance(node, ast.ImportFrom):
            modules = []
            if not relative_imports:
                problems.append(f"{name}:{node.lineno}: relative import (the source runs outside any package)")
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top in NEWER_THAN_38 or (top not in sys.stdlib_module_names and top not in packages):
                problems.append(f"{name}:{node.lineno}: imports {module}, not in Python 3.8's standard library")
    postponed = any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                    and any(alias.name == "annotations" for alias in node.names) for node in tree.body)
    if not postponed:
        problems += [f"{name}:{node.lineno}: annotation {ast.unparse(node)!r} fails when Python 3.8 evaluates it"
                     for annotation in _evaluated_annotations(tree) for node in ast.walk(annotation)
                     if _newer_annotation(node)]
    return problems


def _evaluated_annotations(tree: ast.Module) -> list[ast.expr]:
    """Annotations Python evaluates at run time: of functions' arguments and returns, and
    of names at module or class level (not of local variables)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            arguments += [arg for arg in (node.args.vararg, node.args.kwarg) if arg is not None]
            found += [arg.annotation for arg in arguments if arg.annotation is not None]
            found += [node.returns] if node.returns is not None else []
        elif isinstance(node, (ast.Module, ast.ClassDef)):
            found += [stmt.annotation for stmt in node.body if isinstance(stmt, ast.AnnAssign)]
    return found


def _newer_annotation(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
             and node.value.id in _BUILTIN_GENERICS)
            or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)))
