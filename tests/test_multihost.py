"""One run across several hosts, as the CLI and the agent see it: inventory groups and
addresses, the run's state and root cause from every host's, and `dflash launch` on two
containers (ct200 + ct202 behind the fake pct, each with its own filesystem) that checks
every host before it starts any and leaves no half-started run."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from dflash_contract.records import ErrorRecord, ExitRecord, PeerFailure
from dflash_contract.replies import RunStatus
from dflash_contract.states import RunState
from dflash_files import procfs
from dflash_cli.errors import DflashError, ExitCode
from dflash_cli.inventory import load_inventory
from dflash_cli.local_state import RunRef, latest_or_refuse, recorded_run, set_latest
from dflash_cli.multihost import (HostStatus, aggregate_state, blamed_host, blamed_line, in_time_order,
                                  mark_silent_ranks, peer_failed_line, root_cause)
from dflash_run import dflash, dflash_argv, dflash_env, dflash_in_process
from support import container_workspace, free_port
from support.inventory import HOST_ENV, default_hosts
from support.netns import linked_namespace
from support.events import read_events
from support.train_configs import small_config
from support.wait import wait_until

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


# -- inventory -------------------------------------------------------------------------

def inventory(tmp_path: Path, text: str):
    path = tmp_path / "hosts.yaml"
    path.write_text(textwrap.dedent(text))
    return path


HOSTS = """
    hosts:
      ct200: {transport: pct, ssh: root@10.1.2.6, container: 200, workspace: /w, address: 10.1.2.20}
      ct202: {transport: pct, ssh: root@10.1.2.6, container: 202, workspace: /w}
      gpu1: {transport: ssh, ssh: 'ubuntu@gpu1.example.net:2222', workspace: /w}
