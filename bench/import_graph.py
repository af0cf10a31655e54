"""The import graph of the tree: its cycles, the trainer's upward arrows between its rooms,
circles between rooms, CLI command-to-command imports, trainer-to-agent and CLI-to-agent
imports (both take the contract from dflash_contract instead) and the largest modules (what issue reviews of the rooms compare). Every import counts, one inside
a function (lazy) too, marked so where listed.

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


# The trainer's rooms, lowest first: a module imports from its own room and the rooms
# below it (docs/trainer.md, "Where the code is"). A room is its modules' dotted names
# and everything under them.
TRAINER_ROOMS = (
    ("config", ("dflash_train.config",)),
    ("memory", ("dflash_train.memory",)),
    ("base", ("dflash_train.runlog", "dflash_train.startup_phases", "dflash_train.threads", "dflash_train.devices",
              "dflash_train.faults")),
    ("model", ("dflash_train.model",)),
    ("data", ("dflash_train.data",)),
    ("compiling", ("dflash_train.compiling",)),
    ("checkpoint", ("dflash_train.checkpoint",)),
    ("training", ("dflash_train.training",)),
    ("jobs", ("dflash_train.jobs",)),
    ("entry points", ("dflash_train.__main__", "dflash_train.peer_notice", "dflash_train.resume_check",
                      "dflash_train.warm")),
)
PACKAGES = ("dflash_cli", "dflash_train")  # whose rooms' circles are counted


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """The known modules `name` imports, relative imports resolved (`from . import x` counts
    x), each with whether every import of it is inside a function (lazy)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: dict[str, bool] = {}

    def add(target: str, lazy: bool) -> None:
        if target in known and target != name:
            found[target] = found.get(target, True) and lazy

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, lazy)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            add(prefix, lazy)
            for alias in node.names:
                add(f"{prefix}.{alias.name}", lazy)
        inside = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def trainer_room(name: str) -> int | None:
    """The index of the trainer room `name` is in (TRAINER_ROOMS), None outside the trainer's rooms."""
    for index, (_, members) in enumerate(TRAINER_ROOMS):
        if any(name == m or name.startswith(m + ".") for m in members):
            return index
    return None


def room_of(name: str) -> str | None:
    """The room a module of PACKAGES is in: a trainer room, or for the CLI its subpackage
    or, at the top, the module itself. None for the packages themselves and others."""
    index = trainer_room(name)
    if index is not None:
        return f"dflash_train:{TRAINER_ROOMS[index][0]}"
    parts = name.split(".")
    if parts[0] in PACKAGES and len(parts) > 1:
        return ".".join(parts[:2])
    return None


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
    imported = {name: imports(name, path, known) for name, path in known.items()}
    edges = {name: set(targets) for name, targets in imported.items()}
    pairs = sorted((a, b) for a, targets in edges.items() for b in targets)
    verbs = [(a, b) for a, b in pairs if a.startswith("dflash_cli.commands.") and b.startswith("dflash_cli.commands.")]
    trainer_agent = [(a, b) for a, b in pairs if a.startswith("dflash_train") and b.startswith("dflash_agent")]
    cli_agent = [(a, b) for a, b in pairs
                 if a.startswith(("dflash_cli", "dflash_trainer")) and b.startswith("dflash_agent")]
    upward = [(a, b) for a, b in pairs
              if trainer_room(a) is not None and trainer_room(b) is not None and trainer_room(a) < trainer_room(b)]
    rooms: dict[str, set[str]] = {}
    crossings: dict[tuple[str, str], list[str]] = {}
    for a, b in pairs:
        ra, rb = room_of(a), room_of(b)
        if ra is not None and rb is not None:
            rooms.setdefault(ra, set())
            rooms.setdefault(rb, set())
            if ra != rb:
                rooms[ra].add(rb)
                crossings.setdefault((ra, rb), []).append(_arrow(a, b, imported))
    found = cycles(edges)
    room_circles = cycles(rooms)
    print(f"modules: {len(known)}")
    print(f"cycles: {len(found)}")
    for component in found:
        print("   " + " <-> ".join(component))
        for a, b in pairs:
            if a in component and b in component:
                print(f"      {_arrow(a, b, imported)}")
    print("trainer rooms, lowest first: " + " < ".join(room for room, _ in TRAINER_ROOMS))
    print(f"upward arrows between trainer rooms: {len(upward)}")
    for a, b in upward:
        print(f"   {_arrow(a, b, imported)}")
    print(f"circles between rooms: {len(room_circles)}")
    for component in room_circles:
        print("   " + " <-> ".join(component))
        for ra in component:
            for rb in component:
                for arrow in crossings.get((ra, rb), []):
                    print(f"      {arrow}")
    for title, rows in (("command->command imports", verbs), ("trainer->agent imports", trainer_agent),
                        ("cli->agent imports", cli_agent)):
        print(f"{title}: {len(rows)}")
        for a, b in rows:
            print(f"   {_arrow(a, b, imported)}")
    print("largest modules:")
    for lines, name in sorted(((len(p.read_text().splitlines()), n) for n, p in known.items()), reverse=True)[:10]:
        print(f"   {lines:5d} {name}")


def _arrow(a: str, b: str, imported: dict[str, dict[str, bool]]) -> str:
    return f"{a} -> {b}" + (" (lazy)" if imported[a][b] else "")


if __name__ == "__main__":
    main()
