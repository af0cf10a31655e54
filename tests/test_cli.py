"""The CLI's edges: --help, exit codes, stdout carrying data only, clear errors."""
from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

import click
import pytest

from support import workspace_on_node

from dflash_cli import cli
from dflash_cli.errors import ExitCode
from dflash_run import REPO, dflash_in_process

def _commands(group: click.Group, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    """Every command the group holds, by its words on the command line ("cache copy"),
    a group's own commands after it."""
    found = {}
    for name, command in group.commands.items():
        found[" ".join(path + (name,))] = command
        if isinstance(command, click.Group):
            found.update(_commands(command, path + (name,)))
    return found


COMMANDS = _commands(cli.main)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_of_every_command(command, tmp_path):
    broken = tmp_path / "hosts.yaml"
    broken.write_text("hosts: [not, a, mapping]\n")  # --help must not need a good inventory
    done = dflash_in_process(*command.split(), "--help", hosts=broken)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"Usage: python -m dflash_cli {command}")
    # the docstring's summary, then every option with its help
    summary = COMMANDS[command].help.split("\n\n")[0]
    assert " ".join(done.stdout.split("\n\n")[1].split()) == " ".join(summary.split())
    flat = " ".join(done.stdout.split())
    for option in COMMANDS[command].params:
        if isinstance(option, click.Option) and not option.hidden:
            assert option.opts[-1] in done.stdout, option.opts
            assert option.help and " ".join(option.help.split()[:4]) in flat, option.opts