"""


def test_a_group_names_hosts_in_rank_order(tmp_path):
    loaded = load_inventory(inventory(tmp_path, HOSTS + "    groups: {pair: [ct202, ct200], trio: [gpu1, ct200, ct202]}\n"))
    assert [h.name for h in loaded.expand(["pair"])] == ["ct202", "ct200"]
    assert [h.name for h in loaded.expand(["gpu1", "pair"])] == ["gpu1", "ct202", "ct200"]
    # Where the others reach a host: its address, else an ssh target's host; a
    # container's node is not the container, so it has none unless set.
    assert [loaded.get(n).rendezvous_address() for n in ("ct200", "ct202", "gpu1", "local")] == [
        "10.1.2.20", None, "gpu1.example.net", "127.0.0.1"]
    with pytest.raises(DflashError, match=r"host 'ct200' is named twice \(in group 'pair', then directly\)"):
        loaded.expand(["pair", "ct200"])
    with pytest.raises(DflashError, match=r"host 'ct200' is named twice \(directly, then directly\)"):
        loaded.expand(["ct200", "ct200"])
    with pytest.raises(DflashError, match=r"unknown host 'quad' \(known hosts: .*; groups: pair, trio\)"):
        loaded.expand(["quad"])


@pytest.mark.parametrize("groups, expected", [
    ("{pair: [ct200, ct209]}", r"groups.pair\[1\]: unknown host 'ct209' \(known hosts: ct200, ct202, gpu1, local\)"),
    ("{pair: [ct200, ct202, ct200]}", r"groups.pair\[2\]: host 'ct200' is in the group twice \(first at \[0\]\)"),
    ("{ct200: [ct200, ct202]}", r"groups.ct200: 'ct200' is already a host's name"),
    ("{pair: []}", r"groups.pair: a group names at least one host"),
    ("{pair: ct200}", r"groups.pair: expected a list"),
    ("{'pa ir': [ct200]}", r"groups.pa ir: group names may use letters"),
])
def test_bad_groups_name_file_group_and_entry(tmp_path, groups, expected):
    path = inventory(tmp_path, HOSTS + f"    groups: {groups}\n")
    with pytest.raises(DflashError) as info:
        load_inventory(path)
    assert info.value.exit_code == ExitCode.USAGE
    assert info.value.message.startswith(f"{path}: ")
    assert re.search(expected, info.value.message), info.value.message


def test_hosts_lists_the_groups(tmp_path):
    path = inventory(tmp_path, HOSTS + "    groups: {pair: [ct202, ct200]}\n")
    listed = dflash("hosts", hosts=path)
    assert listed.returncode == 0, listed.stderr
    assert "group pair: ct202, ct200 (one run, rank 0 first)" in listed.stderr
    entries = {e["host"]: e for e in map(json.loads, dflash("hosts", "--json", hosts=path).stdout.splitlines())}
    assert (entries["ct200"]["groups"], entries["gpu1"]["groups"]) == (["pair"], [])


def test_hosts_lists_the_hosts_and_groups_named_and_refuses_an_unknown_one_before_any_check(tmp_path):
    path = inventory(tmp_path, HOSTS + "    groups: {pair: [ct202, ct200]}\n")
    named = dflash("hosts", "pair", "gpu1", "ct200", hosts=path)  # ct200 twice: listed once
    assert named.returncode == 0, named.stderr
    assert named.stdout.split() == ["ct200", "ct202", "gpu1"]
    assert "group pair: ct202, ct200" in named.stderr
    alone = dflash("hosts", "gpu1", hosts=path)
    assert alone.stdout.split() == ["gpu1"] and "group pair" not in alone.stderr
    unknown = dflash("hosts", "--check", "local", "gpu9", hosts=path)  # local would answer a check
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert f"{path}: unknown host 'gpu9' (known hosts: " in unknown.stderr and "groups: pair" in unknown.stderr


def test_a_bad_address_is_refused(tmp_path):
    path = inventory(tmp_path, "hosts:\n  box: {transport: ssh, ssh: root@n, workspace: /w, address: 'a b'}\n")
    with pytest.raises(DflashError, match=r"hosts.box: 'address' must be a host name or IP address"):
        load_inventory(path)


# -- the run's state and root cause from every host's ---------------------------------------

@pytest.mark.parametrize("states, expected", [
    (["RUNNING", "RUNNING"], "RUNNING"),
    (["RUNNING", "STARTING"], "STARTING"),  # RUNNING only when every host runs
    (["RUNNING", "FAILED"], "FAILED"),  # FAILED if any host failed
    (["STOPPED", "FAILED"], "FAILED"),
    (["SUCCEEDED", "RUNNING"], "RUNNING"),  # not done until every host is
    (["SUCCEEDED", "SUCCEEDED"], "SUCCEEDED"),
    (["STOPPED", "RUNNING"], "STOPPED"),
    (["RUNNING", "DEGRADED"], "DEGRADED"),
    (["RUNNING", None], None),  # a host that could not be asked: unknown
    (["FAILED", None], "FAILED"),
])
def test_the_run_state_is_the_worst_host_state(states, expected):
    assert aggregate_state({f"h{i}": s and RunState(s) for i, s in enumerate(states)}) == expected


def record(ts: float, exc_type: str, thread: str = "drafter-0") -> ErrorRecord:
    return ErrorRecord(ts=ts, exc_type=exc_type, thread=thread)


def peer_failed(**detail) -> ErrorRecord:
    """A PeerFailed record with `detail`, read as errors.jsonl holds it."""
    return ErrorRecord.from_json({"exc_type": "PeerFailed", "detail": detail})


def test_the_root_cause_is_the_earliest_record_that_is_not_a_peer_failure():
    # ct200 noticed its peer's failure (PeerFailed) before ct202's own record's time
    # stamp: the cause is still ct202's.
    by_host = {"ct200": [record(10.0, "PeerFailed", "coordinator"), record(10.5, "RuntimeError", "coordinator")],
               "ct202": [record(10.2, "RuntimeError", "drafter-1"), record(10.3, "RuntimeError", "coordinator")]}
    merged = in_time_order(by_host)
    assert [(h, r.ts) for h, r in merged] == [("ct200", 10.0), ("ct202", 10.2), ("ct202", 10.3), ("ct200", 10.5)]
    assert root_cause(merged) == ("ct202", by_host["ct202"][0])
    only_peers = in_time_order({"ct200": [record(3.0, "PeerFailed")], "ct202": []})
    assert root_cause(only_peers)[0] == "ct200"
    assert root_cause([]) is None
    gone = peer_failed(peer_rank=0, peer_exc_type=None, peer_message="no sign")
    assert peer_failed_line(gone, ["ct200", "ct202"]) == "stopped because rank 0 (ct200) is gone: no sign"
    failed = peer_failed(peer_rank=1, peer_exc_type="KeyError", peer_message="x")
    assert peer_failed_line(failed, ["ct200", "ct202"]) == "stopped because rank 1 (ct202) failed: KeyError: x"
    # One host keeps its file order (records are appended as threads fail).
    assert in_time_order({"a": [record(2.0, "X"), record(1.0, "Y")]})[0][1].ts == 2.0


def test_the_run_id_alone_finds_every_host_of_the_run(tmp_path):
    logs = tmp_path / "logs"
    ref = RunRef("ct200", "pair-1", ("ct200", "ct202"))
    set_latest(logs, ref)
    set_latest(logs, RunRef("local", "other-1"))  # a later run elsewhere
    assert recorded_run(logs, "pair-1", None) == ref
    assert recorded_run(logs, "pair-1", "ct202") == RunRef("ct202", "pair-1")  # one host's part
    assert latest_or_refuse(logs, None, None) == RunRef("local", "other-1")
    set_latest(logs, ref)
    assert latest_or_refuse(logs, None, None) == ref
    assert latest_or_refuse(logs, "ct202", None) == RunRef("ct202", "pair-1")
    assert json.loads((logs / "ct202" / "pair-1" / "hosts.json").read_text()) == {"hosts": ["ct200", "ct202"]}


def test_a_rank_without_a_record_of_its_own_is_blamed_and_shown_silent():
    gone = peer_failed(peer_rank=1, peer_exc_type=None,
                       peer_message="no sign of life from rank 1 for 30s")
    failed = peer_failed(peer_rank=1, peer_exc_type="KeyError", peer_message="x")
    hosts = ["ct200", "ct202"]
    assert blamed_host(("ct200", gone), hosts) == "ct202"
    assert blamed_host(("ct202", record(1.0, "RuntimeError")), hosts) is None  # a record of its own
    killed = ExitRecord(exit_code=None, signal="SIGKILL", oom_killed=False, ended_at=1.0, exec_error=None)
    assert blamed_line(hosts, killed, ("ct200", gone)) == (
        "no sign of life from rank 1 for 30s (seen by ct200, rank 0); its trainer was killed by SIGKILL, "
        "with no error record of its own")
    assert blamed_line(hosts, None, ("ct200", gone)).endswith("its trainer still runs, with no error record of its own")
    rows = [host_status("ct200", 0, "FAILED", gone.peer_failure()), host_status("ct202", 1, "RUNNING", None)]
    marked = mark_silent_ranks(rows)
    assert [r.state for r in marked] == ["FAILED", "STALLED"] and rows[1].state == "RUNNING"
    assert marked[1].silent == "ct200 (rank 0) stopped hearing from it: no sign of life from rank 1 for 30s"
    assert marked[1].to_json()["state"] == "STALLED" and marked[1].to_json()["silent"] == marked[1].silent
    # A peer that failed with a record of its own is not silent; a row that ended stays as it ended.
    assert mark_silent_ranks([host_status("ct200", 0, "FAILED", failed.peer_failure()), rows[1]])[1].state == "RUNNING"
    assert mark_silent_ranks([rows[0], host_status("ct202", 1, "FAILED", None)])[1].state == "FAILED"


def test_two_ranks_each_silent_to_the_other_are_named_a_network_partition():
    lost_peer = peer_failed(peer_rank=1, peer_exc_type=None, silence_s=30,
                            peer_message="no sign of life from rank 1 for 30s")
    lost_store = peer_failed(peer_rank=0, peer_exc_type=None, silence_s=30,
                             peer_message="the store … did not answer for 30s")
    store_gone = peer_failed(peer_rank=0, peer_exc_type=None, silence_s=None,
                             peer_message="the store … stopped answering: rank 0 is gone")
    hosts = ["ct200", "ct202"]
    exit_1 = ExitRecord(exit_code=1, signal=None, oom_killed=False, ended_at=1.0, exec_error=None)
    assert blamed_line(hosts, exit_1, ("ct200", lost_peer), [lost_store]) == (
        "a network partition: ct202 (rank 1) and ct200 (rank 0) stopped hearing each other while both ran (ct200 "
        "(rank 0): no sign of life from rank 1 for 30s; ct202: the store … did not answer for 30s); its trainer "
        "ended with exit code 1")
    # A rank woken after its peer ended (frozen, not cut off) found the store gone: no partition.
    assert blamed_line(hosts, exit_1, ("ct200", lost_peer), [store_gone]).startswith("no sign of life from rank 1")
    assert peer_failed_line(lost_store, hosts) == "stopped because rank 0 (ct200) went silent: the store … did not " \
                                                  "answer for 30s"
    assert peer_failed_line(store_gone, hosts).startswith("stopped because rank 0 (ct200) is gone: ")


def host_status(host: str, rank: int, state: str, peer_failure: PeerFailure | None) -> HostStatus:
    """A host's row of a run on several hosts whose status is `state`, naming `peer_failure`."""
    status = RunStatus(run_id="pair-1", name="pair", state=RunState(state), reason=None, pid=1, started_at=1.0,
                       ended_at=None, exit=None, errors=0, last_heartbeat=None, release_id=None, source=None,
                       overrides=(), step=None, startup=None, startup_elapsed_s=None, peer_failure=peer_failure,
                       attempt=0, attempts=1, resume_step=None, checkpoint_step=None, export=None)
    return HostStatus(host, rank, "pair-1", status)


