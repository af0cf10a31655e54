"""--json on every verb (docs/cli.md "--json"): the verbs are taken from the click group
itself, so a verb added without --json, or without a case here, fails this file. Each
verb's answer is JSON on stdout, one object a line; its error is one more object,
{"error", "hint", "exit_code"}, the exit code the process exits with, beside the human
line on stderr: for an error of the core (a host the inventory lacks, no run recorded)
and for one of click's (an option it does not know) alike."""
from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from dflash_run import REPO, dflash_in_process
from test_bad_input import fabricate_run

from dflash_cli import cli
from dflash_cli.local_state import RunRef, set_latest

TINY = str(REPO / "configs" / "train" / "tiny-cpu.yaml")


def verbs(group: click.Group, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command of the group and of its groups, by its words."""
    found = {}
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.update(verbs(command, (*path, name)))
        else:
            found[(*path, name)] = command
    return found


# An error of the core for each verb: a host the inventory lacks, or no run given and none
# recorded (the test's logs/ is empty).
ERRORS = {
    ("deploy",): ["nowhere"],
    ("setup",): ["nowhere"],
    ("launch",): ["nowhere", "--config", TINY],
    ("resume",): [],
    ("watch",): [],
    ("fetch-traceback",): [],
    ("stacks",): [],
    ("status",): [],
    ("stop",): [],
    ("pull",): [],
    ("plot",): [],
    ("runs",): ["--host", "nowhere"],
    ("diff",): ["a-1", "b-1", "--host", "nowhere"],
    ("gc",): ["nowhere"],
    ("cache", "copy"): ["nowhere", "local"],
    ("hosts",): ["nowhere"],
    ("init",): ["nowhere"],  # not a Host of the (empty) SSH config the tests use
    ("completion",): [],  # SHELL is tcsh: no completion for it
}


def json_lines(stdout: str) -> list[dict]:
    lines = stdout.splitlines()
    assert lines, "nothing on stdout"
    return [json.loads(line) for line in lines]


def assert_json_error(done: subprocess.CompletedProcess, exit_code: int) -> dict:
    assert done.returncode == exit_code, (done.stdout, done.stderr)
    error = json_lines(done.stdout)[-1]
    assert set(error) == {"error", "hint", "exit_code"} and error["exit_code"] == exit_code, error
    assert error["error"] and error["error"] in " ".join(done.stderr.split())  # and said to people
    return error


def test_every_verb_has_json_and_a_case_here():
    found = verbs(cli.main)
    assert set(ERRORS) == set(found)
    for words, command in found.items():
        assert any(param.opts == ["--json"] for param in command.params), f"dflash {' '.join(words)} lacks --json"


@pytest.mark.parametrize("words", sorted(ERRORS), ids=" ".join)
def test_an_error_of_every_verb_is_json(words, make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    done = dflash_in_process(*words, *ERRORS[words], "--json", hosts=hosts, cwd=tmp_path, env={"SHELL": "/bin/tcsh"})
    error = assert_json_error(done, 2)
    assert any(part in error["error"] for part in ("'nowhere'", "nowhere:", "no run given", "'tcsh'")), error
    unknown = dflash_in_process(*words, "--json", "--no-such-option", hosts=hosts)
    assert assert_json_error(unknown, 2)["error"] == "No such option '--no-such-option'."


def test_the_verbs_answers_are_json(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    logs = tmp_path / "logs"

    def run(*args: str, code: int = 0, cwd=None) -> list[dict]:
        done = dflash_in_process(*args, "--json", hosts=hosts, cwd=cwd)
        assert done.returncode == code, done.stderr
        return json_lines(done.stdout)

    (deployed,) = run("deploy", "node")
    assert deployed["host"] == "node" and deployed["status"] == "installed"
    workspace = tmp_path / "node ws"
    fabricate_run(workspace, "done-20261204-150000-aaaa", 0)
    fabricate_run(workspace, "died-20261204-160000-bbbb", 1)
    (status,) = run("status", "done-2026", "--host", "node")
    assert (status["run_id"], status["state"]) == ("done-20261204-150000-aaaa", "SUCCEEDED")
    (traceback,) = run("fetch-traceback", "died", "--host", "node", code=1)
    assert traceback["state"] == "FAILED" and "exit code 1" in traceback["text"]
    (stopped,) = run("stop", "done-20261204-150000-aaaa", "--host", "node")
    assert stopped["state"] == "SUCCEEDED" and stopped["hosts"][0]["host"] == "node"
    assert {r["run_id"] for r in run("runs", "--host", "node")} == {"done-20261204-150000-aaaa",
                                                                    "died-20261204-160000-bbbb"}
    assert run("gc", "node")[0]["host"] == "node"
    assert "node" in {h["host"] for h in run("hosts")}
    (dry,) = run("launch", "local", "--config", TINY, "--dry-run")
    assert dry["dry_run"] and dry["ok"] and dry["hosts"][0]["host"] == "local"
    assert all(v["problem"] is None for v in dry["hosts"][0]["verdicts"])
    set_latest(logs, RunRef("node", "done-20261204-150000-aaaa"))
    (logs / "node" / "done-20261204-150000-aaaa" / "events.jsonl").write_text(
        json.dumps({"type": "step", "step": 1, "loss": 3.0, "tokens_per_s": 10.0}) + "\n")
    (plotted,) = run("plot", "-o", str(tmp_path / "p.png"))
    assert plotted == {"path": str(tmp_path / "p.png"), "runs": [{"host": "node", "run_id": "done-20261204-150000-aaaa"}]}
    (script,) = run("completion", "--shell", "fish")
    assert script["shell"] == "fish" and "_DFLASH_COMPLETE=fish_complete" in script["script"]
    project = tmp_path / "project"
    project.mkdir()
    (initialized,) = run("init", cwd=project)
    assert initialized["files"] == [str(project / "configs" / "hosts.yaml"), str(project / "dflash.yaml")]


def test_a_json_error_is_written_by_the_command_a_user_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dflash_cli", "status", "--json"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert_json_error(done, 2)
