"""The import graph of the tree: its cycles, CLI command-to-command imports, trainer-to-agent
imports and the largest modules (what issue reviews of the rooms compare).

    python3 bench/import_graph.py [REPO_ROOT]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of dflash_cli and of each package under remote/."""
    found = {}
    bases = [(root, root / "dflash_cli")] + [(root / "remote", p) for p in sorted((root / "remote").iterdir())
                                             if (p / "__init__.py").exists()]
    for base, package in bases:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `name` imports, relative imports resolved (`from . import x` counts x)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets.add(prefix)
            targets.update(f"{prefix}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in known and t != name}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    known = modules(root)
    edges = {name: imports(name, path, known) for name, path in known.items()}
    pairs = sorted((a, b) for a, targets in edges.items() for b in targets)
    verbs = [(a, b) for a, b in pairs if a.startswith("dflash_cli.commands.") and b.startswith("dflash_cli.commands.")]
    trainer_agent = [(a, b) for a, b in pairs if a.startswith("dflash_train") and b.startswith("dflash_agent")]
    found = cycles(edges)
    print(f"modules: {len(known)}")
    print(f"cycles: {len(found)}")
    for component in found:
        print("   " + " <-> ".join(component))
    for title, rows in (("command->command imports", verbs), ("trainer->agent imports", trainer_agent)):
        print(f"{title}: {len(rows)}")
        for a, b in rows:
            print(f"   {a} -> {b}")
    print("largest modules:")
    for lines, name in sorted(((len(p.read_text().splitlines()), n) for n, p in known.items()), reverse=True)[:10]:
        print(f"   {lines:5d} {name}")


if __name__ == "__main__":
    main()