# -- launch on ct200 + ct202 ---------------------------------------------------------------

class Pair:
    """A test's inventory with ct200 (address 127.0.0.1: the fake containers share the
    node's network) and ct202, each container's view of the workspace, and the CLI."""

    def __init__(self, make_inventory, ssh_node, fake_pve, tmp_path: Path):
        self.ct202 = {**default_hosts(tmp_path, ssh_node, fake_pve)["ct200"], "container": 202}
        self.hosts = make_inventory(tmp_path, ct200={"address": "127.0.0.1"}, ct202=self.ct202)
        self.rewrite = lambda **ct202: make_inventory(tmp_path, ct200={"address": "127.0.0.1"},
                                                      ct202={**self.ct202, **ct202})
        self.logs = tmp_path / "logs"
        self.pve = fake_pve
        self.workspace = container_workspace(fake_pve, tmp_path)

    def dflash(self, *args: str, **kwargs):
        """The CLI in this process: what these tests check is the run on both hosts."""
        return dflash_in_process("--logs-dir", str(self.logs), *args, hosts=self.hosts, **kwargs)

    def on_node(self, vmid: int, path: str = "") -> Path:
        """`path` under the workspace, as container `vmid` holds it, seen from the node."""
        return self.pve.on_node(vmid, self.workspace) / path

    def run_json(self, vmid: int, run_id: str) -> dict:
        return json.loads((self.on_node(vmid, f"runs/{run_id}") / "run.json").read_text())

    def trainer_alive(self, vmid: int, run_id: str) -> bool:
        record = self.run_json(vmid, run_id)
        return procfs.identity_alive(record["pid"], record["start_time"])


@pytest.fixture
def pair(make_inventory, ssh_node, fake_pve, tmp_path):
    return Pair(make_inventory, ssh_node, fake_pve, tmp_path)


