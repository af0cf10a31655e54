"""`launch`: detaching, run.json before the trainer starts, the trainer's environment,
exit.json for every way a run ends, argument errors, and resource locks."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from dflash_agent import preflight
from dflash_files import checksums, procfs
from dflash_files.checkpoint_files import LOADED_FILES
from support.disk import fill, tmpfs
from support_agent.harness import agent  # noqa: F401  (fixture)
from support_agent.harness import RELEASE_ID, Agent, dead_pid, make_workspace
from support.wait import wait_until

pytestmark = pytest.mark.timeout(60)

WAIT = [{"wait_file": "go"}]
SOURCE = {"kind": "checkout", "path": "/home/me/dflash", "release_id": RELEASE_ID, "dflash_version": None,
          "git_commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True, "diff_sha256": "ab" * 32,
          "modified": ["remote/dflash_train/x.py"], "modified_count": 1, "git_problem": None}


def fd_target(pid: int, fd: int) -> str:
    return os.readlink("/proc/%d/fd/%d" % (pid, fd))


def test_launch_detaches_and_returns_once_run_json_exists(agent):
    run_id = "detach 'me' \"now\""
    agent.track(run_id)
    # Under pipes, as over SSH: communicate() returns only when every holder of the
    # pipes' write ends is gone, so a supervisor or trainer keeping them would hang here.
    proc = subprocess.Popen(agent.argv(*agent.launch_args(run_id, WAIT, "--name", "my run")),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=agent.env)
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    answer = json.loads(out)
    run_dir = agent.run_dir(run_id)
    assert answer == {"run_id": run_id, "run_dir": str(run_dir), "pid": answer["pid"],
                      "pgid": answer["pid"], "release_id": RELEASE_ID}
    pid = answer["pid"]
    assert procfs.identity_alive(pid, None), "the trainer must outlive the launch verb"

    record = agent.read(run_id, "run.json")
    wait_until(lambda: (run_dir / "standin.json").exists())
    started = agent.read(run_id, "standin.json")
    assert started["run_json_existed"] is True
    assert started["pid"] == pid == record["pid"]
    assert started["pgid"] == started["sid"] == pid  # its own session and group
    assert started["stdin"] == "/dev/null"
    assert started["stdout"] == str(run_dir / "train.log")
    assert started["cwd"] == str(run_dir)
    remote = agent.workspace / "releases" / RELEASE_ID / "remote"
    assert started["env"] == {
        "PYTHONPATH": str(remote), "PYTHONUNBUFFERED": "1", "DFLASH_RUN_ID": run_id,
        "DFLASH_RELEASE_ID": RELEASE_ID, "DFLASH_RELEASE_DIR": str(remote.parent),
        "DFLASH_WORKSPACE": str(agent.workspace), "STANDIN_EXTRA": None}
    assert started["argv"] == ["--config", str(run_dir / "config.yaml"), "--run-dir", str(run_dir)]

    assert record["start_time"] == procfs.read_stat(pid).start_time
    assert record["boot_id"] == procfs.boot_id()
    assert record["pgid"] == pid and record["name"] == "my run" and record["release_id"] == RELEASE_ID
    assert record["config"] == (run_dir / "config.yaml").read_text() == json.dumps({"steps": WAIT})
    assert record["argv"][1:] == ["-m", "dflash_train", "--config", str(run_dir / "config.yaml"),
                                  "--run-dir", str(run_dir)]
    assert record["stall_after"] == 300.0 and record["host"] and record["started_at"] <= time.time()
    assert record["overrides"] == []

    supervisor = record["supervisor"]["pid"]
    assert fd_target(supervisor, 0) == "/dev/null"
    assert fd_target(supervisor, 1) == fd_target(supervisor, 2) == str(run_dir / "agent.log")
    stat = procfs.read_stat(supervisor)
    assert stat.session != os.getsid(0) and stat.session != supervisor  # detached, not a leader
    agent.touch(run_id, "go")
    assert agent.wait_state(run_id, "SUCCEEDED")["exit"]["exit_code"] == 0


@pytest.mark.parametrize("steps, exit_code, signal_name", [
    ([{"print": "bye"}], 0, None),
    ([{"exit": 3}], 3, None),
    ([{"kill_self": "SIGKILL"}], None, "SIGKILL"),
    ([{"kill_self": "SIGABRT"}], None, "SIGABRT"),
])
def test_exit_json_records_how_the_trainer_ended(agent, steps, exit_code, signal_name):
    agent.launch("r", steps)
    status = agent.wait_state("r", "SUCCEEDED", "FAILED")
    exit_record = agent.read("r", "exit.json")
    assert exit_record["exit_code"] == exit_code
    assert exit_record["signal"] == signal_name
    assert exit_record["oom_killed"] is False  # SIGKILL alone is not an OOM kill
    assert exit_record["exec_error"] is None
    assert exit_record["ended_at"] >= agent.read("r", "run.json")["started_at"]
    assert status["state"] == ("SUCCEEDED" if exit_code == 0 else "FAILED")
    assert status["ended_at"] == exit_record["ended_at"]


def test_exec_failure_is_in_exit_json_and_train_log(agent):
    answer = agent.launch("noexec", WAIT, "--python", "/nonexistent/python3")
    status = agent.wait_state("noexec", "FAILED")
    exit_record = status["exit"]
    assert exit_record["exit_code"] == 127 and exit_record["signal"] is None
    assert "No such file" in exit_record["exec_error"]
    log = (agent.run_dir("noexec") / "train.log").read_text()
    assert "cannot start the trainer" in log and "/nonexistent/python3" in log
    assert not procfs.identity_alive(answer["pid"], None)


def test_env_pairs_reach_the_trainer_but_only_their_keys_are_recorded(agent):
    agent.launch("env", [], "--env", "STANDIN_EXTRA=s3cr=t value", "--env", "PYTHONUNBUFFERED=1")
    agent.wait_state("env", "SUCCEEDED")
    assert agent.read("env", "standin.json")["env"]["STANDIN_EXTRA"] == "s3cr=t value"
    record = agent.read("env", "run.json")
    assert record["env_keys"] == ["STANDIN_EXTRA", "PYTHONUNBUFFERED"]
    assert "s3cr=t" not in (agent.run_dir("env") / "run.json").read_text()


def test_config_from_stdin_and_relative_to_the_release(agent):
    script = json.dumps({"steps": [{"print": "from stdin"}]}).encode()
    agent.track("stdin")
    agent.ok("launch", "--run-id", "stdin", "--config", "-", stdin=script)
    assert agent.wait_state("stdin", "SUCCEEDED")
    assert (agent.run_dir("stdin") / "config.yaml").read_bytes() == script
    release_configs = agent.workspace / "current" / "configs"
    release_configs.mkdir()
    (release_configs / "c.yaml").write_text(json.dumps({"steps": [{"print": "relative"}]}))
    agent.launch("relative", [], "--config", "configs/c.yaml")  # the later --config wins
    agent.wait_state("relative", "SUCCEEDED")
    assert (agent.run_dir("relative") / "train.log").read_text() == "relative\n"


def test_runs_keep_their_release_when_current_moves(agent):
    agent.launch("old", WAIT)
    releases = agent.workspace / "releases"
    shutil.copytree(releases / RELEASE_ID, releases / "rel-0002", symlinks=True)
    tmp_link = agent.workspace / "current.new"
    os.symlink("releases/rel-0002", tmp_link)
    os.replace(tmp_link, agent.workspace / "current")
    agent.launch("new", [])
    assert agent.wait_state("new", "SUCCEEDED")["release_id"] == "rel-0002"
    assert agent.read("new", "standin.json")["env"]["DFLASH_RELEASE_ID"] == "rel-0002"
    assert agent.status("old")["release_id"] == RELEASE_ID
    assert agent.read("old", "standin.json")["env"]["DFLASH_RELEASE_DIR"] == str(releases / RELEASE_ID)
    agent.touch("old", "go")
    agent.wait_state("old", "SUCCEEDED")


@pytest.mark.parametrize("args, kind, text", [
    (["--run-id", "a/b"], "usage", "invalid run id"),
    (["--run-id", ".."], "usage", "invalid run id"),
    (["--run-id", "x", "--resource", "gpu 0"], "usage", "invalid resource"),
    (["--run-id", "x", "--env", "NOEQUALS"], "usage", "KEY=VALUE"),
    (["--run-id", "x", "--stall-after", "0"], "usage", "positive"),
    (["--run-id", "x", "--config", "/nonexistent.yaml"], "not_found", "cannot read config"),
    (["--run-id", "x", "--require-path=disk:data.train=/d"], "usage", "expected KIND:KEY=PATH"),
    (["--config", "c.yaml"], "usage", "--run-id"),
    (["--run-id", "x", "--source-json", "[1]"], "usage", "expected a JSON object"),
    # the source describes another release than the one `current` names (a deploy in between)
    (["--run-id", "x", "--source-json", json.dumps({**SOURCE, "release_id": "rel-0002"})], "conflict",
     "release to run is rel-0001"),
    # run.json's source is a record of its own keys
    (["--run-id", "x", "--source-json", '{"release_id": "rel-0001"}'], "usage", "missing"),
])
def test_launch_argument_errors_are_json(agent, args, kind, text):
    config = str(agent.config([]))
    argv = ["launch", "--config", config] + args if "--config" not in args else ["launch"] + args
    result = agent.run(*argv)
    assert result.rc == 2
    assert result.json["kind"] == kind and text in result.json["error"], result.json
    assert not (agent.workspace / "runs" / "x").exists()


def test_source_is_recorded_in_run_json_and_status(agent):
    source = SOURCE
    agent.launch("src", [], "--source-json", json.dumps(source))
    assert agent.read("src", "run.json")["source"] == source
    assert agent.status("src")["source"] == source
    agent.launch("nosrc", [])
    assert agent.status("nosrc")["source"] is None


def test_existing_run_id_and_missing_release_are_refused(agent):
    agent.launch("dup", [])
    result = agent.run(*agent.launch_args("dup", []))
    assert (result.rc, result.json["kind"]) == (2, "conflict")
    agent.agent_py = agent.agent_py.resolve()  # the agent itself stays where it is
    os.unlink(agent.workspace / "current")
    result = agent.run(*agent.launch_args("fresh", []))
    assert (result.rc, result.json["kind"]) == (2, "not_found")
    assert "no release deployed" in result.json["error"]


def lock_holders(agent, resource):
    """The run ids a lock file lists, in the order they took it."""
    path = agent.workspace / "locks" / (resource + ".json")
    return [h["run_id"] for h in json.loads(path.read_text())["holders"]] if path.exists() else []


def test_locks_conflict_force_and_release(agent):
    agent.launch("a", WAIT, "--resource", "gpu0")
    assert lock_holders(agent, "gpu0") == ["a"]
    result = agent.run(*agent.launch_args("b", WAIT, "--resource", "gpu1", "--resource", "gpu0"))
    assert (result.rc, result.json["kind"], result.json["holders"]) == (2, "conflict", ["a"])
    assert "'a'" in result.json["error"] and "gpu0" in result.json["error"]
    assert lock_holders(agent, "gpu1") == [], "all locks or none"
    assert not agent.run_dir("b").exists()
    agent.launch("b", WAIT, "--resource", "gpu1")  # the run id was not burnt by the refusal
    # --force adds a holder; it does not take a's place.
    agent.launch("c", WAIT, "--resource", "gpu0", "--force")
    assert lock_holders(agent, "gpu0") == ["a", "c"]
    result = agent.run(*agent.launch_args("d", WAIT, "--resource", "gpu0"))
    assert (result.rc, result.json["kind"], result.json["holders"]) == (2, "conflict", ["a", "c"])
    assert "'a' (STARTING)" in result.json["error"] and "'c' (STARTING)" in result.json["error"]
    agent.touch("a", "go")
    agent.wait_state("a", "SUCCEEDED")
    wait_until(lambda: lock_holders(agent, "gpu0") == ["c"], what="a's supervisor to drop only its own holder")
    result = agent.run(*agent.launch_args("d", WAIT, "--resource", "gpu0"))
    assert (result.rc, result.json["holders"]) == (2, ["c"])
    for run_id in ("b", "c"):
        agent.touch(run_id, "go")
        agent.wait_state(run_id, "SUCCEEDED")
    wait_until(lambda: lock_holders(agent, "gpu0") == [] and lock_holders(agent, "gpu1") == [],
             what="the supervisors to drop their locks")
    assert not (agent.workspace / "locks" / "gpu0.json").exists()


def test_dead_holders_are_reaped_and_old_lock_files_are_read(agent):
    locks = agent.workspace / "locks"
    locks.mkdir()
    # A holder whose run never wrote run.json and whose launcher is gone.
    ghost = {"run_id": "ghost", "launcher_pid": dead_pid(), "launcher_start_time": 1, "boot_id": procfs.boot_id()}
    # A holder whose run.json names a pid now used by another process (this test's own
    # pid, started at another time): its run is gone although the pid lives.
    agent.fabricate_run("reused", start_time=procfs.start_time(os.getpid()) - 1)
    # A holder of a run that ended, whose supervisor was killed before it released it.
    agent.launch("done", [], "--resource", "gpu1")
    agent.wait_state("done", "SUCCEEDED")
    (locks / "gpu0.json").write_text(json.dumps({"resource": "gpu0", "holders": [ghost, {"run_id": "reused"}]}))
    (locks / "gpu1.json").write_text(json.dumps({"run_id": "done"}))  # the one-holder form of older releases
    (locks / "gpu2.json").write_text("")  # torn by a crash
    agent.launch("new", WAIT, "--resource", "gpu0", "--resource", "gpu1", "--resource", "gpu2")
    assert [lock_holders(agent, r) for r in ("gpu0", "gpu1", "gpu2")] == [["new"]] * 3
    # A live holder in the old form still counts.
    (locks / "gpu3.json").write_text(json.dumps({"run_id": "new"}))
    result = agent.run(*agent.launch_args("late", WAIT, "--resource", "gpu3"))
    assert (result.rc, result.json["holders"]) == (2, ["new"])
    agent.touch("new", "go")


def test_concurrent_launches_for_one_resource_have_one_winner(agent):
    run_ids = ["race-%d" % i for i in range(4)]
    for run_id in run_ids:
        agent.track(run_id)
    procs = [subprocess.Popen(agent.argv(*agent.launch_args(run_id, WAIT, "--resource", "gpu7")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=agent.env)
             for run_id in run_ids]
    results = [(p.communicate(timeout=30)[0], p.returncode) for p in procs]
    winners = [json.loads(out)["run_id"] for out, rc in results if rc == 0]
    assert len(winners) == 1, results
    assert all(json.loads(out)["kind"] == "conflict" for out, rc in results if rc != 0)
    assert lock_holders(agent, "gpu7") == winners
    agent.touch(winners[0], "go")


def test_concurrent_forced_launches_all_stay_holders(agent):
    agent.launch("first", WAIT, "--resource", "gpu5")
    run_ids = ["forced-%d" % i for i in range(4)]
    for run_id in run_ids:
        agent.track(run_id)
    procs = [subprocess.Popen(agent.argv(*agent.launch_args(run_id, WAIT, "--resource", "gpu5", "--force")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=agent.env)
             for run_id in run_ids]
    assert all(p.wait(timeout=30) == 0 for p in procs), [p.stderr.read() for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    holders = lock_holders(agent, "gpu5")
    assert holders[0] == "first" and sorted(holders[1:]) == run_ids
    for run_id in ["first"] + run_ids:
        agent.touch(run_id, "go")


def _memory_cgroup(tmp_name: str):
    """A fresh cgroup with a 64 MiB memory limit, or None where we may not make one."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text().split():
        group, limit = Path("/sys/fs/cgroup") / tmp_name, "memory.max"
    elif Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        group, limit = Path("/sys/fs/cgroup/memory") / tmp_name, "memory.limit_in_bytes"
    else:
        return None
    try:
        group.mkdir()
        (group / limit).write_text(str(64 << 20))
        swap = group / ("memory.swap.max" if limit == "memory.max" else "memory.memsw.limit_in_bytes")
        if swap.exists():
            try:
                swap.write_text("0" if limit == "memory.max" else str(64 << 20))
            except OSError:
                pass
    except OSError:
        try:
            group.rmdir()
        except OSError:
            pass
        return None
    return group


