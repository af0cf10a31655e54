"""`follow`: whole lines by byte offset, exact bytes, resume with no gap and no
duplicate, --tail-lines from the end, error records at once, the end condition, a
dropped reader, and GPU samples."""
from __future__ import annotations

import json
import shutil
import os
import stat
import subprocess
import time

import pytest

from support_agent.harness import agent  # noqa: F401  (fixture)
from support_agent.harness import dead_pid
from support.wait import wait_until

from dflash_agent.follow import EventsFollower
from dflash_contract.requests import FINGERPRINT_BYTES, fingerprint

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


def is_mark(n):
    return lambda m: m["t"] == "events" and any(e["type"] == "mark" and e.get("n") == n for e in m["events"])


def test_whole_lines_only_and_exact_bytes(agent):
    raw = "caf\u00e9 \U0001F600 ".encode() + b"\xff\xfe\x80 not utf-8\n"
    # After the partial write, two marker events, the second written once the first arrived:
    # the follow that sent the second read the log at least once after the partial write.
    agent.launch("lines", [{"print": "first"}, {"write": "par"}, {"event": {"type": "mark", "n": 1}},
                           {"wait_file": "go1"}, {"event": {"type": "mark", "n": 2}}, {"wait_file": "go"},
                           {"write": "tial\n"}, {"write_hex": raw.hex()}, {"write": "no newline at exit"}])
    stream = agent.follow("lines")
    seen = stream.until(is_log("first"))
    later = stream.until(is_mark(1))
    agent.touch("lines", "go1")
    later += stream.until(is_mark(2))
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
        wait_until(lambda: (agent.run_dir("resume") / ("burst%d" % burst)).exists())
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
    # the file it named is gone, and what it got after `middle` with it
    assert [(m["reason"], m["previous_end"], m["complete"]) for m in restarted if m["t"] == "rotated"] == [
        ("replaced", middle, False)]
    retailed = agent.follow("done", "--offset", str(middle), "--inode", str(inode), "--tail-lines", "2").rest()
    assert log_bytes(retailed) == data[data.index(b"line 000998"):]  # --tail-lines wins over a valid resume
    tail = agent.follow("done", "--tail-lines", "5").rest()
    assert log_bytes(tail) == data[data.index(b"line 000995"):]
    assert agent.follow("done", "--tail-lines", "0").rest()[-1]["offset"] == len(data)


@pytest.mark.timeout(20)
def test_tail_lines_on_a_huge_log_reads_only_its_end(agent):
    # A finished-looking run whose train.log holds 256 GiB of holes before its last
    # lines: reading it from the start would take minutes.
    dead = dead_pid()
    run_dir = agent.fabricate_run("huge", pid=dead, pgid=dead, start_time=1)
    (run_dir / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None, "oom_killed": False,
                                                   "ended_at": time.time(), "exec_error": None}))
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
    assert rest[-1] == {"t": "end", "state": "FAILED", "exit": agent.read("err", "exit.json"), "attempt": 0,
                        "offset": len("before the failure\n"), "segment": 0}
    again = agent.follow("err", "--errors-seen", "1").rest()
    assert [(m["index"], m["record"]["thread"]) for m in again if m["t"] == "error"] == [(1, "coordinator")]


def test_events_come_in_batches_without_heartbeats_and_resume_at_their_offset(agent):
    steps = [{"event": {"type": "step", "step": i, "loss": 3.0 - i / 10}} for i in range(1, 4)]
    agent.launch("ev", [{"heartbeat": 0}, *steps, {"heartbeat": 3}, {"touch": "wrote"}, {"wait_file": "go"},
                        {"event": {"type": "eval", "step": 3, "acceptance_length": 1.5}}, {"heartbeat": 4},
                        {"write_hex": b'{"type": "step", "st'.hex()}])  # a write cut by a kill
    events_file = agent.run_dir("ev") / "events.jsonl"
    stream = agent.follow("ev")
    upto_step_3 = stream.until(lambda m: m["t"] == "events" and 3 in [e.get("step") for e in m["events"]])
    first_batch = [m for m in upto_step_3 if m["t"] == "events"]
    first = first_batch[0]
    assert [e["step"] for m in first_batch for e in m["events"]] == [1, 2, 3], "one batch or a few, in order"
    assert first["offset"] == 0
    agent.touch("ev", "go")
    rest = [m for m in stream.rest() if m["t"] == "events"]
    assert [e["type"] for m in rest for e in m["events"]] == ["eval"]
    host = [json.loads(line) for line in events_file.read_bytes().splitlines()[:-1]]
    received = [e for m in first_batch + rest for e in m["events"]]
    assert received == [e for e in host if e["type"] != "heartbeat"]
    for before, after in zip(first_batch + rest, (first_batch + rest)[1:]):
        assert after["offset"] == before["next"], "every byte of events.jsonl is covered once"
    # A resume at a batch's end sends only what came after it.
    again = agent.follow("ev", "--events-offset", str(first_batch[-1]["next"])).rest()
    assert [e for m in again if m["t"] == "events" for e in m["events"]] == received[3:]


