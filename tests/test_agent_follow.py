"""`follow`: whole lines by byte offset, exact bytes, resume with no gap and no
duplicate, --tail-lines from the end, error records at once, the end condition, a
dropped reader, and GPU samples."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import time

import pytest

from support_agent.harness import agent  # noqa: F401  (fixture)
from support_agent.harness import dead_pid, wait_for

pytestmark = pytest.mark.timeout(60)


def log_bytes(messages):
    """The log bytes the messages carry, checking that they are contiguous."""
    logs = [m for m in messages if m["t"] == "log"]
    for before, after in zip(logs, logs[1:]):
        assert after["offset"] == end_of(before), "gap or overlap between %r and %r" % (before, after)
    return b"".join(m["data"].encode("utf-8", "surrogateescape") for m in logs)


def end_of(message):
    return message["offset"] + len(message["data"].encode("utf-8", "surrogateescape"))


def is_log(text):
    return lambda m: m["t"] == "log" and text in m["data"]


def test_whole_lines_only_and_exact_bytes(agent):
    raw = "caf\u00e9 \U0001F600 ".encode() + b"\xff\xfe\x80 not utf-8\n"
    agent.launch("lines", [{"print": "first"}, {"write": "par"}, {"touch": "wrote"}, {"wait_file": "go"},
                           {"write": "tial\n"}, {"write_hex": raw.hex()}, {"write": "no newline at exit"}])
    stream = agent.follow("lines")
    seen = stream.until(is_log("first"))
    wait_for(lambda: (agent.run_dir("lines") / "wrote").exists())
    later = stream.pending(1.0)  # several polls and batching windows
    assert not [m for m in later if m["t"] == "log"], "a partial line was sent: %r" % later
    agent.touch("lines", "go")
    rest = stream.rest()
    messages = seen + later + rest
    assert any(m["t"] == "log" and m["data"].startswith("partial\n") for m in messages)
    assert log_bytes(messages) == (agent.run_dir("lines") / "train.log").read_bytes()
    end = messages[-1]
    assert end["t"] == "end" and end["state"] == "SUCCEEDED"
    assert end["offset"] == (agent.run_dir("lines") / "train.log").stat().st_size
    assert end["exit"]["exit_code"] == 0
    states = [m["state"] for m in messages if m["t"] == "state"]
    assert states[-1] == "SUCCEEDED" and len(states) == len(set(states))
    # The wire is valid UTF-8 even though the log is not.
    for line in stream.raw_lines:
        line.decode("utf-8")


def test_resume_from_offset_has_no_gap_and_no_duplicate(agent):
    steps = []
    for burst in range(3):
        steps += [{"lines": {"count": 200, "width": 30 + burst}}, {"touch": "burst%d" % burst},
                  {"wait_file": "go%d" % burst}]
    agent.launch("resume", steps)
    received = []
    offset = inode = None
    for burst in range(3):
        wait_for(lambda: (agent.run_dir("resume") / ("burst%d" % burst)).exists())
        extra = [] if offset is None else ["--offset", str(offset), "--inode", str(inode)]
        stream = agent.follow("resume", *extra)
        messages = stream.until(lambda m: m["t"] == "log" and m["data"].endswith(
            "line 000199 %s\n" % ("x" * (30 + burst))))
        stream.close()  # the connection drops
        logs = [m for m in messages if m["t"] == "log"]
        assert logs[0]["offset"] == (offset or 0)
        received += logs
        assert "inode" in logs[0] and all("inode" not in m for m in logs[1:])
        offset, inode = end_of(logs[-1]), logs[0]["inode"]
        agent.touch("resume", "go%d" % burst)
    final = agent.follow("resume", "--offset", str(offset), "--inode", str(inode)).rest()
    data = log_bytes(received + final)
    assert data == (agent.run_dir("resume") / "train.log").read_bytes()
    assert data.count(b"\n") == 600


def finished_run(agent, run_id, lines):
    agent.launch(run_id, [{"lines": {"count": lines, "width": 10}}])
    agent.wait_state(run_id, "SUCCEEDED")
    return (agent.run_dir(run_id) / "train.log").read_bytes()


def test_offset_with_another_inode_restarts_from_zero_and_tail_lines(agent):
    data = finished_run(agent, "done", 1000)
    inode = os.stat(agent.run_dir("done") / "train.log").st_ino
    middle = data.index(b"line 000500")
    resumed = agent.follow("done", "--offset", str(middle), "--inode", str(inode)).rest()
    assert log_bytes(resumed) == data[middle:]
    restarted = agent.follow("done", "--offset", str(middle), "--inode", str(inode + 1)).rest()
    assert log_bytes(restarted) == data
    tail = agent.follow("done", "--tail-lines", "5").rest()
    assert log_bytes(tail) == data[data.index(b"line 000995"):]
    assert agent.follow("done", "--tail-lines", "0").rest()[-1]["offset"] == len(data)


@pytest.mark.timeout(20)
def test_tail_lines_on_a_huge_log_reads_only_its_end(agent):
    # A finished-looking run whose train.log holds 256 GiB of holes before its last
    # lines: reading it from the start would take minutes.
    dead = dead_pid()
    run_dir = agent.fabricate_run("huge", pid=dead, pgid=dead, start_time=1)
    (run_dir / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None,
                                                   "oom_killed": False, "ended_at": time.time()}))
    tail = b"".join(b"tail line %d\n" % i for i in range(10))
    with open(run_dir / "train.log", "wb") as handle:
        handle.truncate(256 << 30)
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n" + tail)
    messages = agent.follow("huge", "--tail-lines", "3").rest()
    assert log_bytes(messages) == b"tail line 7\ntail line 8\ntail line 9\n"
    assert messages[-1]["offset"] == (256 << 30) + 1 + len(tail)
    report = agent.ok("report", "--run-id", "huge", "--log-lines", "2")
    assert report["log_tail"] == "tail line 8\ntail line 9\n"


def test_error_records_arrive_while_the_run_lives(agent):
    agent.launch("err", [{"print": "before the failure"}, {"heartbeat": 1},
                         {"error": {"thread": "drafter-1", "message": "drafter-1 failed in warm-up"}},
                         {"wait_file": "go"}, {"error": {"thread": "coordinator", "phase": "shutdown"}},
                         {"exit": 1}])
    stream = agent.follow("err")
    seen = stream.until(lambda m: m["t"] == "error")
    error = seen[-1]
    assert error["index"] == 0
    record = json.loads((agent.run_dir("err") / "errors.jsonl").read_text().splitlines()[0])
    assert error["record"] == record
    assert "KeyError: 'root cause'" in record["traceback"]
    assert "The above exception was the direct cause" in record["traceback"]
    assert any(is_log("before the failure")(m) for m in seen), "log context comes before the error"
    assert stream.until(lambda m: m["t"] == "state")[-1]["state"] == "DEGRADED"
    assert agent.status("err")["exit"] is None
    agent.touch("err", "go")
    rest = stream.rest()
    assert [m["index"] for m in rest if m["t"] == "error"] == [1]
    assert rest[-1] == {"t": "end", "state": "FAILED", "exit": agent.read("err", "exit.json"),
                        "offset": len("before the failure\n")}
    again = agent.follow("err", "--errors-seen", "1").rest()
    assert [(m["index"], m["record"]["thread"]) for m in again if m["t"] == "error"] == [(1, "coordinator")]


def test_waits_for_train_log_while_starting_and_ends_when_terminal(agent):
    # run.json names this very test process as the trainer: alive, starting, no log yet.
    run_dir = agent.fabricate_run("slow start")
    stream = agent.follow("slow start")
    assert stream.next() == {"t": "state", "state": "STARTING", "ts": pytest.approx(time.time(), abs=5)}
    (run_dir / "train.log").write_bytes(b"hello\n")
    assert stream.until(lambda m: m["t"] == "log")[-1]["data"] == "hello\n"
    (run_dir / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None,
                                                   "oom_killed": False, "ended_at": time.time()}))
    rest = stream.rest()
    assert [m["t"] for m in rest] == ["state", "end"] and rest[-1]["state"] == "SUCCEEDED"


def test_follow_leaves_quietly_when_its_reader_goes_away(agent):
    agent.launch("idle", [{"print": "x"}, {"wait_file": "go"}])
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(agent.argv("follow", "--run-id", "idle"), stdin=subprocess.DEVNULL,
                            stdout=write_end, stderr=subprocess.PIPE, env=agent.env)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            assert json.loads(reader.readline())["t"] in ("log", "state")
        # The client dropped; the run writes nothing more, yet follow notices and leaves.
        _, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and err == b""
    assert agent.status("idle")["state"] in ("STARTING", "RUNNING")  # the run goes on
    agent.touch("idle", "go")


def test_follow_of_an_unknown_run_is_a_json_error(agent):
    result = agent.run("follow", "--run-id", "nope")
    assert (result.rc, result.json["kind"]) == (2, "not_found")


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu=index,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw*--format=csv,noheader,nounits*) ;;
  *) echo "unexpected arguments: $*" >&2; exit 9 ;;
esac
echo "0, NVIDIA H200, 1024, 143771, 37, 41, 118.52"
echo "1, NVIDIA H200, 0, 143771, [N/A], 35, [N/A]"
"""