def test_oom_kill_is_flagged(agent):
    group = _memory_cgroup("dflash-agent-test-%s" % uuid.uuid4().hex[:8])
    if group is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a writable cgroupfs)")
    try:
        # The launch verb joins the cgroup, so its supervisor and trainer are in it too.
        argv = agent.argv(*agent.launch_args("oom", [{"allocate_mib": 512}]))
        agent.track("oom")
        done = subprocess.run(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)] + argv,
                              capture_output=True, env=agent.env, timeout=30)
        assert done.returncode == 0, done.stderr
        status = agent.wait_state("oom", "FAILED")
        assert status["exit"]["signal"] == "SIGKILL" and status["exit"]["oom_killed"] is True
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), 10, "the cgroup to empty")
        group.rmdir()


# --- preflight: what only the host can check, before anything of the run exists ------

def nothing_of(agent, run_id):
    """No run directory and no lock are left by a launch that was refused."""
    assert not agent.run_dir(run_id).exists()
    assert lock_holders(agent, "cpu") == []


def test_preflight_names_every_missing_path_and_creates_nothing(agent):
    release = agent.workspace / "releases" / RELEASE_ID
    (release / "no-config-model").mkdir()
    args = agent.launch_args("paths", WAIT, "--resource=cpu",
                             "--require-path=model:target.path=/nonexistent/model",
                             "--require-path=model:drafter.init=no-config-model",
                             "--require-path=file:data.train=data/train.jsonl",
                             "--require-path=file:data.eval=/",
                             "--require-path=checkpoint:checkpoint.resume=~/no-such-checkpoint")
    result = agent.run(*args)
    assert (result.rc, result.json["kind"]) == (2, "host"), result.json
    assert result.json["error"].split("; ") == [
        "target.path: /nonexistent/model does not exist (and '/nonexistent/model' is not a Hugging Face hub id)",
        f"drafter.init: {release}/no-config-model is not a Hugging Face model folder (no config.json)",
        f"data.train: {release}/data/train.jsonl does not exist",
        "data.eval: / is not a file",
        f"checkpoint.resume: {Path.home()}/no-such-checkpoint is not a checkpoint (no state.json)",
    ]
    nothing_of(agent, "paths")


