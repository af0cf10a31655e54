"""The Python API (`import dflash`, docs/api.md) in this process: what `watch` hands on of a
run, item by item (the stand-in trainer of tests/support_agent scripts the run), the one
error type with its exit code on bad input, a launch's run id and hosts, the import's
cost, and README.md's example run as it stands (with the real trainer)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
import yaml

from dflash_contract.replies import ReportReply, RunStatus
from dflash_contract.states import RunState
import dflash_trainer as dflash
from dflash_cli import release, watching
from dflash_cli.errors import ExitCode
from dflash_run import REPO, dflash_in_process
from support import kill_ssh_sessions
from support_agent.harness import agent  # noqa: F401  (fixture)
from support.train_configs import small_config

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def hosts(agent, make_inventory, tmp_path):  # noqa: F811
    """An inventory whose `local` uses the stand-in's workspace."""
    return make_inventory(tmp_path, local={"workspace": str(agent.workspace)})


def kinds(items: list) -> list[str]:
    return [type(item).__name__ for item in items]


# --- import ----------------------------------------------------------------------------------

def test_import_is_cheap_and_the_types_come_when_named():
    shown = subprocess.run([sys.executable, "-X", "importtime", "-c", "import dflash_trainer; print(dflash_trainer.__file__)"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == str(REPO / "dflash_trainer" / "__init__.py")
    imported = {line.rsplit("|", 1)[-1].strip() for line in shown.stderr.splitlines() if line.startswith("import time:")}
    assert "dflash_cli.errors" in imported
    heavy = {"torch", "paramiko", "fabric", "rich", "click", "yaml", "dflash_train", "dflash_cli.session",
             "wandb", "mlflow", "trackio", "dflash_cli.trackers"}
    assert not heavy & imported, heavy & imported
    assert dflash.Log is watching.Log and dflash.RunStatus is RunStatus and dflash.DflashError.__name__ == "DflashError"
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        dflash.Nothing  # noqa: B018


# --- watch, status, fetch_traceback ----------------------------------------------------------

def test_watch_hands_on_log_events_errors_states_and_the_end_of_a_failing_run(agent, hosts, tmp_path):  # noqa: F811
    step = {"type": "step", "step": 1, "total_steps": 1, "loss": 2.5, "acc": [0.5], "lr": 1e-4, "grad_norm": 1.0,
            "epoch": 0, "samples_per_s": 3.0, "tokens_per_s": 30.0, "peak_memory_bytes": [None]}
    agent.launch("api-fail", [{"print": "[coordinator] hello"}, {"wait_file": "go"}, {"event": step}, {"heartbeat": 1},
                              {"print": "[drafter-0] step 1"}, {"error": {"thread": "drafter-1", "message": "api boom"}},
                              {"exit": 1}])
    logs = tmp_path / "logs"
    items = []
    for item in dflash.watch("api-fail", host="local", hosts_file=hosts, logs_dir=logs):
        items.append(item)
        if isinstance(item, dflash.Log) and item.text == "[coordinator] hello\n":  # seen live: the run goes on
            agent.touch("api-fail", "go")

    following, *middle, host_ended, ended = items
    assert isinstance(following, dflash.Following) and following.host == "local"
    assert following.keeps_local_state and following.resumed_at is None
    assert following.local_dir == logs / "local" / "api-fail"
    assert set(kinds(middle)) <= {"StateChange", "Log", "Events", "ErrorRecorded"}, kinds(middle)

    states = [item.state for item in middle if isinstance(item, dflash.StateChange)]
    assert states[0] in (RunState.STARTING, RunState.RUNNING) and states[-1] == RunState.FAILED, states
    remote_log = (agent.run_dir("api-fail") / "train.log").read_text()
    logged = [item for item in middle if isinstance(item, dflash.Log)]
    assert "".join(item.text for item in logged) == remote_log
    assert [line for item in logged for line in item.lines] == ["[coordinator] hello\n", "[drafter-0] step 1\n"]
    events = [event for item in middle if isinstance(item, dflash.Events) for event in item.events]
    assert [event["type"] for event in events] == ["step"] and events[0]["loss"] == 2.5  # no heartbeat

    (error,) = [item for item in middle if isinstance(item, dflash.ErrorRecorded)]
    assert error.record.thread == "drafter-1" and error.record.message == "api boom"
    assert error.diagnosis is None  # no failure dflash knows
    assert error.traceback_saved == following.local_dir / "traceback.txt"
    assert error.traceback_saved.read_text() == error.record.traceback
    assert "RuntimeError: api boom" in error.record.traceback

    assert isinstance(host_ended, dflash.HostEnded) and host_ended.state == RunState.FAILED
    assert host_ended.unexplained is None  # its record explains it
    assert isinstance(ended, dflash.Ended)
    assert (ended.state, ended.exit_code, ended.hosts) == (RunState.FAILED, ExitCode.RUN_FAILED, ("local",))
    assert ended.root_cause[0] == "local" and ended.root_cause[1].message == "api boom"
    # what was handed on is what was kept
    assert (following.local_dir / "train.log").read_text() == remote_log
    assert [json.loads(line)["type"] for line in (following.local_dir / "events.jsonl").read_text().splitlines()] \
        == ["step"]

    status = dflash.status("api-fail", host="local", hosts_file=hosts, logs_dir=logs)
    assert isinstance(status, RunStatus) and status.state == RunState.FAILED and status.errors == 1
    assert dflash.exit_code_for_state(status.state) == ExitCode.RUN_FAILED
    found = dflash.fetch_traceback("api-fail", host="local", hosts_file=hosts, logs_dir=logs)
    assert found.text.startswith("==> run api-fail on local: thread drafter-1 failed in startup")
    assert found.text.endswith("RuntimeError: api boom\n")
    assert found.root_cause == ("local", error.record) and found.explained and found.state == RunState.FAILED


def test_a_watch_left_early_detaches_and_the_next_goes_on_after_its_last_item(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("api-detach", [{"print": "first"}, {"wait_file": "go"}, {"print": "second"}])
    logs = tmp_path / "logs"
    watch = dflash.watch("api-detach", host="local", hosts_file=hosts, logs_dir=logs)
    for item in watch:
        if isinstance(item, dflash.Log):
            assert item.text == "first\n"
            break
    watch.close()  # detached: the run goes on
    assert agent.status("api-detach")["state"] in ("STARTING", "RUNNING")
    agent.touch("api-detach", "go")

    again = list(dflash.watch("api-detach", host="local", hosts_file=hosts, logs_dir=logs))
    assert again[0].resumed_at == len("first\n")
    assert "".join(item.text for item in again if isinstance(item, dflash.Log)) == "second\n"
    assert (again[-1].state, again[-1].exit_code) == (RunState.SUCCEEDED, ExitCode.OK)
    assert (logs / "local" / "api-detach" / "train.log").read_text() == "first\nsecond\n"


def test_a_dropped_connection_costs_the_items_neither_a_gap_nor_a_duplicate(agent, make_inventory, ssh_node,  # noqa: F811
                                                                             tmp_path, capfd):
    hosts = make_inventory(tmp_path, node={"workspace": str(agent.workspace)})
    burst = [{"lines": {"count": 300, "width": 30}}]
    agent.launch("api-drop", [*burst, {"wait_file": "go"}, *burst])
    received = ""
    dropped = False
    watch = dflash.watch("api-drop", host="node", hosts_file=hosts, logs_dir=tmp_path / "logs")
    for item in watch:
        if isinstance(item, dflash.Log):
            received += item.text
            if received.endswith(f"line {299:06d} {'x' * 30}\n") and not dropped:
                assert kill_ssh_sessions(ssh_node)  # the stream's connection dies under it
                dropped = True
                agent.touch("api-drop", "go")
    assert dropped and "reconnecting" in capfd.readouterr().err
    assert received == (agent.run_dir("api-drop") / "train.log").read_text()  # each line once
    assert item.exit_code == ExitCode.OK and received.count("line 000000") == 2


def test_a_garbled_errors_jsonl_line_comes_as_it_is(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("api-garbled", [{"wait_file": "go"}, {"error": {"thread": "drafter-0", "message": "real"}},
                                 {"exit": 1}])
    with open(agent.run_dir("api-garbled") / "errors.jsonl", "ab") as errors:
        errors.write(b'{"thread": "drafter-1", cut short by a kill\n')
    agent.touch("api-garbled", "go")
    items = list(dflash.watch("api-garbled", host="local", hosts_file=hosts, logs_dir=tmp_path / "logs"))
    garbled, real = [item for item in items if isinstance(item, dflash.ErrorRecorded)]
    assert garbled.message.record is None and garbled.message.raw == '{"thread": "drafter-1", cut short by a kill'
    assert garbled.record.exc_type == "unreadable errors.jsonl line" and garbled.diagnosis is None
    assert real.record.message == "real" and items[-1].exit_code == ExitCode.RUN_FAILED


def test_a_run_killed_without_a_record_ends_with_what_its_host_knows(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("api-killed", [{"print": "[drafter-0] about to die"}, {"kill_self": "SIGKILL"}])
    items = list(dflash.watch("api-killed", host="local", hosts_file=hosts, logs_dir=tmp_path / "logs"))
    host_ended, ended = items[-2:]
    assert isinstance(host_ended.unexplained, ReportReply)
    assert host_ended.unexplained.exit.signal == signal.SIGKILL.name
    assert ended.exit_code == ExitCode.RUN_FAILED and ended.root_cause is None
    found = dflash.fetch_traceback("api-killed", host="local", hosts_file=hosts, logs_dir=tmp_path / "logs")
    assert not found.explained and "no error record" in found.text and "killed by SIGKILL" in found.text


# --- bad input -------------------------------------------------------------------------------

def refused(call, code: ExitCode) -> dflash.DflashError:
    with pytest.raises(dflash.DflashError) as raised:
        call()
    assert raised.value.exit_code == code, raised.value.message
    return raised.value


def test_bad_input_is_one_error_type_with_its_exit_code(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    config = small_config(tmp_path / "small.yaml")
    where = {"hosts_file": hosts, "logs_dir": tmp_path / "logs"}

    unknown = refused(lambda: dflash.launch("nowhere", config, **where), ExitCode.USAGE)
    assert "nowhere" in unknown.message and str(hosts) in unknown.message
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text() + "colour: blue\n")
    assert "colour" in refused(lambda: dflash.launch("local", bad, **where), ExitCode.USAGE).message
    assert "cannot read file" in refused(lambda: dflash.launch("local", tmp_path / "none.yaml", **where),
                                         ExitCode.USAGE).message
    assert "--set optim.lr=-1" in refused(lambda: dflash.launch("local", config, overrides=["optim.lr=-1"], **where),
                                          ExitCode.USAGE).message
    assert "name '-x': a run name has 1 to 179 characters" in refused(
        lambda: dflash.launch("local", config, name="-x", **where), ExitCode.USAGE).message
    assert "master_port" in refused(lambda: dflash.launch("local", config, master_port=0, **where),
                                    ExitCode.USAGE).message
    assert refused(lambda: dflash.launch("local", config, master_port=29500, **where), ExitCode.USAGE).message == (
        "master_addr and master_port are for a run on several hosts; local is one")
    assert not (tmp_path / "local ws").exists()  # nothing was deployed

    none_yet = refused(lambda: dflash.watch(**where), ExitCode.USAGE)  # at the call, not at the first item
    assert "no latest run" in none_yet.message and none_yet.hint == "name the run: dflash.watch(RUN, host=HOST)"
    assert "tail -1" in refused(lambda: dflash.watch("r", host="local", tail=-1, **where), ExitCode.USAGE).message
    assert refused(lambda: dflash.status("r", host="down", **where), ExitCode.UNREACHABLE).message.startswith("host down")
    not_deployed = refused(lambda: dflash.fetch_traceback("r", host="local", **where), ExitCode.USAGE)
    assert not_deployed.hint == "run: dflash deploy local"
    broken = tmp_path / "broken.yaml"
    broken.write_text("hosts:\n  local: {transport: carrier-pigeon}\n")
    assert str(broken) in refused(lambda: dflash.status("r", host="local", hosts_file=broken), ExitCode.USAGE).message


@pytest.mark.parametrize("call, problem", [
    (lambda **where: dflash.launch(42, "c.yaml", **where), "dflash.launch: hosts=42: expected str | Sequence[str], got int"),
    (lambda **where: dflash.launch("local", 123, **where), "dflash.launch: config=123: expected str | os.PathLike, got int"),
    (lambda **where: dflash.launch("local", "c.yaml", overrides=[1], **where),
     "dflash.launch: overrides=[1]: expected Sequence[str], got list"),
    (lambda **where: dflash.launch("local", "c.yaml", master_port="x", **where),
     "dflash.launch: master_port='x': expected int | None, got str"),
    (lambda **where: dflash.status(5, **where), "dflash.status: run=5: expected str | None, got int"),
    (lambda **where: dflash.watch("r", retry_for="soon", **where), "dflash.watch: retry_for='soon': expected float, got str"),
    (lambda **where: dflash.watch("r", tail=True, **where), "dflash.watch: tail=True: expected int | None, got bool"),
    (lambda **where: dflash.resume("r", step="five", **where), "dflash.resume: step='five': expected int | None, got str"),
    (lambda **where: dflash.pull("r", checkpoint="yes", **where), "dflash.pull: checkpoint='yes': expected bool, got str"),
    (lambda **where: dflash.fetch_traceback("r", logs_dir=7), "dflash.fetch_traceback: logs_dir=7: expected str | "
                                                               "os.PathLike | None, got int"),
    (lambda **where: dflash.status("r", colour="blue", **where), "dflash.status: got an unexpected keyword argument 'colour'"),
])
def test_an_argument_of_another_type_is_a_usage_error_naming_it(make_inventory, tmp_path, call, problem):
    where = {"hosts_file": make_inventory(tmp_path), "logs_dir": tmp_path / "logs"}
    assert refused(lambda: call(**where), ExitCode.USAGE).message == problem
    assert not (tmp_path / "logs").exists() and not (tmp_path / "local ws").exists()  # nothing was done


# --- launch ----------------------------------------------------------------------------------

def test_launch_returns_the_run_id_and_hosts_and_the_run_becomes_the_latest(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    logs = tmp_path / "logs"
    launched = dflash.launch("local", small_config(tmp_path / "small.yaml"), name="api-launch", hosts_file=hosts,
                             logs_dir=logs)
    try:
        assert re.fullmatch(r"api-launch-\d{8}-\d{6}-[0-9a-f]{4}", launched.run_id), launched.run_id
        assert launched.hosts == ("local",) and launched.rendezvous is None
        (started,) = launched.started
        assert started.run_id == launched.run_id and started.pid > 0
        assert started.release_id == release.scan(REPO).release_id
        assert json.loads((logs / "latest.json").read_text())["run_id"] == launched.run_id
        assert dflash.status(hosts_file=hosts, logs_dir=logs).run_id == launched.run_id  # the latest run
        # Options that do not go together: named as the function spells them, by the CLI as its flags.
        mixed = refused(lambda: dflash.fetch_traceback(launched.run_id, host="local", stacks=True, thread="drafter-0",
                                                       hosts_file=hosts, logs_dir=logs), ExitCode.USAGE)
        assert mixed.message == "stacks shows every thread's stack; it does not combine with thread or all_records"
        flags = dflash_in_process("--logs-dir", str(logs), "fetch-traceback", launched.run_id, "--host", "local",
                                  "--stacks", "--all", hosts=hosts)
        assert flags.returncode == 2 and flags.stderr == ("dflash: error: --stacks shows every thread's stack; it does "
                                                          "not combine with --thread or --all\n"), flags.stderr
    finally:
        stopped = dflash_in_process("--logs-dir", str(logs), "stop", launched.run_id, "--host", "local", "--grace",
                                    "0", hosts=hosts)
        assert stopped.returncode == 0, stopped.stderr


# --- README.md -------------------------------------------------------------------------------

def readme_example() -> str:
    """The code block of README.md's "Python API" section."""
    section = (REPO / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return code


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=25, why="README's example: two real trainer runs on CPU, one of 4 steps, one failing at start-up")
def test_the_readme_example_runs_as_it_stands(make_inventory, tmp_path, monkeypatch, capsys):
    inventory = make_inventory(tmp_path)
    # `local` alone, in this test's folder, as the built-in one is everywhere else
    only_local = {"hosts": {"local": yaml.safe_load(inventory.read_text())["hosts"]["local"]}}
    inventory.write_text(yaml.safe_dump(only_local))
    monkeypatch.setenv("DFLASH_HOSTS", str(inventory))
    monkeypatch.chdir(REPO)  # the example names configs/train/tiny-cpu.yaml of the checkout
    namespace: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), namespace)

    out = capsys.readouterr().out
    launched, ended, failed, record = (namespace[name] for name in ("launched", "ended", "failed", "record"))
    assert launched.hosts == ("local",) and launched.run_id.startswith("api-demo-")
    assert (ended.state, ended.exit_code) == (RunState.SUCCEEDED, ExitCode.OK)
    assert "step 4/4: loss " in out and "final state: SUCCEEDED exit code 0" in out
    assert (failed.state, record.exc_type, record.thread) == (RunState.FAILED, "InjectedFault", "drafter-1")
    assert "InjectedFault: injected fault in drafter-1 at startup" in out
    assert re.search(r"^USAGE \(2\): .*'nowhere'", out, re.MULTILINE), out
    assert (tmp_path / "logs" / "local" / launched.run_id / "events.jsonl").exists()
