"""Bytes moved by `dflash watch` against bytes the run wrote (its log and its
events.jsonl, whose events but heartbeats `watch` brings home too), over the pct
transport, for a run of --duration seconds (default 300); then the time `watch --tail
100` takes on a 1 GB log, against the same on a small log.

"Moved" is counted twice: the payload the transport received (what the agent's follow
sent), and the bytes the client's TCP socket received (SSH framing, MACs and
keepalives included), read from the kernel's TCP_INFO. Prints numbers; asserts nothing.

    sudo .venv/bin/python bench/watch_bytes.py [--duration 300] [--log-gb 1]
"""
from __future__ import annotations

import argparse
import io
import socket
import statistics
import struct
import sys
import threading
import time

from testbed import small_config, test_bed

from dflash_cli.commands import watch
from dflash_cli.local_state import RunRef
from dflash_cli.session import Session

TCPI_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info: u64 tcpi_bytes_received (Linux >= 4.1)


def socket_bytes_received(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return struct.unpack_from("Q", info, TCPI_BYTES_RECEIVED_OFFSET)[0]


def watched_bytes(bed, duration: float) -> str:
    config = small_config(bed.work / "long.yaml", optim={"max_steps": 100000, "epochs": 1000},
                          data={"synthetic": {"num_train": 64, "num_eval": 2, "prompt_words": 12,
                                              "response_tokens": 24}})
    launched = bed.dflash("launch", "ct200", "--config", str(config))
    run_id = launched.stdout.strip()
    session = Session(str(bed.hosts), bed.logs)
    host = session.host("ct200")
    transport = session.transport(host)
    transport.run(["true"])  # connected, so the socket exists before watch starts
    sock = transport._connection.transport.sock  # the one TCP connection to the node
    wire_before, payload_before = socket_bytes_received(sock), transport.bytes_received
    stopper = threading.Timer(duration, lambda: bed.dflash("stop", run_id, "--host", "ct200"))
    stopper.start()
    real_stdout = sys.stdout
    sys.stdout = io.TextIOWrapper(io.BytesIO())  # watch's printing is not what is measured
    try:
        code = watch.run(session, RunRef("ct200", run_id), tail=None, interval=5.0, as_json=False, retry_for=30)
    finally:
        sys.stdout = real_stdout
    wire = socket_bytes_received(sock) - wire_before
    payload = transport.bytes_received - payload_before
    session.close()
    run_dir = bed.workspace_on_node / "runs" / run_id
    log_bytes = (run_dir / "train.log").stat().st_size
    events_bytes = (run_dir / "events.jsonl").stat().st_size
    written = log_bytes + events_bytes
    print(f"run of {duration:.0f} s (watch exit {code}): log {log_bytes} + events {events_bytes} = {written} bytes "
          f"written; follow payload {payload} bytes ({payload / written:.3f}x of what the run wrote, "
          f"{payload / log_bytes:.3f}x of its log); TCP bytes received {wire} ({wire / written:.3f}x, "
          f"{wire / log_bytes:.3f}x)", flush=True)
    return run_id


def tail_times(bed, run_id: str, log_gb: float) -> None:
    def timed_tail() -> float:
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            done = bed.dflash("watch", run_id, "--host", "ct200", "--tail", "100")
            runs.append(time.perf_counter() - started)
            if done.stdout.count("\n") < 100:
                raise SystemExit(f"--tail 100 printed {done.stdout.count(chr(10))} lines: {done.stderr}")
        return statistics.median(runs)

    log = bed.workspace_on_node / "runs" / run_id / "train.log"
    (bed.logs / "ct200" / run_id / "cursor.json").unlink(missing_ok=True)
    small = timed_tail()
    line = b"2026-11-29T16:00:00.000 [drafter-0] step 1/1 loss 4.0000 acc@1 0.5000 lr 1.00e-04 tokens/s 5000\n"
    block = line * (8 * 1024 * 1024 // len(line))
    with open(log, "ab") as fh:
        for _ in range(int(log_gb * 1024 / 8)):
            fh.write(block)
    big = timed_tail()
    print(f"watch --tail 100 (whole command, median of 3): {small * 1000:.0f} ms on the run's own log, "
          f"{big * 1000:.0f} ms on the same log grown to {log.stat().st_size / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--log-gb", type=float, default=1.0)
    args = parser.parse_args()
    with test_bed() as bed:
        run_id = watched_bytes(bed, args.duration)
        tail_times(bed, run_id, args.log_gb)


if __name__ == "__main__":
    main()