def test_preflight_accepts_what_the_trainer_can_load(agent):
    release = agent.workspace / "releases" / RELEASE_ID
    (release / "model").mkdir()
    (release / "model" / "config.json").write_text("{}")
    (release / "data").mkdir()
    (release / "data" / "train.jsonl").write_text("")
    checkpoint = agent.workspace / "step_000010"
    checkpoint.mkdir()
    for name in LOADED_FILES:  # intact: every file it loads, as its SHA256SUMS lists them
        (checkpoint / name).write_bytes(os.urandom(64))
    (checkpoint / "SHA256SUMS").write_text(checksums.sums_text(str(checkpoint), LOADED_FILES))
    from test_fit_check import cache_hub_model

    cache_hub_model(agent.workspace / "hf", "Qwen/Qwen3-8B", {"model_type": "qwen3"})
    agent.launch("fine", [], "--require-path=model:target.path=model", f"--env=HF_HOME={agent.workspace / 'hf'}",
                 "--require-path=model:target.path=Qwen/Qwen3-8B",  # a hub id in the host's cache
                 "--require-path=file:data.train=data/train.jsonl",
                 f"--require-path=checkpoint:checkpoint.resume={checkpoint}",
                 "--require-module=json")
    agent.wait_state("fine", "SUCCEEDED")