def _imports(source: str, package: str) -> set[str]:
    """Every module name an import of `source` (a module of `package`) may bind."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0] if node.level else "",
                                            node.module]))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_a_verb_imports_the_core_never_another_verb():
    # What several verbs share lives in the core: a verb importing another's module ties
    # the two verbs' changes together.
    folder = Path(cli.__file__).parent / "commands"
    verbs = {f"dflash_cli.commands.{path.stem}" for path in folder.glob("*.py") if path.stem != "__init__"}
    assert len(verbs) > 10
    of_other_verbs = {path.stem: _imports(path.read_text(), "dflash_cli.commands") & verbs
                      for path in sorted(folder.glob("*.py"))}
    assert of_other_verbs == {name: set() for name in of_other_verbs}


def test_top_level_help_lists_every_command_and_exit_codes():
    done = dflash_in_process("--help")
    assert done.returncode == 0
    listed = re.findall(r"^  (\S+)", done.stdout.split("\nCommands:\n", 1)[1], re.MULTILINE)
    assert listed == sorted(cli.main.commands)
    text = " ".join(done.stdout.split())
    assert "130 interrupted" in text
    codes = text.split("Exit codes: ", 1)[1].split(". ", 1)[0]
    assert [int(code) for code in re.findall(r"(?:^|, )(\d+) ", codes)] == [int(code) for code in ExitCode]
    assert "5 the local disk (logs/) is full" in text


def test_bad_inventory_is_a_usage_error_naming_file_host_and_key(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  ct200: {transport: pct, ssh: root@n, container: 200, workspace: /w, contianer: 3}\n")
    done = dflash_in_process("hosts", hosts=hosts)
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"{hosts}: hosts.ct200.contianer: unknown key" in done.stderr


def test_hosts_lists_names_on_stdout_and_table_on_stderr(make_inventory, tmp_path):
    done = dflash_in_process("hosts", hosts=make_inventory(tmp_path))
    assert done.returncode == 0
    assert done.stdout.split() == ["ct200", "ct201", "ct999", "down", "local", "node"]
    assert "pct 200" in done.stderr


def test_hosts_check_reports_each_failure_and_exits_3(make_inventory, tmp_path):
    done = dflash_in_process("hosts", "--check", "--json", hosts=make_inventory(tmp_path))
    assert done.returncode == 3
    import json
    entries = {e["host"]: e for e in map(json.loads, done.stdout.splitlines())}
    assert entries["ct200"]["python"] and entries["node"]["hostname"]
    # the agent's own host facts, sent before anything is deployed
    assert entries["node"]["packages"] == {"torch": metadata.version("torch"),
                                           "transformers": metadata.version("transformers")}
    assert entries["node"]["gpus"] == [] and entries["node"]["current_release"] is None
    assert "not running" in entries["ct201"]["error"]
    assert "999" in entries["ct999"]["error"] and "does not exist" in entries["ct999"]["error"]
    assert "down" in entries and "error" in entries["down"]
    # which SSH client reached each host: the OpenSSH one wherever `ssh` is installed
    assert entries["node"]["ssh_client"] == entries["ct200"]["ssh_client"] == "openssh"
    assert "ssh_client" not in entries["local"]


def test_unknown_ssh_host_key_is_refused_unless_accepted(make_inventory, tmp_path):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    hosts = make_inventory(tmp_path, node={"known_hosts": str(empty)})
    done = dflash_in_process("deploy", "node", hosts=hosts)
    assert done.returncode == 3
    assert "accept-new-host-key" in done.stderr
    accepted = dflash_in_process("--accept-new-host-key", "deploy", "node", hosts=hosts)
    assert accepted.returncode == 0, accepted.stderr
    assert "127.0.0.1" in empty.read_text()


def test_launch_with_a_bad_training_config_sends_nothing(make_inventory, fake_pve, tmp_path):
    config = tmp_path / "bad.yaml"
    good = (REPO / "configs" / "train" / "tiny-cpu.yaml").read_text()
    config.write_text(good.replace("optim:\n", "optim:\n  lr: fast\n", 1).replace("  lr: 3.0e-3\n", ""))
    done = dflash_in_process("launch", "ct200", "--config", str(config), hosts=make_inventory(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"{config}: optim.lr: expected a number, got a string 'fast'" in done.stderr
    assert not workspace_on_node(fake_pve, tmp_path).exists()  # nothing deployed


@pytest.mark.parametrize("spelling", [".inf", "-.inf", ".nan"])
def test_launch_refuses_a_non_finite_float_before_deploying(spelling, tmp_path):
    config = tmp_path / "inf.yaml"
    good = (REPO / "configs" / "train" / "tiny-cpu.yaml").read_text()
    assert "  lr: 3.0e-3\n" in good
    config.write_text(good.replace("  lr: 3.0e-3\n", f"  lr: {spelling}\n"))
    home = tmp_path / "home"  # the built-in `local` host's workspace lives under ~
    done = dflash_in_process("launch", "local", "--config", str(config), cwd=tmp_path, env={"HOME": str(home)})
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert f"{config}: optim.lr: expected a finite number, got {spelling}" in done.stderr
    assert not home.exists()  # nothing deployed


@pytest.mark.parametrize("host, message", [("ct201", "not running"), ("ct999", "does not exist"),
                                           ("down", "down")])
def test_launch_on_unreachable_targets_exits_3(make_inventory, tmp_path, host, message):
    done = dflash_in_process("launch", host, "--config", "configs/train/tiny-cpu.yaml", hosts=make_inventory(tmp_path))
    assert done.returncode == 3, done.stderr
    assert message in done.stderr and done.stdout == ""


@pytest.mark.parametrize("verb", ["watch", "status", "stop", "fetch-traceback", "stacks", "pull", "resume", "plot"])
def test_a_verb_without_any_run_is_a_usage_error_whose_hint_names_that_verb(verb, tmp_path):
    done = dflash_in_process("--logs-dir", str(tmp_path / "logs"), verb)
    assert done.returncode == 2
    assert "no latest run" in done.stderr
    assert f"hint: name the run: dflash {verb} RUN --host HOST\n" in done.stderr


def test_gpu_line_is_compact_and_survives_missing_readings():
    from dflash_contract.replies import Gpu
    from dflash_cli.commands.watch import gpu_line

    line = gpu_line(tuple(map(Gpu.from_json, [
        {"index": 0, "name": "H200", "memory_used_mib": 40960.0, "memory_total_mib": 143771.0,
         "utilization_pct": 97.0, "temperature_c": 61.0, "power_w": 512.4},
        {"index": 1, "name": "H200", "memory_used_mib": None, "memory_total_mib": 143771.0,
         "utilization_pct": None, "temperature_c": None, "power_w": None},
    ])))
    assert line == "gpu0 40.0/140GiB 97% 61C 512W  gpu1 ?/140GiB ?% ?C ?W"


def test_runs_lists_local_when_the_latest_runs_host_left_the_inventory(make_inventory, tmp_path):
    from dflash_cli.local_state import RunRef, set_latest

    logs = tmp_path / "logs"
    set_latest(logs, RunRef("ct203", "gone-20260101-000000-0000"))  # launched when ct203 was in hosts.yaml
    done = dflash_in_process("--logs-dir", str(logs), "runs", hosts=make_inventory(tmp_path))
    assert "the latest run's host 'ct203' is not in " in done.stderr and "skipped" in done.stderr
    assert "unknown host" not in done.stderr
    # It goes on to local, which this test never deployed to: that is what it says next.
    assert done.returncode == 2 and "host local: no release deployed" in done.stderr, done.stderr


GONE = "gone-20260101-000000-0000"  # the latest run, launched when ct203 was in hosts.yaml


@pytest.mark.parametrize("args", [["watch"], ["status"], ["status", "--config"], ["stop"], ["pull"],
                                  ["fetch-traceback"], ["stacks"], ["resume"], ["diff", GONE, GONE],
                                  ["status", "older-1"]],
                         ids=lambda args: " ".join(args))
def test_a_verb_that_must_reach_the_recorded_runs_host_that_left_the_inventory_names_run_host_and_file(
        args, make_inventory, tmp_path):
    from dflash_cli.local_state import RunRef, set_latest

    logs = tmp_path / "logs"
    set_latest(logs, RunRef("ct203", GONE))
    (logs / "ct203" / "older-1").mkdir(parents=True)  # a run found by its id alone, on ct203 too
    hosts = make_inventory(tmp_path)
    done = dflash_in_process("--logs-dir", str(logs), *args, hosts=hosts)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    run = f"run older-1 ({logs / 'ct203' / 'older-1'})" if "older-1" in args else \
        f"the latest run {GONE} ({logs / 'latest.json'})"
    assert done.stderr.splitlines() == [
        f"dflash: error: {run} ran on ct203, which is not in {hosts}",
        f"hint: add ct203 back to {hosts}, or name a run on a host the inventory has "
        "(`dflash runs --host HOST` lists a host's runs)"]


def test_plot_draws_the_recorded_run_whose_host_left_the_inventory_and_says_so(make_inventory, tmp_path):
    import json

    from dflash_cli.local_state import RunLogs, RunRef, set_latest

    logs = tmp_path / "logs"
    ref = RunRef("ct203", GONE)
    set_latest(logs, ref)
    steps = [{"type": "step", "step": step, "loss": 4.0 - step, "tokens_per_s": 100.0} for step in (1, 2)]
    RunLogs(logs, ref).dir.mkdir(parents=True, exist_ok=True)
    RunLogs(logs, ref).events.write_text("".join(json.dumps(e) + "\n" for e in steps))  # watched before
    hosts = make_inventory(tmp_path)
    out = tmp_path / "curves.png"
    done = dflash_in_process("--logs-dir", str(logs), "plot", "-o", str(out), hosts=hosts)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{out}\n" and out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert done.stderr == (f"warning: the latest run {GONE} ({logs / 'latest.json'}) ran on ct203, which is not "
                           f"in {hosts}: what was watched here is all there is until it is back\n")
    # plot needs no inventory: one that cannot be read draws all the same, with nothing to say of ct203
    broken = tmp_path / "broken.yaml"
    broken.write_text("hosts: [not, a, mapping]\n")
    again = dflash_in_process("--logs-dir", str(logs), "plot", "-o", str(out), hosts=broken)
    assert (again.returncode, again.stderr) == (0, "")


def test_every_result_rendered_is_a_result_type_of_a_verb():
    """results.py finds a result's renderer and exit code by the type's name (so that
    rendering one verb's result imports no other verb): each name it knows must be a
    dataclass of a verb module, or a rename would leave its verb printing nothing."""
    import dataclasses
    import importlib
    import pkgutil

    from dflash_cli import commands, results

    types = {name: value for module in pkgutil.iter_modules(commands.__path__)
             for name, value in vars(importlib.import_module(f"dflash_cli.commands.{module.name}")).items()
             if isinstance(value, type) and dataclasses.is_dataclass(value)}
    named = set(results._RENDERERS) | set(results._EXIT_CODES)
    assert named - set(types) == set()