def test_a_host_that_refuses_starts_nothing_anywhere(pair, tmp_path):
    """data.train exists in ct200's filesystem only: ct202's check refuses, and ct200,
    whose check passed, starts nothing either."""
    data = pair.workspace.parent / f"data {tmp_path.name}" / "train.jsonl"
    on_ct200 = pair.pve.on_node(200, data)
    on_ct200.parent.mkdir(parents=True)
    on_ct200.write_text('{"text": "hello world"}\n')
    config = small_config(tmp_path / "refused.yaml", data={"synthetic": None, "train": str(data)})
    done = pair.dflash("launch", "ct200", "ct202", "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert f"host ct202: data.train: {data} does not exist" in done.stderr
    assert "(nothing was deployed or started)" in done.stderr and "host ct200" not in done.stderr
    assert done.stdout == ""
    for vmid in (200, 202):
        assert not pair.on_node(vmid, "runs").exists()
    assert not (pair.logs / "latest.json").exists()


@pytest.mark.slow(seconds=6, why="starts the trainer on one host of two")
def test_a_host_whose_start_fails_stops_the_others(pair, tmp_path):
    """ct202 passes the check but cannot create its run (its runs/ is a file): ct200's
    part, already started, is stopped; no process is left and no run is the latest."""
    pair.on_node(202).mkdir(parents=True)
    pair.on_node(202, "runs").write_text("not a folder\n")
    done = pair.dflash("launch", "ct200", "ct202", "--config", str(small_config(tmp_path / "half.yaml")))
    assert done.returncode != 0 and done.stdout == ""
    assert "host ct202: " in done.stderr and "the run was stopped on ct200" in done.stderr, done.stderr
    (run_id,) = [p.name for p in pair.on_node(200, "runs").iterdir()]
    assert not pair.trainer_alive(200, run_id)
    assert json.loads((pair.on_node(200, f"runs/{run_id}") / "exit.json").read_text())
    status = pair.dflash("status", run_id, "--host", "ct200", "--json")
    assert json.loads(status.stdout)["state"] == "STOPPED"
    assert not (pair.logs / "latest.json").exists()


@pytest.mark.parametrize("host_names, options, messages", [
    (["ct200"], ["--master-port", "29500"], ["--master-addr and --master-port are for a run on several hosts"]),
    (["ct200", "ct200"], [], ["host 'ct200' is named twice"]),
    (["ct200", "ct202"], ["--master-addr", "10.0.0.1; rm"],
     ["--master-addr '10.0.0.1; rm': expected a host name or IP address"]),
    (["ct202", "ct200"], [],  # rank 0 is a container without address
     ["ct202 (rank 0) has no address", "set address: in the inventory entry of ct202"]),
    (["ct200", "ct202"], ["--set", "restart.max=1"],
     ["cannot restart together without a coordinator", "resume it by hand with `dflash resume RUN`"]),
], ids=["one host", "named twice", "bad address", "rank 0 without address", "restart"])
def test_launch_options_for_several_hosts_only(pair, tmp_path, host_names, options, messages):
    config = str(small_config(tmp_path / "one.yaml"))
    done = dflash_in_process("--logs-dir", str(pair.logs), "launch", *host_names, "--config", config, *options,
                             hosts=pair.hosts)
    assert done.returncode == 2, done.stderr
    for message in messages:
        assert message in done.stderr
    assert not pair.on_node(200, "runs").exists() and not pair.on_node(202, "runs").exists()


# -- end to end: the real trainer on both containers ------------------------------------------

def pair_config(path: Path, **changes) -> Path:
    """The small config with data enough for its 4 drafter replicas (2 per host)."""
    synthetic = {"num_train": 64, "num_eval": 2, "prompt_words": 12, "response_tokens": 24}
    return small_config(path, data={"synthetic": synthetic}, **changes)


def launch_pair(pair: Pair, config: Path) -> str:
    done = pair.dflash("launch", "ct200", "ct202", "--config", str(config))
    assert done.returncode == 0, done.stderr
    (run_id,) = done.stdout.splitlines()  # printed once
    return run_id


def events(pair: Pair, vmid: int, run_id: str, kind: str) -> list[dict]:
    """The run's events of `kind` on a host so far."""
    return read_events(pair.on_node(vmid, f"runs/{run_id}") / "events.jsonl", kind)


@pytest.mark.slow(seconds=38, why="a run on two hosts: two trainer processes joined by torch.distributed")
def test_a_run_on_two_hosts_is_one_run(pair, tmp_path):
    # A heartbeat a minute at most: rank 1, which reports no steps, says its own in them.
    run_id = launch_pair(pair, pair_config(tmp_path / "pair.yaml", runtime={"heartbeat_s": 60}))
    layouts = [pair.run_json(vmid, run_id)["distributed"] for vmid in (200, 202)]
    port = layouts[0]["master_port"]
    assert layouts == [{"rank": rank, "world_size": 2, "master_addr": "127.0.0.1", "master_port": port,
                        "hosts": ["ct200", "ct202"]} for rank in (0, 1)]
    watch = pair.dflash("watch")  # the latest run: both hosts
    assert watch.returncode == 0, watch.stderr
    assert f"run {run_id} ended: SUCCEEDED (ct200 SUCCEEDED, ct202 SUCCEEDED)" in watch.stderr
    for host, vmid in (("ct200", 200), ("ct202", 202)):
        log = (pair.on_node(vmid, f"runs/{run_id}") / "train.log").read_text()
        shown = [line[len(host) + 2:] for line in watch.stdout.splitlines() if line.startswith(f"{host}| ")]
        assert shown == log.splitlines()  # every line of each host, once, prefixed with it
    # Every replica on both hosts ends with the same weights.
    checksums = [sha for vmid in (200, 202) for sha in events(pair, vmid, run_id, "replicas")[-1]["sha256"]]
    assert len(checksums) == 4 and len(set(checksums)) == 1, checksums
    status = pair.dflash("status", run_id, "--json")
    assert status.returncode == 0, status.stderr
    found = json.loads(status.stdout)
    assert found["state"] == "SUCCEEDED"
    assert [(s["host"], s["rank"], s["state"]) for s in found["hosts"]] == [
        ("ct200", 0, "SUCCEEDED"), ("ct202", 1, "SUCCEEDED")]
    last = events(pair, 200, run_id, "step")[-1]["step"]
    assert [s["step"] for s in found["hosts"]] == [last, last]  # the step each rank reached: the run's last
    # Rank 0 writes the export; `pull RUN` fetches it from there.
    pulled = pair.dflash("pull", run_id)
    assert pulled.returncode == 0, pulled.stderr
    assert (pair.logs / "ct200" / run_id / "export" / "model.safetensors").exists()
    assert not (pair.on_node(202, f"runs/{run_id}") / "export").exists()


@pytest.mark.slow(seconds=37, why="a run on two hosts: two trainer processes joined by torch.distributed")
def test_a_drafter_failing_on_the_second_host_stops_the_first_and_is_shown_naming_it(pair, tmp_path):
    fault = {"thread": "drafter-1", "at": "step:2", "kind": "raise", "depth": 30, "rank": 1}
    config = pair_config(tmp_path / "fault.yaml", optim={"max_steps": 200, "epochs": 50}, faults=[fault])
    run_id = launch_pair(pair, config)
    watch = subprocess.Popen(dflash_argv("--logs-dir", str(pair.logs), "watch", run_id, hosts=pair.hosts),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dflash_env())
    try:
        errors = pair.on_node(202, f"runs/{run_id}") / "errors.jsonl"
        wait_until(lambda: errors.exists() and errors.read_text().strip(), 240, "ct202's error record")
        # ct200's trainer, not failing itself, is gone within seconds of its peer's failure.
        wait_until(lambda: not pair.trainer_alive(200, run_id), 30, "ct200's trainer to end")
        stdout, stderr = watch.communicate(timeout=120)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 1, stderr
    root = json.loads(errors.read_text().splitlines()[0])
    assert root["thread"] == "drafter-1" and root["exc_type"] != "PeerFailed"
    assert root["traceback"].count(", in _descend_") >= 30
    assert root["traceback"] in stdout  # whole, not prefixed, not cut by ct200's lines
    assert f"==> run {run_id} on ct202: thread drafter-1 failed in " in stdout
    assert "root cause on ct202 (rank 1): thread drafter-1" in stderr
    peer = [json.loads(line) for line in
            (pair.on_node(200, f"runs/{run_id}") / "errors.jsonl").read_text().splitlines()]
    assert peer[0]["exc_type"] == "PeerFailed" and peer[0]["detail"]["peer_rank"] == 1
    assert "ct200| " in stderr and "stopped because rank 1 (ct202) failed" in stderr
    fetched = pair.dflash("fetch-traceback", run_id)
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout == f"{fetched.stdout.splitlines()[0]}\n{root['traceback']}"
    assert fetched.stdout.startswith(f"==> run {run_id} on ct202: thread drafter-1 failed")
    assert "root cause on ct202 (rank 1 of 2)" in fetched.stderr
    assert "diagnosis" not in stderr + fetched.stderr  # an injected fault is no failure the CLI knows
    # ct200's part alone holds only ct200 stopping for ct202: its line points at ct202's record.
    stopped = pair.dflash("fetch-traceback", run_id, "--host", "ct200").stderr.splitlines()[-1]
    assert stopped.startswith("diagnosis: rank 1 (ct202) failed first (InjectedFault: injected fault in drafter-1")
    assert stopped.endswith(f"its traceback: `dflash fetch-traceback {shlex.quote(run_id)} --host ct202`")
    status = pair.dflash("status", run_id, "--json")
    assert status.returncode == 1 and json.loads(status.stdout)["state"] == "FAILED"


@pytest.mark.slow(seconds=26, why="a run on two hosts: two trainer processes joined by torch.distributed")
def test_stop_leaves_no_process_on_either_host(pair, tmp_path):
    config = pair_config(tmp_path / "long.yaml", optim={"max_steps": 100000, "epochs": 5000})
    run_id = launch_pair(pair, config)

    def state() -> str:
        return json.loads(pair.dflash("status", run_id, "--json").stdout)["state"]

    # Rank 0 reports the steps of the whole run (they are one run's steps).
    wait_until(lambda: len(events(pair, 200, run_id, "step")) >= 2 and state() == "RUNNING", 240,
             "both hosts to train")
    stopped = pair.dflash("stop", "--grace", "5")  # the latest run: both hosts
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == "STOPPED\n"
    for vmid in (200, 202):
        record = pair.run_json(vmid, run_id)
        assert not procfs.is_running(procfs.read_stat(record["pid"]))
        assert procfs.group_members(record["pgid"]) == []
    status = pair.dflash("status", run_id)
    assert (status.returncode, status.stdout) == (4, "STOPPED\n")
    # A host that cannot be asked: the run's state is unknown (exit 3), that host named.
    pair.rewrite(ssh=f"root@127.0.0.1:{free_port()}", connect_timeout=1.0)
    status = pair.dflash("status", run_id, "--json")
    found = json.loads(status.stdout)
    assert status.returncode == 3 and found["state"] == "UNKNOWN"
    assert [s["state"] for s in found["hosts"]] == ["STOPPED", None]
    assert found["hosts"][1]["error"].startswith("host ct202 (") and "unreachable" in found["hosts"][1]["error"]


@pytest.mark.slow(seconds=20, why="a run on two hosts: two trainer processes started, then stopped")
def test_a_run_on_two_hosts_whose_second_left_the_inventory_goes_on_with_the_first(pair, make_inventory, tmp_path):
    """ct202 leaves hosts.yaml while the run is live: status, stop, watch and fetch-traceback
    of the latest run go on with ct200, naming ct202 and why it was asked; resume, which
    needs both, is refused."""
    run_id = launch_pair(pair, pair_config(tmp_path / "long.yaml", optim={"max_steps": 100000, "epochs": 5000}))
    assert make_inventory(tmp_path, ct200={"address": "127.0.0.1"}) == pair.hosts  # ct202 is gone from it
    gone = (f"the latest run {run_id} ({pair.logs / 'latest.json'}) ran on ct202 (rank 1 of 2), which is not in "
            f"{pair.hosts}")
    try:
        status = pair.dflash("status", "--json")
        found = json.loads(status.stdout)
        assert status.returncode == 2 and found["state"] == "UNKNOWN", status.stderr
        assert (found["hosts"][0]["host"], found["hosts"][0]["state"]) in [("ct200", "STARTING"), ("ct200", "RUNNING")]
        assert found["hosts"][1] == {"host": "ct202", "rank": 1, "run_id": run_id, "state": None, "error": gone}
        resume = pair.dflash("resume")
        assert resume.returncode == 2
        assert resume.stderr.startswith(f"dflash: error: {gone}\nhint: add ct202 back to {pair.hosts}, ")
        stopped = pair.dflash("stop", "--grace", "5")
        assert (stopped.returncode, stopped.stdout) == (2, "UNKNOWN\n"), stopped.stderr
        assert re.search(rf"run {run_id} on ct200 (ended|killed after the grace period): STOPPED", stopped.stderr)
        assert f"warning: run {run_id} on ct202: not stopped: {gone}" in stopped.stderr
        assert not pair.trainer_alive(200, run_id)
        watch = pair.dflash("watch")
        assert watch.returncode == 2, watch.stderr
        assert f"warning: {gone}: its part is not followed" in watch.stderr
        assert f"run {run_id} ended: UNKNOWN (ct200 STOPPED, ct202 UNKNOWN)" in watch.stderr
        fetched = pair.dflash("fetch-traceback")
        assert fetched.returncode == 0, fetched.stderr
        assert f"warning: run {run_id} on ct202: no report: {gone}" in fetched.stderr
        assert "unknown host" not in status.stderr + stopped.stderr + watch.stderr + fetched.stderr
    finally:
        pair.rewrite()
        pair.dflash("stop", "--grace", "5")  # ct202's part too


@pytest.mark.slow(seconds=57,
                  why="a run on two hosts (two trainer processes joined by torch.distributed), then its resume")
def test_a_run_on_two_hosts_resumes_as_one_from_rank_0s_checkpoint(pair, tmp_path):
    """Stopped after its checkpoint at step 2 (both hosts hang before step 4 in attempt
    0): `dflash resume RUN` is refused while it is live and for a step rank 0 has no
    checkpoint of, starting nothing; then it resumes both hosts as attempt 1 from one step."""
    hang = [{"thread": "prefetch", "at": "step:4", "kind": "hang", "attempt": 0}]
    run_id = launch_pair(pair, pair_config(tmp_path / "resumed.yaml", checkpoint={"every": 2}, faults=hang))
    wait_until(lambda: 3 in [e["step"] for e in events(pair, 200, run_id, "step")], 240, "step 3 on rank 0")

    def attempts() -> list[int]:
        return [pair.run_json(vmid, run_id)["attempt"] for vmid in (200, 202)]

    live = pair.dflash("resume", run_id)
    assert live.returncode == 2 and "is still live (RUNNING): stop it first" in live.stderr, live.stderr
    assert "nothing was started on any host" in live.stderr and attempts() == [0, 0]
    assert pair.dflash("stop", run_id, "--grace", "20").stdout == "STOPPED\n"
    missing = pair.dflash("resume", run_id, "--step", "1")
    assert missing.returncode == 2 and f"run '{run_id}' has no complete checkpoint at step 1" in missing.stderr
    assert "nothing was started on any host" in missing.stderr and attempts() == [0, 0]
    alone = pair.dflash("resume", run_id, "--host", "ct202")  # one host's part
    assert alone.returncode == 2 and "resume it on all of them together" in alone.stderr, alone.stderr
    assert attempts() == [0, 0]
    newest = max(int(p.name[len("step_"):]) for p in pair.on_node(200, f"runs/{run_id}/checkpoints").glob("step_*"))
    assert not pair.on_node(202, f"runs/{run_id}/checkpoints").exists()  # rank 0 alone holds them

    resumed = pair.dflash("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"run {run_id} (STOPPED) resumed as attempt 1 on 2 hosts from rank 0's checkpoint at step {newest}"
            in resumed.stderr)
    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert f"run {run_id} ended: SUCCEEDED (ct200 SUCCEEDED, ct202 SUCCEEDED)" in watch.stderr
    records = [pair.run_json(vmid, run_id) for vmid in (200, 202)]
    assert [[(a["attempt"], a["reason"], a["resume_from"] and a["resume_from"]["step"]) for a in r["attempts"]]
            for r in records] == [[(0, "launch", None), (1, "resume", newest)]] * 2
    layouts = [r["distributed"] for r in records]
    assert layouts[0]["master_port"] == layouts[1]["master_port"] and [l["rank"] for l in layouts] == [0, 1]
    steps = [e["step"] for e in events(pair, 200, run_id, "step")]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] > newest  # each step once, across the attempts
    checksums = [sha for vmid in (200, 202) for sha in events(pair, vmid, run_id, "replicas")[-1]["sha256"]]
    assert len(checksums) == 4 and len(set(checksums)) == 1, checksums
    status = pair.dflash("status", run_id, "--json")
    assert [(s["host"], s["state"]) for s in json.loads(status.stdout)["hosts"]] == [
        ("ct200", "SUCCEEDED"), ("ct202", "SUCCEEDED")]
    # Succeeded: rank 0 refuses a resume without --step, so no host starts one.
    finished = pair.dflash("resume", run_id)
    assert finished.returncode == 2, finished.stderr
    assert f"run '{run_id}' succeeded at step {steps[-1]}; nothing to resume" in finished.stderr
    assert "nothing was started on any host" in finished.stderr and attempts() == [1, 1]
    assert f"dflash resume {run_id} --step N" in finished.stderr


