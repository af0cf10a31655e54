"""Transport floor figures on the test bed (a real sshd on 127.0.0.1 and the fake pct):
per-command round trip, line latency of a stream, and bulk throughput each way, for
the local, ssh and pct transports. Prints numbers; asserts nothing.

    .venv/bin/python bench/transport_latency.py [--commands 20] [--lines 50] [--megabytes 32]

Needs root (the fake pct enters a mount namespace) and /usr/sbin/sshd.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from testbed import test_bed

from dflash_cli.inventory import load_inventory
from dflash_cli.transports import open_transport

# prints the send time of each line, one every 20 ms
TICKER = "import sys, time\nfor _ in range(int(sys.argv[1])):\n    print(time.time(), flush=True); time.sleep(0.02)"


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
    parser.add_argument("--commands", type=int, default=20)
    parser.add_argument("--lines", type=int, default=50)
    parser.add_argument("--megabytes", type=int, default=32)
    args = parser.parse_args()
    with test_bed() as bed:
        hosts = load_inventory(bed.hosts)
        results = {}
        for name in ("local", "node", "ct200"):
            with open_transport(hosts.get(name)) as transport:
                results[f"{name} ({hosts.get(name).transport})"] = measure(
                    transport, args.commands, args.lines, args.megabytes)
    columns = list(results)
    print(f"{'':32}" + "".join(f"{c:>16}" for c in columns))
    for metric in next(iter(results.values())):
        print(f"{metric:32}" + "".join(f"{results[c][metric]:16.1f}" for c in columns))


if __name__ == "__main__":
    main()