def test_gpu_samples_and_the_gpus_verb(agent, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    expected = [
        {"index": 0, "name": "NVIDIA H200", "memory_used_mib": 1024, "memory_total_mib": 143771,
         "utilization_pct": 37, "temperature_c": 41, "power_w": 118.52},
        {"index": 1, "name": "NVIDIA H200", "memory_used_mib": 0, "memory_total_mib": 143771,
         "utilization_pct": None, "temperature_c": 35, "power_w": None}]
    assert agent.ok("gpus") == {"gpus": []}  # no nvidia-smi on PATH
    agent.launch("plain", [{"sleep": 0.3}])
    assert not [m for m in agent.follow("plain", "--gpu-interval", "0.1").rest() if m["t"] == "gpu"]

    agent.env["PATH"] = str(bin_dir) + os.pathsep + agent.env["PATH"]
    assert agent.ok("gpus") == {"gpus": expected}
    # The run waits for the follower's second sample: a run that ends before `follow` attaches
    # would leave it nothing to sample, however fast the machine.
    agent.launch("gpu", [{"wait_file": "go"}])
    stream = agent.follow("gpu", "--gpu-interval", "0.1")
    def is_gpu(message):
        return message["t"] == "gpu"

    seen = stream.until(is_gpu) + stream.until(is_gpu)
    agent.touch("gpu", "go")
    samples = [m for m in seen + stream.rest() if m["t"] == "gpu"]
    assert len(samples) >= 2 and all(m["gpus"] == expected for m in samples)