# -- a rank killed, or frozen: the root cause is that rank, never a survivor ---------------

def error_records(pair: Pair, vmid: int, run_id: str) -> list[dict]:
    path = pair.on_node(vmid, f"runs/{run_id}") / "errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow(seconds=60, why="a run on two hosts, one rank SIGKILLed mid-run, then the run resumed")
def test_a_rank_killed_mid_run_is_the_root_cause_until_a_resume_succeeds(pair, tmp_path):
    config = pair_config(tmp_path / "killed.yaml", optim={"max_steps": 40, "epochs": 50}, checkpoint={"every": 2})
    run_id = launch_pair(pair, config)
    wait_until(lambda: len(events(pair, 200, run_id, "step")) >= 3, 240, "rank 0's third step")
    os.kill(pair.run_json(202, run_id)["pid"], signal.SIGKILL)

    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 1, watch.stderr
    # ct200 broke its all-reduce on the dead peer: it names that peer, whose alive count stopped.
    [noticed] = error_records(pair, 200, run_id)
    assert noticed["exc_type"] == "PeerFailed" and noticed["detail"]["peer_rank"] == 1, noticed
    assert error_records(pair, 202, run_id) == []
    cause = [line for line in watch.stderr.splitlines() if line.startswith("root cause on ")]
    assert len(cause) == 1 and cause[0].startswith("root cause on ct202 (rank 1): ")
    assert cause[0].endswith("(seen by ct200, rank 0); its trainer was killed by SIGKILL, with no error record of "
                             "its own"), cause
    assert f"==> run {run_id} on ct202: no error record; state FAILED <==" in watch.stdout

    fetched = pair.dflash("fetch-traceback", run_id)
    assert fetched.returncode == 1, fetched.stderr
    assert "root cause on ct202 (rank 1 of 2): " in fetched.stderr
    assert fetched.stdout.startswith(f"==> run {run_id} on ct202: no error record; state FAILED <==")
    assert "process ended: killed by SIGKILL" in fetched.stdout
    every = pair.dflash("fetch-traceback", run_id, "--all")  # every host: ct202's end too
    assert f"on ct200: thread {noticed['thread']} failed" in every.stdout
    assert "process ended: killed by SIGKILL" in every.stdout and "on ct202: no error record" in every.stdout

    resumed = pair.dflash("resume", run_id)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert f"run {run_id} ended: SUCCEEDED (ct200 SUCCEEDED, ct202 SUCCEEDED)" in watch.stderr
    assert "root cause" not in watch.stderr  # the first attempt's is history


