"""`dflash watch` against the real agent, with the stand-in trainer (tests/support_agent):
every log line reaches every watcher exactly once, also when the host's train.log is
truncated or replaced under it and the connection drops in between; the local mirror
never splices old and new content; control characters reach no terminal."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from dflash_run import dflash_argv, dflash_env
from support import kill_ssh_sessions
from support.disk import fill, tmpfs
from support_agent.harness import agent  # noqa: F401  (fixture)
from support.wait import wait_until

pytestmark = pytest.mark.timeout(180)


class Watch:
    """A running `dflash watch`, its stdout and stderr collected as they come."""

    def __init__(self, hosts: Path, logs: Path, *args: str):
        self.proc = subprocess.Popen(dflash_argv("--logs-dir", str(logs), "watch", *args, hosts=hosts),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dflash_env())
        self.stdout = b""
        self.stderr = b""
        self._readers = [threading.Thread(target=self._read, args=(name,), daemon=True)
                         for name in ("stdout", "stderr")]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        stream = getattr(self.proc, name)
        while chunk := stream.read1(65536):
            setattr(self, name, getattr(self, name) + chunk)

    def wait_out(self, text: bytes, count: int = 1) -> None:
        wait_until(lambda: self.stdout.count(text) >= count or self.proc.poll() is not None, 60, f"{text!r} on stdout")
        assert self.stdout.count(text) >= count, (self.stdout[-2000:], self.stderr.decode())

    def wait_err(self, text: bytes, count: int = 1) -> None:
        wait_until(lambda: self.stderr.count(text) >= count or self.proc.poll() is not None, 60, f"{text!r} on stderr")
        assert self.stderr.count(text) >= count, self.stderr.decode()

    def finish(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # a watch that did not end must not outlive the test
            self.proc.wait()
            pytest.fail(f"watch did not end within {timeout:.0f} s; its stderr:\n{self.stderr.decode()[-2000:]}")
        for reader in self._readers:
            reader.join(timeout=10)
        return code


def dflash_bytes(hosts: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(dflash_argv(*args, hosts=hosts), capture_output=True, timeout=120, env=dflash_env())


def burst(count: int, width: int) -> bytes:
    """What the stand-in's {"lines": {"count", "width"}} step writes."""
    return b"".join(b"line %06d %s\n" % (i, b"x" * width) for i in range(count))


def last_line(count: int, width: int) -> bytes:
    return b"line %06d %s\n" % (count - 1, b"x" * width)


@pytest.fixture
def hosts(agent, make_inventory, tmp_path):  # noqa: F811
    """An inventory whose `local` and `node` hosts use the stand-in's workspace."""
    workspace = {"workspace": str(agent.workspace)}
    return make_inventory(tmp_path, local=workspace, node=workspace)


