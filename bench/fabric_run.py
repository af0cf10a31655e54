"""Why the in-process SSH client's commands do not go through Fabric's Connection.run
(docs/hosts.md): the same commands on the test bed's sshd through Connection.run (its
Invoke runner: hide=True, warn=True, output decoded as latin-1 so that bytes survive) and
through the transport's own channels (ssh_client: paramiko). Prints numbers; asserts nothing.

    .venv/bin/python bench/fabric_run.py [--megabytes 0.5,1,2,4] [--upload-kib 2] [--lines 50]

Measured: seconds to receive N MB of stdout (`head -c N /dev/zero`), KiB/s of stdin sent
from a file object (`wc -c`), the median delay of a streamed line (one every 20 ms, read
as it comes: run's out_stream, the transport's stream), whether 256 random bytes of stdout
arrive intact with run's default encoding (UTF-8), and what run reports for a command killed by
a signal and for a connection dropped under a running command. Needs root and sshd.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import shlex
import statistics
import sys
import threading
import time

import fabric
import paramiko
from testbed import test_bed

from dflash_cli.inventory import load_inventory
from dflash_cli.transports import open_transport
from support import kill_ssh_sessions

TICKER = "import sys, time\nfor _ in range(int(sys.argv[1])):\n    print(time.time(), flush=True); time.sleep(0.02)"


def connection(node) -> fabric.Connection:
    return fabric.Connection(node.address, user=node.user, port=node.port,
                             config=fabric.Config(ssh_config=paramiko.SSHConfig(), lazy=True),
                             connect_kwargs={"key_filename": str(node.identity_file), "timeout": 5,
                                             "look_for_keys": False, "allow_agent": False})


class LineDelays(io.TextIOBase):
    """run's out_stream: the delay of each complete line when it is written here."""

    def __init__(self) -> None:
        self.partial, self.delays = "", []

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        self.delays += [time.time() - float(line) for line in lines if line]
        return len(text)


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", default="0.5,1,2,4")
    parser.add_argument("--upload-kib", type=float, default=2)
    parser.add_argument("--lines", type=int, default=50)
    args = parser.parse_args()
    with test_bed() as bed:
        host = dataclasses.replace(load_inventory(bed.hosts).get("node"), ssh_client="paramiko")
        with connection(bed.node) as fab, open_transport(host) as ours:
            fab.run("true", hide=True)
            ours.run(["true"])
            print(f"round trip of `true` (part of every figure below): run {timed(lambda: fab.run('true', hide=True)):.2f} s, "
                  f"transport {timed(lambda: ours.run(['true'])):.2f} s")
            for megabytes in map(float, args.megabytes.split(",")):
                command = f"head -c {int(megabytes * 2 ** 20)} /dev/zero"
                run_s = timed(lambda: fab.run(command, hide=True, encoding="latin-1"))
                ours_s = timed(lambda: ours.run(command.split()))
                print(f"stdout {megabytes:g} MB: run {run_s:.2f} s ({megabytes / run_s:.2f} MB/s), "
                      f"transport {ours_s:.2f} s ({megabytes / ours_s:.1f} MB/s)")
            payload = b"x" * int(args.upload_kib * 1024)
            run_s = timed(lambda: fab.run("wc -c", hide=True, in_stream=io.BytesIO(payload), encoding="latin-1"))
            ours_s = timed(lambda: ours.run(["wc", "-c"], stdin=io.BytesIO(payload)))
            print(f"stdin {args.upload_kib:g} KiB from a file object: run {run_s:.2f} s "
                  f"({args.upload_kib / run_s:.2f} KiB/s), transport {ours_s:.2f} s")
            delays = LineDelays()
            fab.run(shlex.join([sys.executable, "-c", TICKER, str(args.lines)]), hide=False, out_stream=delays)
            streamed = [time.time() - float(line) for line in ours.stream([sys.executable, "-c", TICKER, str(args.lines)])]
            print(f"stream line delay (median): run {1000 * statistics.median(delays.delays):.1f} ms, "
                  f"transport {1000 * statistics.median(streamed):.1f} ms")
            random = bed.work / "random bytes"  # the test bed's node is this machine
            random.write_bytes(os.urandom(256))
            shown = fab.run(shlex.join(["cat", str(random)]), hide=True).stdout
            print("random bytes intact with run's default encoding:",
                  shown.encode("utf-8", "surrogateescape") == random.read_bytes())
            print("run's exit code of a command killed by a signal:",
                  fab.run("sh -c 'kill -9 $$'", hide=True, warn=True).exited)
            dropped: dict[str, object] = {}
            waiting = threading.Thread(target=lambda: dropped.update(result=fab.run("sleep 20", hide=True, warn=True)))
            waiting.start()
            time.sleep(1)
            kill_ssh_sessions(bed.node)
            waited = timed(lambda: waiting.join(30))
            print(f"run's answer to a dropped connection: exited {getattr(dropped.get('result'), 'exited', '?')} "
                  f"after {waited:.1f} s")


if __name__ == "__main__":
    main()