@pytest.mark.slow(seconds=30, why="a run on two hosts whose rank 1 is SIGKILLed during start-up")
def test_a_rank_killed_during_start_up_ends_its_peer_within_seconds(pair, tmp_path):
    """Rank 0 waits in the join for a rank that will never come (join_timeout_s: 600 s):
    the dead rank's supervisor tells it on the store, and it ends naming that rank."""
    run_id = launch_pair(pair, pair_config(tmp_path / "early.yaml"))
    os.kill(pair.run_json(202, run_id)["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not pair.trainer_alive(200, run_id), 90, "rank 0's trainer to end")
    assert time.monotonic() - killed < 60
    [noticed] = error_records(pair, 200, run_id)
    assert noticed["exc_type"] == "PeerFailed" and noticed["phase"] == "startup"
    assert noticed["detail"]["peer_rank"] == 1 and noticed["detail"]["peer_exc_type"] is None
    # the inventory's name of that host, which the user knows, not the machine's own
    assert noticed["detail"]["peer_message"] == "the trainer on ct202 was killed by SIGKILL", noticed
    status = pair.dflash("status", run_id, "--json")
    assert status.returncode == 1
    assert [h["state"] for h in json.loads(status.stdout)["hosts"]] == ["FAILED", "FAILED"]
    fetched = pair.dflash("fetch-traceback", run_id)
    assert "root cause on ct202 (rank 1 of 2): the trainer on ct202 was killed by SIGKILL" in fetched.stderr
    assert "its trainer was killed by SIGKILL, with no error record of its own" in fetched.stderr


@pytest.mark.slow(seconds=45, why="a run on two hosts whose rank 1 is frozen (SIGSTOP) until its peer gives up")
def test_a_frozen_rank_is_stalled_on_its_row_and_the_silence_is_the_root_cause(pair, tmp_path):
    config = pair_config(tmp_path / "frozen.yaml", optim={"max_steps": 100000, "epochs": 5000},
                         distributed={"peer_timeout_s": 6})
    run_id = launch_pair(pair, config)
    wait_until(lambda: len(events(pair, 200, run_id, "step")) >= 2, 240, "both hosts to train")
    frozen = pair.run_json(202, run_id)["pid"]
    os.kill(frozen, signal.SIGSTOP)
    try:
        # Its own host sees it stopped at once, before any peer timeout.
        status = json.loads(pair.dflash("status", run_id, "--json").stdout)
        assert [(h["host"], h["state"]) for h in status["hosts"]] == [("ct200", "RUNNING"), ("ct202", "STALLED")]
        wait_until(lambda: not pair.trainer_alive(200, run_id), 60, "rank 0 to give up on rank 1")
        [noticed] = error_records(pair, 200, run_id)
        assert noticed["exc_type"] == "PeerFailed" and noticed["detail"]["peer_rank"] == 1
        assert "no sign of life from rank 1 for 6s" in noticed["detail"]["peer_message"]
        done = pair.dflash("status", run_id, "--json")
        found = json.loads(done.stdout)
        assert done.returncode == 1 and [h["state"] for h in found["hosts"]] == ["FAILED", "STALLED"]
        assert found["hosts"][1]["silent"].startswith("ct200 (rank 0) stopped hearing from it: no sign of life")
    finally:
        os.kill(frozen, signal.SIGCONT)
    # Woken, it finds rank 0 (and its store) gone: a PeerFailed of its own, never a raw c10d error.
    wait_until(lambda: not pair.trainer_alive(202, run_id), 60, "rank 1 to end once woken")
    woken = error_records(pair, 202, run_id)
    assert woken and {r["exc_type"] for r in woken} == {"PeerFailed"}, woken
    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 1
    assert ("root cause on ct202 (rank 1): no sign of life from rank 1 for 6s (killed, frozen, or cut off by the "
            "network) (seen by ct200, rank 0); its trainer ended with exit code 1, with no error record of its own"
            ) in watch.stderr
    assert "network partition" not in watch.stderr  # woken, it found rank 0 gone: it was not cut off


# -- job: regenerate on two hosts ---------------------------------------------------------------

def regen_pair_config(pair: Pair, path: Path, output: str) -> Path:
    """The tiny target answers the committed synthetic prompts (relative: each host's release)."""
    path.write_text(yaml.safe_dump({
        "job": "regenerate", "target": {"tiny": {}, "dtype": "float32"}, "devices": {"target": ["cpu"]},
        "regenerate": {"prompts": "configs/data/tiny-prompts.jsonl", "output": f"{pair.workspace}/{output}",
                       "max_new_tokens": 40, "batch_size": 5},
        "runtime": {"heartbeat_s": 1, "torch_threads": 1}}))
    return path


@pytest.mark.slow(seconds=40, why="a regeneration on two hosts, and the same on one")
def test_a_regeneration_on_two_hosts_answers_each_prompt_once_into_one_file_on_rank_0(pair, tmp_path):
    run_id = launch_pair(pair, regen_pair_config(pair, tmp_path / "regen-pair.yaml", "pair.jsonl"))
    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 0, watch.stderr
    assert f"run {run_id} ended: SUCCEEDED (ct200 SUCCEEDED, ct202 SUCCEEDED)" in watch.stderr
    rows = [json.loads(line) for line in pair.on_node(200, "pair.jsonl").read_text().splitlines()]
    prompts = (REPO / "configs" / "data" / "tiny-prompts.jsonl").read_text().splitlines()
    assert [row["index"] for row in rows] == list(range(len(prompts)))  # each once, in prompt order
    assert not pair.on_node(202, "pair.jsonl").exists()  # rank 1 sent its answers to rank 0
    log1 = (pair.on_node(202, f"runs/{run_id}") / "train.log").read_text()
    assert f"{len(prompts) // 2} of them on this host (rank 1 of 2)" in log1
    # The same prompts answered on one host: the same bytes.
    one = pair.dflash("launch", "ct200", "--config", str(regen_pair_config(pair, tmp_path / "regen-one.yaml",
                                                                            "one.jsonl")), "--follow")
    assert one.returncode == 0, one.stderr
    assert pair.on_node(200, "one.jsonl").read_bytes() == pair.on_node(200, "pair.jsonl").read_bytes()


@pytest.mark.slow(seconds=45, why="a regeneration on two hosts whose second fails, relaunched, and one on one host")
def test_a_regeneration_whose_second_host_failed_is_completed_by_a_relaunch_without_a_prompt_twice(pair, tmp_path):
    """Rank 1 fails at its 3rd decode step: rank 0 ends too (PeerFailed), its output holds
    whole answers in prompt order up to the first one missing; launching the same config
    again answers only the rest, and the file is what one unbroken run writes."""
    config = regen_pair_config(pair, tmp_path / "regen-fault.yaml", "broken.jsonl")
    text = yaml.safe_load(config.read_text())
    text["faults"] = [{"thread": "target-0", "at": "step:3", "kind": "raise", "rank": 1}]
    config.write_text(yaml.safe_dump(text))
    run_id = launch_pair(pair, config)
    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 1, watch.stderr
    assert "root cause on ct202 (rank 1)" in watch.stderr and "InjectedFault" in watch.stderr
    output = pair.on_node(200, "broken.jsonl")
    before = [json.loads(line)["index"] for line in output.read_text().splitlines()] if output.exists() else []
    prompts = (REPO / "configs" / "data" / "tiny-prompts.jsonl").read_text().splitlines()
    assert before == list(range(len(before))) and len(before) < len(prompts)
    again = launch_pair(pair, regen_pair_config(pair, tmp_path / "regen-again.yaml", "broken.jsonl"))
    assert pair.dflash("watch", again).returncode == 0
    assert f"{len(before)} already answered" in (pair.on_node(200, f"runs/{again}") / "train.log").read_text()
    one = pair.dflash("launch", "ct200", "--config", str(regen_pair_config(pair, tmp_path / "regen-one.yaml",
                                                                            "whole.jsonl")), "--follow")
    assert one.returncode == 0, one.stderr
    assert output.read_bytes() == pair.on_node(200, "whole.jsonl").read_bytes()


@pytest.mark.slow(seconds=40, why="an evaluation on two hosts and the same on one")
def test_an_evaluation_on_two_hosts_pools_both_shares_into_rank_0s_eval_json(pair, tmp_path):
    """Each host decodes every second prompt; rank 0's eval.json holds the figures of all
    of them, the same as one host measuring them all (the CPU decodes deterministically)."""
    import torch
    from transformers import AutoConfig

    from dflash_train.config import load_job_config
    from dflash_train.data.tiny import ensure_tiny_assets
    from dflash_train.model.drafter import DFlashDrafter, default_target_layer_ids, drafter_hf_config, export_drafter
    from support.train_configs import TINY_CPU

    spec = load_job_config(TINY_CPU)
    assets = ensure_tiny_assets(spec.target.tiny, spec.data.synthetic, tmp_path / "cache")
    target = AutoConfig.from_pretrained(str(assets.target_dir))
    layers = default_target_layer_ids(target.num_hidden_layers, spec.drafter.num_target_features or 1)
    drafter = DFlashDrafter(drafter_hf_config(target, spec.drafter, layers, mask_token_id=0))
    drafter.reset_parameters(torch.Generator().manual_seed(0))
    folder = pair.workspace.parent / f"drafter {tmp_path.name}"
    for vmid in (200, 202):
        export_drafter(drafter, pair.pve.on_node(vmid, folder))
    text = TINY_CPU.read_text()
    config = tmp_path / "eval.yaml"
    config.write_text(text[text.index("target:"):text.index("drafter:")] + "job: evaluate\nevaluate: "
                      f"{{drafter: {json.dumps(str(folder))}, max_new_tokens: 24, num_prompts: 6}}\n")
    run_id = launch_pair(pair, config)
    watch = pair.dflash("watch", run_id)
    assert watch.returncode == 0, watch.stderr
    pooled = json.loads((pair.on_node(200, f"runs/{run_id}") / "eval.json").read_text())
    assert not (pair.on_node(202, f"runs/{run_id}") / "eval.json").exists()
    assert "rank 1 of 2: 3 of the 6 prompts" in (pair.on_node(202, f"runs/{run_id}") / "train.log").read_text()
    one = pair.dflash("launch", "ct200", "--config", str(config), "--follow")
    assert one.returncode == 0, one.stderr
    (alone_id,) = [line for line in one.stdout.splitlines() if line.strip()][:1]
    alone = json.loads((pair.on_node(200, f"runs/{alone_id.strip()}") / "eval.json").read_text())
    assert pooled["hosts"] == 2 and alone["hosts"] == 1 and pooled["prompts"] == alone["prompts"] == 6
    for key in ("verify_steps", "new_tokens", "acceptance_length"):
        assert pooled[key] == alone[key], key
    assert pooled["mean_per_prompt"] == pytest.approx(alone["mean_per_prompt"], abs=1e-4)
    assert sorted(pooled["per_prompt"]) == sorted(alone["per_prompt"])


# -- a network partition: both ranks alive, the link between them down ----------------------

@pytest.fixture
def cut_pair(make_inventory, ssh_node, fake_pve, tmp_path):
    """ct200 on the node's end of a link (its address there is the rendezvous) and ct206,
    a container in a network namespace, on the other end: a pair whose link a test can
    take down. Each host's gloo uses its end of the link."""
    with linked_namespace() as link:
        vmid = fake_pve.add_netns_container(link.path)
        try:
            pair = Pair(make_inventory, ssh_node, fake_pve, tmp_path)
            ct206 = {**default_hosts(tmp_path, ssh_node, fake_pve)["ct200"], "container": vmid,
                     "env": {**HOST_ENV, "GLOO_SOCKET_IFNAME": link.inside}}
            pair.hosts = make_inventory(tmp_path, ct200={"address": link.node_address,
                                                         "env": {**HOST_ENV, "GLOO_SOCKET_IFNAME": link.node_side}},
                                        ct206=ct206)
            yield pair, link, vmid
        finally:
            fake_pve.remove_container(vmid)


@pytest.mark.slow(seconds=50, why="a run on two hosts, the link between them taken down mid-run until both end")
def test_a_rank_cut_off_by_the_network_ends_within_the_peer_timeout_and_watch_names_the_partition(cut_pair, tmp_path):
    pair, link, vmid = cut_pair
    timeout_s, grace_s = 6, 2
    config = pair_config(tmp_path / "cut.yaml", optim={"max_steps": 100000, "epochs": 5000},
                         distributed={"peer_timeout_s": timeout_s}, runtime={"stop_grace_s": grace_s})
    launched = pair.dflash("launch", "ct200", "ct206", "--config", str(config))
    assert launched.returncode == 0, launched.stderr
    (run_id,) = launched.stdout.splitlines()
    records = {vmid: pair.run_json(vmid, run_id) for vmid in (200, vmid)}
    try:
        wait_until(lambda: len(events(pair, 200, run_id, "step")) >= 2, 240, "both hosts to train")
        link.down()
        cut = time.monotonic()
        # Each rank notices the other's silence (rank 1: its store's) within the peer
        # timeout, and ends within its stop grace after: long before the link returns.
        wait_until(lambda: not pair.trainer_alive(vmid, run_id), 60, "rank 1 to end while its link is down")
        assert time.monotonic() - cut < timeout_s + grace_s + 15
        wait_until(lambda: not pair.trainer_alive(200, run_id), 30, "rank 0 to end")
        [lost_store] = error_records(pair, vmid, run_id)
        assert lost_store["exc_type"] == "PeerFailed" and lost_store["detail"]["silence_s"] == timeout_s
        assert lost_store["detail"]["peer_rank"] == 0 and lost_store["detail"]["peer_exc_type"] is None
        assert lost_store["detail"]["peer_message"] == (
            f"the store that rank 0 hosts at {link.node_address}:{records[200]['distributed']['master_port']} did "
            f"not answer for {timeout_s}s (the network to its host is cut, or that host froze)")
        [lost_peer] = error_records(pair, 200, run_id)
        assert lost_peer["exc_type"] == "PeerFailed" and lost_peer["detail"]["silence_s"] == timeout_s
        assert lost_peer["detail"]["peer_message"] == (f"no sign of life from rank 1 for {timeout_s}s (killed, "
                                                       "frozen, or cut off by the network)")
        for host_vmid in records:  # its supervisor writes exit.json once it saw the trainer end
            exit_json = pair.on_node(host_vmid, f"runs/{run_id}") / "exit.json"
            wait_until(exit_json.exists, 30, f"ct{host_vmid}'s exit.json")
            assert json.loads(exit_json.read_text())["exit_code"] == 1

        # The link still down: the CLI reaches each host over SSH and pct, not through it.
        watch = pair.dflash("watch", run_id)
        assert watch.returncode == 1, watch.stderr
        said = " ".join(watch.stderr.split())
        partition = ("a network partition: ct206 (rank 1) and ct200 (rank 0) stopped hearing each other while both "
                     "ran", "a network partition: ct200 (rank 0) and ct206 (rank 1) stopped hearing each other while "
                     "both ran")
        cause = next(line for line in watch.stderr.splitlines() if line.startswith("root cause on "))
        assert any(text in cause for text in partition), cause
        assert "no sign of life from rank 1 for 6s" in cause and "did not answer for 6s" in cause
        assert "its trainer ended with exit code 1" in cause and "still runs" not in said
        assert "ct206| thread watchdog: stopped because rank 0 (ct200) went silent: the store that rank 0" in said
        fetched = pair.dflash("fetch-traceback", run_id)
        assert fetched.returncode == 1 and any(text in " ".join(fetched.stderr.split()) for text in partition)
    finally:
        link.up()
        for host, record in records.items():  # a rank that did not end (the fault this test is for) is ended
            if procfs.identity_alive(record["pid"], record["start_time"]):
                os.killpg(record["pgid"], signal.SIGKILL)