def test_every_watcher_sees_every_line_however_early_it_attaches(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("early", [{"print": "[coordinator] the first line"}, {"wait_file": "go"},
                           {"lines": {"count": 200, "width": 20}}])
    logs = tmp_path / "logs"  # one checkout: every watcher shares its logs folder
    first = Watch(hosts, logs, "early", "--host", "local")
    first.wait_out(b"the first line")  # its cursor is on disk now, past that line
    others = [Watch(hosts, logs, "early", "--host", "local") for _ in range(3)]
    for other in others:
        other.wait_err(b"state STARTING")
    agent.touch("early", "go")
    remote_log = (agent.run_dir("early") / "train.log").read_bytes
    for watch in [first, *others]:
        assert watch.finish() == 0, watch.stderr.decode()
        assert watch.stdout == remote_log()
    assert all(b"another watch of early keeps" in other.stderr for other in others)
    # Only the first kept the local state: the mirror holds each byte once.
    assert (logs / "local" / "early" / "train.log").read_bytes() == remote_log()


def copytruncate(run_dir: Path) -> None:
    """logrotate's copytruncate with rotate 2: train.log.1 -> .2, copy, cut in place."""
    log = run_dir / "train.log"
    if (run_dir / "train.log.1").exists():
        os.replace(run_dir / "train.log.1", run_dir / "train.log.2")
    shutil.copyfile(log, run_dir / "train.log.1")
    os.truncate(log, 0)


def test_watch_across_copytruncate_and_a_dropped_connection(agent, hosts, ssh_node, tmp_path):  # noqa: F811
    agent.launch("cut", [{"lines": {"count": 100, "width": 10}}, {"touch": "a"}, {"wait_file": "go1"},
                         {"lines": {"count": 40, "width": 11}}, {"write": "no newline yet"}, {"touch": "b"},
                         {"wait_file": "go2"}, {"lines": {"count": 200, "width": 12}}, {"touch": "c"},
                         {"wait_file": "go3"}])
    run_dir = agent.run_dir("cut")
    logs = tmp_path / "logs"
    watch = Watch(hosts, logs, "cut", "--host", "node", "--retry-for", "60")
    watch.wait_out(last_line(100, 10))
    copytruncate(run_dir)  # under a live stream
    agent.touch("cut", "go1")
    watch.wait_out(last_line(40, 11))
    watch.wait_err(b"was truncated")
    wait_until(lambda: (run_dir / "b").exists())
    # The connection drops; while it is down the log is cut again, after a last line
    # without newline, and grows past the offset the watch stopped at.
    assert kill_ssh_sessions(ssh_node)
    copytruncate(run_dir)
    agent.touch("cut", "go2")
    wait_until(lambda: (run_dir / "c").exists())
    agent.touch("cut", "go3")
    assert watch.finish() == 0, watch.stderr.decode()
    stderr = watch.stderr.decode()
    assert "reconnecting" in stderr and stderr.count("was truncated") == 2, stderr
    segments = [burst(100, 10), burst(40, 11) + b"no newline yet", burst(200, 12)]
    assert [(run_dir / name).read_bytes() for name in ("train.log.2", "train.log.1", "train.log")] == segments
    # Every line once, none spliced: the unfinished line is ended before the new content.
    assert watch.stdout == segments[0] + segments[1] + b"\n" + segments[2]
    mirror = logs / "node" / "cut"
    assert [(mirror / name).read_bytes() for name in ("train.log", "train.log.seg1", "train.log.seg2")] == segments
    assert not list(mirror.glob("train.log.seg3"))


def test_watch_across_a_replaced_log_and_a_dropped_connection(agent, hosts, ssh_node, tmp_path):  # noqa: F811
    agent.launch("mv", [{"lines": {"count": 100, "width": 10}}, {"touch": "a"}, {"wait_file": "go1"},
                        {"lines": {"count": 40, "width": 11}}, {"touch": "b"}, {"wait_file": "go2"}])
    run_dir = agent.run_dir("mv")
    logs = tmp_path / "logs"
    watch = Watch(hosts, logs, "mv", "--host", "node", "--retry-for", "60")
    watch.wait_out(last_line(100, 10))
    # logrotate's create mode: renamed, and a new empty file in its place. The trainer
    # goes on writing to the old one, which is still followed while the new one is empty.
    os.rename(run_dir / "train.log", run_dir / "train.log.1")
    (run_dir / "train.log").write_bytes(b"")
    agent.touch("mv", "go1")
    watch.wait_out(last_line(40, 11))
    assert kill_ssh_sessions(ssh_node)
    with open(run_dir / "train.log", "ab") as new:  # the new file gets content while the watch is away
        new.write(burst(300, 13))
    watch.wait_err(b"was replaced")
    agent.touch("mv", "go2")
    assert watch.finish() == 0, watch.stderr.decode()
    assert "reconnecting" in watch.stderr.decode()
    old = burst(100, 10) + burst(40, 11)
    assert (run_dir / "train.log.1").read_bytes() == old
    assert watch.stdout == old + burst(300, 13)
    mirror = logs / "node" / "mv"
    assert (mirror / "train.log").read_bytes() == old
    assert (mirror / "train.log.seg1").read_bytes() == burst(300, 13)


NASTY = (b"plain\n\x1b[2J\x1b]0;title\x07cleared\rback\x00nul\ttab \xe2\x80\xae rtl \xff\xfe caf\xc3\xa9"
         b" \xc2\x9b1m csi \xe2\x80\xa8 line separator\n")
SHOWN = (b"plain\n\\x1b[2J\\x1b]0;title\\x07cleared\\rback\\x00nul\ttab \\u202e rtl \\xff\\xfe caf\xc3\xa9"
         b" \\x9b1m csi \xe2\x80\xa8 line separator\n")


def test_control_characters_are_escaped_for_people_and_exact_elsewhere(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("ctl", [{"write_hex": NASTY.hex()},
                         {"error": {"thread": "drafter-1", "message": "bad \x1b[31mred\x1b[0m \r"}},
                         {"exit": 1}])
    logs = tmp_path / "logs"
    shown = dflash_bytes(hosts, "--logs-dir", str(logs), "watch", "ctl", "--host", "local")
    assert shown.returncode == 1, shown.stderr
    assert shown.stdout.startswith(SHOWN)
    assert b"RuntimeError: bad \\x1b[31mred\\x1b[0m \\r\n" in shown.stdout
    assert b"\x1b" not in shown.stdout and b"\r" not in shown.stdout
    # The mirror and the saved traceback keep the exact bytes.
    assert (logs / "local" / "ctl" / "train.log").read_bytes() == NASTY
    assert b"bad \x1b[31mred\x1b[0m \r" in (logs / "local" / "ctl" / "traceback.txt").read_bytes()
    exact = dflash_bytes(hosts, "--logs-dir", str(tmp_path / "other logs"), "watch", "ctl", "--host", "local",
                         "--json")
    data = "".join(m["data"] for m in map(json.loads, exact.stdout.splitlines()) if m["t"] == "log")
    assert data.encode("utf-8", "surrogateescape") == NASTY
    fetched = dflash_bytes(hosts, "--logs-dir", str(logs), "fetch-traceback", "ctl", "--host", "local")
    assert fetched.returncode == 0, fetched.stderr
    assert b"RuntimeError: bad \\x1b[31mred\\x1b[0m \\r\n" in fetched.stdout and b"\x1b" not in fetched.stdout


def test_watch_started_again_after_a_truncation_resumes_in_the_new_content(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("again", [{"lines": {"count": 100, "width": 10}}, {"touch": "a"}, {"wait_file": "go1"},
                           {"lines": {"count": 20, "width": 11}}, {"touch": "b"}, {"wait_file": "go2"},
                           {"lines": {"count": 300, "width": 12}}, {"touch": "c"}, {"wait_file": "go3"}])
    run_dir = agent.run_dir("again")
    logs = tmp_path / "logs"
    first = Watch(hosts, logs, "again", "--host", "local")
    first.wait_out(last_line(100, 10))
    first.proc.send_signal(signal.SIGINT)  # detached: cursor.json says where it stopped
    assert first.finish() == 130, first.stderr.decode()
    agent.touch("again", "go1")  # lines the watch never saw, then the cut
    wait_until(lambda: (run_dir / "b").exists())
    copytruncate(run_dir)
    agent.touch("again", "go2")
    wait_until(lambda: (run_dir / "c").exists())  # grown past the offset the watch stopped at
    agent.touch("again", "go3")
    second = Watch(hosts, logs, "again", "--host", "local")
    assert second.finish() == 0, second.stderr.decode()
    assert b"resuming again at byte" in second.stderr and b"was truncated" in second.stderr
    assert second.stdout == burst(20, 11) + burst(300, 12)
    mirror = logs / "local" / "again"
    assert (mirror / "train.log").read_bytes() == burst(100, 10) + burst(20, 11)
    assert (mirror / "train.log.seg1").read_bytes() == burst(300, 12)
    cursor = json.loads((mirror / "cursor.json").read_text())
    assert (cursor["segment"], cursor["offset"]) == (1, len(burst(300, 12)))


def test_a_full_local_disk_ends_watch_with_its_own_exit_code_while_the_run_goes_on(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("full", [{"print": "[coordinator] the first line"}, {"wait_file": "go"},
                          {"lines": {"count": 4000, "width": 200}}, {"wait_file": "end"}])
    try:
        with tmpfs(tmp_path / "logs", size_mib=1) as logs:
            watch = Watch(hosts, logs, "full", "--host", "local")
            watch.wait_out(b"the first line")
            fill(logs)  # to its last byte
            agent.touch("full", "go")
            assert watch.finish() == 5, watch.stderr.decode()
            stderr = " ".join(watch.stderr.decode().split())
            local = logs / "local" / "full"
            assert re.search(re.escape(f"dflash: error: the local disk is full: cannot write {local}") + r"\S* \(\d+ "
                             + re.escape(f"bytes free on {logs}); the run on its host is not affected"), stderr), stderr
            assert "Traceback" not in stderr
            assert agent.status("full")["state"] in ("STARTING", "RUNNING")  # the run is not the watch's failure
            assert [p.name for p in local.iterdir() if p.name.endswith(".tmp")] == []
    finally:
        agent.touch("full", "end")
