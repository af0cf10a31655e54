"""Every source the CLI runs on a host with `python -c` runs on an unprepared host: deploy's
receiver, setup's script, `hosts --check`'s probe, launch's host check loader and the
agent's bootstrap, each as sent (the probes and the bootstrap after the prelude that
prefers setup's environment). The agent modules the loader serves are held to the same
rules with the rest of the agent."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dflash_cli import agent_client, host_check, host_scripts
from dflash_cli.commands import hosts
from dflash_cli.inventory import Host
from support.old_python import old_python_problems

CLI = Path(agent_client.__file__).resolve().parent
HOST = Host(transport="local", workspace="~/dflash")  # no `python:`: the prelude is sent too
SENT = {
    "deploy_receiver.py": host_scripts.source("deploy_receiver.py"),
    "host_setup.py": host_scripts.source("host_setup.py"),
    "hosts --check probe": agent_client.python_argv(HOST, hosts._PROBE, HOST.workspace)[2],
    "launch host check loader": agent_client.python_argv(HOST, host_check._LOADER, HOST.workspace)[2],
    "agent bootstrap": agent_client.python_argv(HOST, agent_client._BOOTSTRAP, HOST.workspace)[2],
}

# The packages whose modules the loaders serve.
PACKAGES = ("dflash_agent", "dflash_contract", "dflash_files")
# What a sent source may import besides the standard library: the loader's, the modules it serves.
SERVED = {"launch host check loader": frozenset({"dflash_agent"}), "hosts --check probe": frozenset({"dflash_agent"})}


def _python_c_argvs() -> set[tuple[str, str]]:
    """(module, function) of every argv literal in dflash_cli that holds "-c", and
    (module, source argument) of every python_argv and run_probe call."""
    found = set()
    for path in sorted(CLI.rglob("*.py")):
        module = path.relative_to(CLI).as_posix()
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.List) and any(isinstance(e, ast.Constant) and e.value == "-c"
                                                      for e in node.elts):
                    found.add((module, function.name))
                called = getattr(node, "func", None)
                name = getattr(called, "id", getattr(called, "attr", None)) if isinstance(node, ast.Call) else None
                # run_probe passes its caller's source on to python_argv: its callers name the source
                if name == "python_argv" and function.name != "run_probe":
                    found.add((module, ast.unparse(node.args[1])))
                elif name == "run_probe":
                    found.add((module, ast.unparse(node.args[2])))
    return found


# Argvs with "-c" that run a shell, not Python: the in-process client's ProxyCommand (`$SHELL -c`).
SHELL_C = {("transports/ssh.py", "_proxy_command")}


def test_the_guard_knows_every_source_sent_with_python_c():
    # A new `-c` in the CLI fails here until its source is added to SENT (or, a shell's, to SHELL_C).
    assert _python_c_argvs() - SHELL_C == {
        ("agent_client.py", "python_argv"), ("agent_client.py", "_BOOTSTRAP"), ("commands/hosts.py", "_PROBE"),
        ("host_check.py", "_LOADER"), ("deployment.py", "_receiver_argv"), ("commands/setup.py", "setup_host")}
    assert SHELL_C <= _python_c_argvs()  # each still there: a stale entry would hide a new one of its name


@pytest.mark.parametrize("name", sorted(SENT))
def test_sent_source_runs_on_python38_with_the_stdlib_only(name):
    assert old_python_problems(SENT[name], name, SERVED.get(name, frozenset())) == []


@pytest.mark.parametrize("modules, entry", [(host_check._MODULES, "dflash_agent.host_check"),
                                            (host_check.PROBE_MODULES, "dflash_agent.gpus")])
def test_the_host_check_loader_serves_every_module_its_modules_import(modules, entry):
    sources = json.loads(host_check.sources(modules))
    assert entry in sources
    for module, (source, is_package) in sources.items():
        name = f"{module} (served)"
        assert old_python_problems(source, name, frozenset(PACKAGES), True) == []
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: a sibling (or the package)
                target = ".".join([package, *([node.module] if node.module else [])])
                found = [target] if node.module else [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
                found = [n for n in names if n.split(".")[0] in PACKAGES]
            else:
                continue
            missing = [n for n in found if n not in sources and f"{n}" != package]
            assert not missing, f"{module} imports {missing}, which the loader does not serve"


@pytest.mark.parametrize("addition, problem", [
    ("import yaml\n", "imports yaml"),
    ("import tomllib\n", "imports tomllib"),
    ("from .jsonio import dump\n", "relative import"),
    ("match sys.argv:\n    case _:\n        pass\n", "not Python 3.8 syntax"),
    ("with (open('a') as a, open('b') as b):\n    pass\n", "not Python 3.8 syntax"),
    ("def newer(x: list[int]) -> int | None:\n    pass\n", "fails when Python 3.8 evaluates it"),
])
def test_the_guard_finds_what_fails_on_an_unprepared_host(addition, problem):
    for name, source in SENT.items():
        problems = old_python_problems(source + "\n" + addition, name, SERVED.get(name, frozenset()))
        assert len(problems) >= 1 and all(problem in p and name in p for p in problems), problems
