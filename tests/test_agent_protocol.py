"""The agent's protocol as types (dflash_contract/replies.py): strict reading, the verb table
of the package docstring against the agent's parser, and a CLI meeting an agent of
another release."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import pytest

import dflash_agent
from dflash_agent.cli import build_parser
from dflash_contract import replies as protocol
from dflash_contract import follow, requests
from dflash_contract.checker import ProtocolError
from dflash_contract.follow import EndMessage, LogMessage, follow_message
from dflash_contract.records import ReleaseSource, RestartPolicy
from dflash_contract.replies import ErrorKind, ErrorReply, StatusReply
from dflash_contract.states import RunState
from dflash_run import dflash_in_process
from support_agent.harness import Agent, make_workspace

pytestmark = pytest.mark.timeout(60)

STATUS = {"run_id": "r", "name": None, "state": "RUNNING", "reason": None, "pid": 7, "started_at": 1.5,
          "ended_at": None, "exit": None, "errors": 0, "last_heartbeat": 2, "release_id": "abc", "source": None,
          "overrides": ["optim.lr=1e-4"], "step": 3, "startup": None, "startup_elapsed_s": None,
          "peer_failure": None, "attempt": 0, "attempts": 1, "resume_step": None, "checkpoint_step": None}


def test_a_reply_reads_back_as_it_was_written():
    reply = StatusReply.from_json({"runs": [STATUS]})
    (status,) = reply.runs
    assert status.state is RunState.RUNNING and status.overrides == ("optim.lr=1e-4",)
    assert reply.to_json() == {"runs": [STATUS]}
    assert json.dumps(reply.to_json()) == json.dumps({"runs": [STATUS]})  # the same bytes, key order included


@pytest.mark.parametrize("change, problem", [
    ({"shiny": 1}, "agent status reply: runs[0]: unknown key 'shiny'"),
    ({"state": "PAUSED"}, "agent status reply: runs[0].state: str 'PAUSED' is not one of STARTING, RUNNING"),
    ({"step": "3"}, "agent status reply: runs[0].step: expected int, got str '3'"),
    ({"errors": True}, "agent status reply: runs[0].errors: expected int, got bool True"),
    ({"overrides": "optim.lr=1e-4"}, "agent status reply: runs[0].overrides: expected a list, got str"),
])
def test_a_key_of_another_release_is_named_with_its_reply(change, problem):
    with pytest.raises(ProtocolError) as caught:
        StatusReply.from_json({"runs": [{**STATUS, **change}]})
    assert str(caught.value).startswith(problem)


def test_missing_keys_are_named_all_at_once_and_optional_ones_may_be_left_out():
    status = {key: value for key, value in STATUS.items() if key not in ("reason", "attempts")}
    with pytest.raises(ProtocolError, match=r"^agent status reply: runs\[0\]: missing keys 'reason', 'attempts'$"):
        StatusReply.from_json({"runs": [status]})
    # `config` is written only when asked for (--config): absent, it reads as None and stays absent.
    (read,) = StatusReply.from_json({"runs": [STATUS]}).runs
    assert read.config is None and "config" not in read.to_json()


def test_a_follow_message_is_read_by_its_type_and_an_error_reply_without_one():
    log = follow_message({"t": "log", "offset": 0, "data": "hello\n", "inode": 5, "segment": 0})
    assert isinstance(log, LogMessage) and (log.offset, log.inode) == (0, 5)
    assert follow_message({"t": "log", "offset": 6, "data": "x\n"}).to_json() == {"t": "log", "offset": 6,
                                                                                  "data": "x\n"}
    exit_record = {"exit_code": 1, "signal": None, "oom_killed": False, "ended_at": 9.0, "exec_error": None}
    end = follow_message({"t": "end", "state": "FAILED", "exit": exit_record, "attempt": 0, "offset": 8, "segment": 0})
    assert isinstance(end, EndMessage) and end.state.terminal
    refused = follow_message({"error": "no run 'x'", "kind": "not_found"})
    assert isinstance(refused, ErrorReply) and refused.kind is ErrorKind.NOT_FOUND
    with pytest.raises(ProtocolError, match=r"^agent follow message: unknown type str 'progress'$"):
        follow_message({"t": "progress", "fraction": 0.5})
    with pytest.raises(ProtocolError, match=r"^agent follow 'log' message: missing key 'data'$"):
        follow_message({"t": "log", "offset": 0})


def test_run_states_read_and_print_as_their_names():
    assert [state.value for state in RunState if state.terminal] == ["SUCCEEDED", "FAILED", "STOPPED", "LOST"]
    assert f"{RunState.STALLED}" == str(RunState.STALLED) == "STALLED" == RunState.STALLED
    assert json.dumps({"state": RunState.LOST}) == '{"state": "LOST"}'


def _verb_table() -> dict[str, tuple[str, set[str]]]:
    """{verb: (what it answers, its options)} from the package docstring's table."""
    table = dflash_agent.__doc__.split("Verbs\n-----\n", 1)[1].split("\n\n", 1)[0]
    verbs: dict[str, tuple[str, set[str]]] = {}
    verb = None
    for line in table.splitlines():
        if not line.startswith(" "):
            verb, _, answer = line.partition(" -> ")
            verbs[verb] = (answer, set())
        else:
            verbs[verb][1].update(re.findall(r"--[a-z][a-z0-9-]*", line))
    return verbs


