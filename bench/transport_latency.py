"""Transport floor figures on the test bed (a real sshd on 127.0.0.1 and the fake pct):
start-up (a new transport's first command: connection, handshake, login; the median
of --connects), per-command round trip, line latency of a stream, and bulk throughput
each way, for the local, ssh and pct transports; and the seconds a fresh interpreter
takes to import the SSH client's module. Prints numbers; asserts nothing.

    .venv/bin/python bench/transport_latency.py [--ssh-client auto|openssh|paramiko]
        [--connects 5] [--commands 20] [--lines 50] [--megabytes 32]

--ssh-client is the inventory's `ssh_client` of the ssh and pct hosts (docs/hosts.md).

Needs root (the fake pct enters a mount namespace) and /usr/sbin/sshd.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time

from testbed import ROOT, test_bed

from dflash_cli.inventory import load_inventory
from dflash_cli.transports import open_transport, ssh_client

#: the module each SSH client's transport lives in (what open_transport imports)
CLIENT_MODULES = {"openssh": "dflash_cli.transports.openssh", "paramiko": "dflash_cli.transports.ssh"}

# prints the send time of each line, one every 20 ms
TICKER = "import sys, time\nfor _ in range(int(sys.argv[1])):\n    print(time.time(), flush=True); time.sleep(0.02)"


def import_seconds(module: str, repeats: int = 5) -> float:
    """The best of `repeats` fresh interpreters' time to import `module` of this tree."""
    program = f"import time; started = time.perf_counter(); import {module}; print(time.perf_counter() - started)"
    return min(float(subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT,
                                    check=True).stdout) for _ in range(repeats))


def start_up(host, connects: int) -> float:
    """The median seconds from a new transport to its first command's answer."""
    times = []
    for _ in range(connects):
        started = time.perf_counter()
        with open_transport(host) as transport:
            transport.run(["true"])
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(transport, commands: int, lines: int, megabytes: int) -> dict[str, float]:
    transport.run(["true"])  # connect outside the timings
    trips = []
    for _ in range(commands):
        started = time.perf_counter()
        transport.run(["true"])
        trips.append(time.perf_counter() - started)
    delays = [time.time() - float(line) for line in transport.stream([sys.executable, "-c", TICKER, str(lines)])]
    payload = os.urandom(megabytes * 1024 * 1024)
    started = time.perf_counter()
    transport.run(["sh", "-c", "cat > /dev/null"], stdin=payload)
    upload = time.perf_counter() - started
    started = time.perf_counter()
    transport.run(["head", "-c", str(len(payload)), "/dev/zero"])
    download = time.perf_counter() - started
    return {"round trip ms (median)": 1000 * statistics.median(trips),
            "stream line delay ms (median)": 1000 * statistics.median(delays),
            "stream line delay ms (max)": 1000 * max(delays),
            "upload MB/s": megabytes / upload,
            "download MB/s": megabytes / download}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ssh-client", choices=("auto", "openssh", "paramiko"), default="auto")
    parser.add_argument("--connects", type=int, default=5)
    parser.add_argument("--commands", type=int, default=20)
    parser.add_argument("--lines", type=int, default=50)
    parser.add_argument("--megabytes", type=int, default=32)
    args = parser.parse_args()
    with test_bed() as bed:
        hosts = load_inventory(bed.hosts)
        results = {}
        for name in ("local", "node", "ct200"):
            host = hosts.get(name)
            if host.transport != "local":
                host = dataclasses.replace(host, ssh_client=args.ssh_client)
            connect = start_up(host, args.connects)
            with open_transport(host) as transport:
                results[f"{name} ({host.transport})"] = {"start-up ms (median)": 1000 * connect, **measure(
                    transport, args.commands, args.lines, args.megabytes)}
        client = ssh_client(host)
        print(f"ssh client: {client}; importing {CLIENT_MODULES[client]}: "
              f"{1000 * import_seconds(CLIENT_MODULES[client]):.0f} ms (best of 5)")
    columns = list(results)
    print(f"{'':32}" + "".join(f"{c:>16}" for c in columns))
    for metric in next(iter(results.values())):
        print(f"{metric:32}" + "".join(f"{results[c][metric]:16.1f}" for c in columns))


if __name__ == "__main__":
    main()
