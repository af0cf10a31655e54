"""How much of the contract between the halves is still spelled outside dflash_contract:

- run-state tables: tuple, list, set or dict literals naming two or more RunState members
  (the RunState enum itself counts as one);
- record reads by string key: `x["key"]` and `x.get("key")` in the CLI, the API and the
  agent whose key is one of run.json's, exit.json's, an errors.jsonl record's or the abort
  record's (an over-count: another dict with such a key counts too);
- CLI imports of the agent: bench/import_graph.py's cli->agent imports;
- imports inside function bodies in dflash_cli (lazy imports: each one a module a verb
  defers, or a circle hidden).

    python3 bench/contract_measures.py [REPO_ROOT]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

RECORD_KEYS = frozenset("""
    run_id name release_id release_dir workspace config config_source overrides argv cwd env_keys pid pgid
    start_time boot_id host started_at started_by warm_reason stall_after startup_stall_after resources supervisor
    source restart distributed attempt attempts exit_code signal oom_killed ended_at exec_error error ts thread
    thread_ident phase step exc_type message traceback frames detail memory raw peer_rank peer_exc_type
    peer_message silence_s parts device rank kind git_commit dirty modified modified_count git_problem path hosts
""".split())


def python_files(root: Path, tops: tuple[str, ...]) -> list[Path]:
    return [path for top in tops for path in sorted((root / top).rglob("*.py"))]


def state_tables(root: Path) -> list[str]:
    found = []
    for path in python_files(root, ("dflash_cli", "dflash_trainer", "remote")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "RunState":
                found.append(f"{path.relative_to(root)}:{node.lineno} (the enum)")
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                named = [item for item in items if isinstance(item, ast.Attribute)
                         and isinstance(item.value, ast.Name) and item.value.id == "RunState"]
                if len(named) >= 2:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def _key(node: ast.AST) -> str | None:
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        index = node.slice
        return index.value if isinstance(index, ast.Constant) and isinstance(index.value, str) else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            and not (isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "environ")):
        return node.args[0].value
    return None


def record_reads(root: Path) -> list[str]:
    found = []
    for path in python_files(root, ("dflash_cli", "dflash_trainer", "remote/dflash_agent")):
        for node in ast.walk(ast.parse(path.read_text())):
            if _key(node) in RECORD_KEYS:
                found.append(f"{path.relative_to(root)}:{node.lineno} {_key(node)}")
    return found


def cli_agent_imports(root: Path) -> list[str]:
    found = []
    for path in python_files(root, ("dflash_cli", "dflash_trainer")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] == "dflash_agent"]
    return found


def imports_in_functions(root: Path) -> list[str]:
    found = []
    for path in python_files(root, ("dflash_cli",)):
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(root)}:{node.lineno}" for node in ast.walk(function)
                          if isinstance(node, (ast.Import, ast.ImportFrom))]
    return sorted(set(found))


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for title, rows in (("run-state tables", state_tables(root)), ("record reads by string key", record_reads(root)),
                        ("CLI imports of the agent", cli_agent_imports(root)),
                        ("imports inside functions in dflash_cli", imports_in_functions(root))):
        print(f"{title}: {len(rows)}")
        if title in ("run-state tables", "CLI imports of the agent"):
            for row in rows:
                print(f"   {row}")


if __name__ == "__main__":
    main()