def test_a_poll_that_reads_heartbeats_alone_leaves_their_bytes_to_the_next_message(tmp_path):
    # A poll can land between the trainer's heartbeat and its next step (a loaded host):
    # the heartbeats get no message of their own, the next message covers them.
    path = tmp_path / "events.jsonl"
    heartbeat = json.dumps({"ts": 1.0, "type": "heartbeat", "thread": "coordinator", "step": 0}) + "\n"
    path.write_text(heartbeat)
    follower = EventsFollower(str(path), 0)
    assert list(follower.poll(final=True)) == []
    with open(path, "a") as f:
        f.write(json.dumps({"ts": 2.0, "type": "step", "thread": "drafter-0", "step": 1}) + "\n")
    (message,) = follower.poll(final=True)
    assert (message.offset, message.next) == (0, path.stat().st_size)
    assert [e["step"] for e in message.events] == [1]


def test_waits_for_train_log_while_starting_and_ends_when_terminal(agent):
    # run.json names this very test process as the trainer: alive, starting, no log yet.
    run_dir = agent.fabricate_run("slow start")
    stream = agent.follow("slow start")
    assert stream.next() == {"t": "state", "state": "STARTING", "ts": pytest.approx(time.time(), abs=5)}
    (run_dir / "train.log").write_bytes(b"hello\n")
    assert stream.until(lambda m: m["t"] == "log")[-1]["data"] == "hello\n"
    (run_dir / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None, "oom_killed": False,
                                                   "ended_at": time.time(), "exec_error": None}))
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


def by_segment(messages, offset=0, segment=0):
    """{segment: the log bytes the messages carry in it}, checking that each segment's
    messages are contiguous from `offset` and that each "rotated" follows the end of
    what was sent of the segment before."""
    out = {segment: b""}
    for m in messages:
        if m["t"] == "rotated":
            assert m["previous_end"] == offset, "rotated at %d, but %d was sent" % (m["previous_end"], offset)
            assert m["segment"] == segment + 1 and m["offset"] == 0
            segment, offset = m["segment"], 0
            out[segment] = b""
        elif m["t"] == "log":
            assert m["offset"] == offset, "gap or overlap at %r (expected offset %d)" % (m, offset)
            if "segment" in m:
                assert m["segment"] == segment
            out[segment] += m["data"].encode("utf-8", "surrogateescape")
            offset = end_of(m)
    return out


def burst(count, width):
    return b"".join(b"line %06d %s\n" % (i, b"x" * width) for i in range(count))


def resume_args(log, messages):
    """--offset/--inode/--fingerprint for a stream that received `messages` of train.log,
    as the CLI keeps them."""
    data = log_bytes(messages)
    logs = [m for m in messages if m["t"] == "log"]
    return ["--offset", str(end_of(logs[-1])), "--inode", str(logs[0]["inode"]),
            "--fingerprint", fingerprint(data[-FINGERPRINT_BYTES:])]


def test_copytruncate_under_follow_sends_every_line_once_and_says_so(agent):
    agent.launch("rot", [{"lines": {"count": 100, "width": 10}}, {"touch": "a"}, {"wait_file": "go1"},
                         {"lines": {"count": 30, "width": 11}}, {"touch": "b"}, {"wait_file": "go2"}])
    run_dir = agent.run_dir("rot")
    stream = agent.follow("rot")
    seen = stream.until(is_log("line 000099 " + "x" * 10))
    # logrotate's copytruncate: copy, then cut the file the trainer keeps appending to.
    shutil.copyfile(run_dir / "train.log", run_dir / "train.log.1")
    os.truncate(run_dir / "train.log", 0)
    agent.touch("rot", "go1")
    seen += stream.until(lambda m: m["t"] == "rotated")
    seen += stream.until(is_log("line 000029 " + "x" * 11))
    agent.touch("rot", "go2")
    messages = seen + stream.rest()
    rotated = [m for m in messages if m["t"] == "rotated"]
    assert [(m["reason"], m["segment"], m["complete"]) for m in rotated] == [("truncated", 1, True)]
    assert rotated[0]["inode"] == os.stat(run_dir / "train.log").st_ino
    assert by_segment(messages) == {0: burst(100, 10), 1: burst(30, 11)}
    assert messages[-1]["t"] == "end" and messages[-1]["segment"] == 1
    assert messages[-1]["offset"] == len(burst(30, 11))