def _parser_options() -> dict[str, set[str]]:
    (verbs,) = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return {verb: {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}
            for verb, parser in verbs.choices.items()}


def test_the_verb_table_names_every_verb_its_options_and_its_reply_type():
    table = _verb_table()
    options = _parser_options()
    assert set(table) == set(options)
    for verb, (answer, listed) in table.items():
        assert listed == options[verb], verb
        for name in re.findall(r"\b[A-Z]\w+\b", answer):
            named = getattr(protocol, name) if hasattr(protocol, name) else getattr(follow, name)
            if isinstance(named, type) and issubclass(named, protocol.Reply):
                assert named.VERB == verb, (verb, name)
    replies = {cls.__name__ for cls in vars(protocol).values()
               if isinstance(cls, type) and issubclass(cls, protocol.Reply) and cls.VERB}
    assert replies == {name for answer, _ in table.values() for name in re.findall(r"\b[A-Z]\w+Reply\b", answer)}


def test_a_cli_meets_the_agent_of_another_release_with_a_clear_error(tmp_path):
    """A release whose RunStatus has one more key: this CLI refuses to guess what it
    means, names the key, and says how to make the release this one's."""
    workspace = make_workspace(tmp_path)
    shipped = workspace / "current" / "remote" / "dflash_contract" / "replies.py"
    text = shipped.read_text()
    anchor = "    config: Optional[str] = optional()  # with --config: config.yaml's text as launched\n"
    assert anchor in text
    shipped.chmod(0o644)
    shipped.write_text(text.replace(anchor, anchor + "    shiny: int = 1\n"))
    Agent(workspace).fabricate_run("newer-1")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps({"hosts": {"box": {"transport": "local", "workspace": str(workspace),
                                                   "python": sys.executable}}}))
    done = dflash_in_process("status", "newer-1", "--host", "box", hosts=hosts)
    assert done.returncode == 3, done.stderr
    assert "host box: cannot read its answer: agent status reply: runs[0]: unknown key 'shiny'" in done.stderr
    assert "dflash deploy box" in done.stderr


def test_every_request_the_cli_makes_parses_as_the_agent_reads_it():
    """Each typed request's argv, with every option it can give, is what the agent's own
    parser accepts, each value arriving as the request holds it."""
    layout = requests.Layout(1, 2, "10.0.0.1", 29500, ("a", "b"))
    source = ReleaseSource("checkout", "/src", "rel", None, None, None, None, (), 0, "not a git checkout")
    restart = RestartPolicy(0, ("failure",), 10.0)
    made = [
        requests.Status(), requests.Status("r 1", config=True), requests.Stop("r 1", 2.5), requests.Stacks("r"),
        requests.Report("r"), requests.RunConfig("r"), requests.Artifacts("r", checkpoint=True),
        requests.SendFile("r", "export", "model.safetensors", 7, "1:2:3"), requests.CompileArtifacts(),
        requests.SendCompileArtifacts("k", "0" * 64), requests.ReceiveCompileArtifacts("k", {"files": []}),
        requests.ReleaseFiles("rel", ("a.py", "b.py")), requests.Gc(3),
        requests.Follow("r", errors_seen=1, gpu_interval=0.5, offset=10, segment=0, events_offset=4, inode=9,
                        fingerprint="2:" + "0" * 64, tail_lines=5),
        requests.Launch("r", "-", "name", 300.0, 60.0, source, restart, ("gpu0",), (("K", "--v"),),
                        ("torch",), (("file", "data.path", "x.jsonl"),), ("a=b",), release="rel", force=True,
                        layout=layout, check_only=True),
        requests.Resume("r", "run", 100, (("K", "V"),), ("torch",), dataclasses.replace(layout, master_addr=None),
                        check_only=True),
    ]
    def parsed(request: requests.Verb) -> argparse.Namespace:
        return build_parser().parse_args(["--workspace=/w", *request.argv()])

    for request in made:
        args = parsed(request)
        assert args.verb == request.VERB
        assert getattr(args, "run_id", None) == getattr(request, "run_id", None)
    launch = parsed(made[-2])
    assert (launch.env, launch.rank, launch.host_names, launch.check_only) == ([("K", "--v")], 1, "a,b", True)
    assert (launch.source_json, launch.restart_json) == (source, restart)
    assert parsed(made[-3]).fingerprint == "2:" + "0" * 64