def test_preflight_names_the_interpreter_and_the_packages_it_lacks(agent, bare_python):
    result = agent.run(*agent.launch_args("bare", WAIT, "--resource=cpu", f"--python={bare_python}",
                                          "--require-module=json", "--require-module=torch",
                                          "--require-module=transformers"))
    assert (result.rc, result.json["kind"]) == (2, "host"), result.json
    assert result.json["error"] == (f"the trainer's interpreter {bare_python} cannot import torch, transformers, "
                                    "which the trainer needs")
    nothing_of(agent, "bare")
    result = agent.run(*agent.launch_args("gone", WAIT, "--python=/nonexistent/python3", "--require-module=torch"))
    assert result.json["error"] == "the trainer's interpreter /nonexistent/python3 cannot run: No such file or directory"
    nothing_of(agent, "gone")


def test_values_in_the_options_own_word_are_never_options(agent):
    agent.launch("dash", [], "--name=--force", "--env=A=-x", "--stall-after=9")
    agent.wait_state("dash", "SUCCEEDED")
    record = agent.read("dash", "run.json")
    assert (record["name"], record["env_keys"], record["stall_after"]) == ("--force", ["A"], 9.0)


def test_a_full_workspace_is_refused_before_anything_is_created(tmp_path):
    with tmpfs(tmp_path / "disk", size_mib=32) as disk:
        agent = Agent(make_workspace(disk))
        try:
            args = agent.launch_args("full", WAIT, "--resource=cpu")  # its config, written while there is room
            fill(disk)
            result = agent.run(*args)
            assert (result.rc, result.json["kind"]) == (2, "host"), result.json
            assert result.json["error"] == (f"only 0.0 MiB free on the filesystem of {agent.workspace}; "
                                            f"a run needs at least {preflight.MIN_FREE_MIB} MiB")
            assert not (agent.workspace / "runs").exists() and not (agent.workspace / "locks").exists()
        finally:
            agent.cleanup()