def test_resume_after_truncation_neither_replays_nor_splices(agent):
    # The log is cut and grows past the client's offset while it is away: same inode,
    # offset within the file, yet other bytes. The copy holds what it had not received.
    agent.launch("away", [{"lines": {"count": 100, "width": 10}}, {"touch": "a"}, {"wait_file": "go1"},
                          {"lines": {"count": 20, "width": 10}}, {"touch": "b"}, {"wait_file": "go2"},
                          {"lines": {"count": 300, "width": 12}}, {"touch": "c"}, {"wait_file": "go3"}])
    run_dir = agent.run_dir("away")
    stream = agent.follow("away")
    first = stream.until(is_log("line 000099 " + "x" * 10))
    stream.close()  # the connection drops
    resume = resume_args(run_dir / "train.log", first)
    agent.touch("away", "go1")
    wait_until(lambda: (run_dir / "b").exists())
    shutil.copyfile(run_dir / "train.log", run_dir / "train.log.1")
    os.truncate(run_dir / "train.log", 0)
    agent.touch("away", "go2")
    wait_until(lambda: (run_dir / "c").exists())
    assert os.path.getsize(run_dir / "train.log") > int(resume[1])  # past the old offset again
    resumed = agent.follow("away", *resume)
    messages = resumed.until(is_log("line 000299 " + "x" * 12))
    agent.touch("away", "go3")
    messages += resumed.rest()
    (rotated,) = [m for m in messages if m["t"] == "rotated"]
    assert (rotated["reason"], rotated["segment"], rotated["complete"]) == ("truncated", 1, True)
    # the 20 lines written before the cut come from the copy, then the new content from 0
    assert by_segment(messages, offset=int(resume[1])) == {0: burst(20, 10), 1: burst(300, 12)}
    # Without the copy the same resume cannot deliver them, and says so.
    (run_dir / "train.log.1").unlink()
    again = agent.follow("away", *resume).rest()
    (rotated,) = [m for m in again if m["t"] == "rotated"]
    assert (rotated["reason"], rotated["complete"], rotated["previous_end"]) == ("truncated", False, int(resume[1]))
    assert by_segment(again, offset=int(resume[1])) == {0: b"", 1: burst(300, 12)}


def test_replaced_log_is_followed_to_its_end_then_the_new_file(agent):
    # logrotate's create mode: the file is renamed and a new, empty one takes its name.
    # The trainer keeps writing to the file it opened, so that one is followed until the
    # new one gets content.
    agent.launch("mv", [{"lines": {"count": 100, "width": 10}}, {"touch": "a"}, {"wait_file": "go1"},
                        {"lines": {"count": 30, "width": 11}}, {"write": "partial"}, {"touch": "b"},
                        {"wait_file": "go2"}])
    run_dir = agent.run_dir("mv")
    stream = agent.follow("mv")
    seen = stream.until(is_log("line 000099 " + "x" * 10))
    old_inode = seen[0]["inode"] if seen[0]["t"] == "log" else [m for m in seen if "inode" in m][0]["inode"]
    os.rename(run_dir / "train.log", run_dir / "train.log.1")
    (run_dir / "train.log").write_bytes(b"")
    agent.touch("mv", "go1")
    seen += stream.until(is_log("line 000029 " + "x" * 11))  # from the renamed file
    resume = resume_args(run_dir / "train.log.1", seen)
    stream.close()
    wait_until(lambda: (run_dir / "b").exists())
    with open(run_dir / "train.log", "ab") as new:
        new.write(b"new file line\n")
    # A reconnect finds the old file by its inode, sends its rest, then moves over.
    messages = agent.follow("mv", *resume).until(is_log("new file line"))
    (rotated,) = [m for m in messages if m["t"] == "rotated"]
    assert (rotated["reason"], rotated["segment"], rotated["complete"]) == ("replaced", 1, True)
    assert rotated["inode"] == os.stat(run_dir / "train.log").st_ino != old_inode
    assert by_segment(messages, offset=int(resume[1])) == {0: b"partial", 1: b"new file line\n"}
    agent.touch("mv", "go2")
    assert (run_dir / "train.log.1").read_bytes() == burst(100, 10) + burst(30, 11) + b"partial"
    # A live follower of the replaced file does the same, and the whole old file once.
    whole = agent.follow("mv", "--offset", "0", "--inode", str(old_inode)).rest()
    assert by_segment(whole) == {0: (run_dir / "train.log.1").read_bytes(), 1: b"new file line\n"}


def test_a_malformed_fingerprint_is_a_usage_error(agent):
    agent.launch("fp", [{"print": "x"}])
    result = agent.run("follow", "--run-id", "fp", "--offset", "2", "--fingerprint", "2:nothex")
    assert (result.rc, result.json["kind"]) == (2, "usage") and "LEN:SHA256HEX" in result.json["error"]
