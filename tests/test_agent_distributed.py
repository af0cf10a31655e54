"""`launch` of one host's part of a run on several hosts: the torch.distributed variables
in the trainer's environment, run.json's `distributed`, and `--check-only`, which checks
what a launch would and starts nothing (the first host also picks the rendezvous port)."""
from __future__ import annotations

import socket

import pytest

from support_agent.harness import agent  # noqa: F401  (fixture)
from support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

WAIT = [{"wait_file": "go"}]
LAYOUT = ["--rank=1", "--world-size=2", "--master-addr=10.1.2.7", "--master-port=29511",
          "--host-names=ct200,ct202"]


def test_the_layout_reaches_the_trainer_and_run_json(agent):
    agent.launch("pair", [], *LAYOUT)
    agent.wait_state("pair", "SUCCEEDED")
    started = agent.read("pair", "standin.json")
    assert started["distributed_env"] == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.7",
                                          "MASTER_PORT": "29511", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert agent.read("pair", "run.json")["distributed"] == {
        "rank": 1, "world_size": 2, "master_addr": "10.1.2.7", "master_port": 29511,
        "hosts": ["ct200", "ct202"]}


def test_a_one_host_run_sees_no_layout_even_from_the_hosts_environment(agent):
    """A WORLD_SIZE the host's environment (or the inventory's env) holds must not make a
    one-host run wait for peers that were never started."""
    agent.env.update(RANK="3", WORLD_SIZE="8", MASTER_ADDR="elsewhere")
    agent.launch("alone", [], "--env=MASTER_PORT=1234")
    agent.wait_state("alone", "SUCCEEDED")
    assert agent.read("alone", "standin.json")["distributed_env"] == {}
    assert agent.read("alone", "run.json")["distributed"] is None


def test_check_only_picks_a_free_port_and_creates_nothing(agent):
    config = agent.config(WAIT)
    reply = agent.ok("launch", "--run-id=probe", f"--config={config}", "--resource=cpu", "--check-only",
                     "--rank=0", "--world-size=2", "--master-addr=127.0.0.1", "--master-port=0")
    assert reply["checked"] is True and reply["run_id"] == "probe"
    with socket.socket() as sock:  # free when asked: it can be bound
        sock.bind(("", reply["master_port"]))
    assert not (agent.workspace / "runs" / "probe").exists()
    assert not (agent.workspace / "locks" / "cpu.json").exists()
    # A port given is kept: nothing is picked.
    reply = agent.ok("launch", "--run-id=probe", f"--config={config}", "--check-only", *LAYOUT)
    assert "master_port" not in reply


def test_check_only_refuses_what_the_launch_would(agent):
    agent.launch("holder", WAIT, "--resource=cpu")
    config = agent.config(WAIT)
    check = ["--check-only", *LAYOUT]
    busy = agent.run("launch", "--run-id=new", f"--config={config}", "--resource=cpu", *check)
    assert (busy.rc, busy.json["kind"], busy.json["holders"]) == (2, "conflict", ["holder"])
    assert agent.ok("launch", "--run-id=new", f"--config={config}", "--resource=cpu", "--force", *check)
    taken = agent.run("launch", "--run-id=holder", f"--config={config}", *check)
    assert (taken.rc, taken.json["kind"]) == (2, "conflict") and "already exists" in taken.json["error"]
    missing = agent.run("launch", "--run-id=new", f"--config={config}", *check,
                        "--require-path=file:data.train=/nonexistent/train.jsonl")
    assert (missing.rc, missing.json["kind"]) == (2, "host")
    assert "data.train: /nonexistent/train.jsonl does not exist" in missing.json["error"]
    assert not (agent.workspace / "runs" / "new").exists()
    agent.touch("holder", "go")
    wait_until(lambda: agent.status("holder")["state"] == "SUCCEEDED")


@pytest.mark.parametrize("args, text", [
    (["--rank=2", "--world-size=2", "--master-addr=a", "--master-port=1"], "--rank 2 is not in [0, --world-size 2)"),
    (["--rank=0", "--master-addr=a"], "--rank, --world-size and --master-addr go together"),
    (["--rank=0", "--world-size=2", "--master-addr=a"], "--master-port 0 is not a TCP port"),
    (["--rank=0", "--world-size=2", "--master-addr=a", "--master-port=70000"], "--master-port 70000"),
    (["--rank=0", "--world-size=2", "--master-addr=", "--master-port=1"], "--master-addr must not be empty"),
    (["--rank=0", "--world-size=2", "--master-addr=a", "--master-port=1", "--host-names=a,b,c"],
     "--host-names names 3 hosts for --world-size 2"),
])
def test_layout_errors_are_usage_errors(agent, args, text):
    result = agent.run("launch", "--run-id=x", f"--config={agent.config([])}", *args)
    assert (result.rc, result.json["kind"]) == (2, "usage"), result.json
    assert text in result.json["error"]
    assert not (agent.workspace / "runs" / "x").exists()