@pytest.mark.parametrize("config_mib, file", [(90, "config.yaml"), (50, "run.json")])
def test_a_disk_that_fills_up_during_the_launch_names_the_file(tmp_path, config_mib, file):
    # 80 MiB free passes the preflight; the config (read from stdin) is written to
    # runs/ID/config.yaml and again inside run.json, whichever no longer fits.
    with tmpfs(tmp_path / "disk", size_mib=128) as disk:
        agent = Agent(make_workspace(disk))
        agent.track("big")
        try:
            fill(disk, leave_mib=80)
            result = agent.run("launch", "--run-id=big", "--config=-", "--resource=cpu",
                               stdin=b"#" * (config_mib << 20))
            assert (result.rc, result.json["kind"]) == (2, "host"), result.json
            path = str(agent.run_dir("big") / file)
            assert result.json == {"error": f"no space left on device: cannot write {path}", "kind": "host",
                                   "path": path}
            nothing_of(agent, "big")
        finally:
            agent.cleanup()


def test_exit_json_is_written_on_a_disk_full_to_its_last_byte_and_says_so(tmp_path):
    with tmpfs(tmp_path / "disk", size_mib=80) as disk:
        agent = Agent(make_workspace(disk))
        try:
            agent.launch("full", [{"wait_file": "go"}, {"exit": 3}], "--resource=cpu")
            wait_until(lambda: (agent.run_dir("full") / "standin.json").exists())  # the stand-in's own write
            fill(disk)
            agent.touch("full", "go")  # an empty file: an inode, no block
            status = agent.wait_state("full", "FAILED", "LOST")
            exit_json = agent.run_dir("full") / "exit.json"
            assert (status["state"], status["exit"]["exit_code"]) == ("FAILED", 3)
            assert status["reason"] == status["exit"]["error"] == (
                f"no space left on device writing {exit_json} (0 bytes free on {disk})")
            assert not (agent.run_dir("full") / "exit.json.reserve").exists()  # given back
        finally:
            agent.cleanup()


def test_launch_records_the_overrides_and_status_gives_the_config(agent):
    overrides = ["optim.lr=1e-4", "devices.target=[cuda:0, 'cuda:1']", "data.eval="]
    agent.launch("set", [], *[f"--override={o}" for o in overrides])
    agent.wait_state("set", "SUCCEEDED")
    assert agent.read("set", "run.json")["overrides"] == overrides
    plain = agent.ok("status", "--run-id", "set")["runs"][0]
    assert plain["overrides"] == overrides and "config" not in plain
    [status] = agent.ok("status", "--run-id", "set", "--config")["runs"]
    assert status["config"] == (agent.run_dir("set") / "config.yaml").read_text() == json.dumps({"steps": []})
    every = agent.run("status", "--config")
    assert (every.rc, every.json["kind"]) == (2, "usage")
