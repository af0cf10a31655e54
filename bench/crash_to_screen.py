"""Crash-to-screen: from a trainer thread raising to its full traceback printed by a
running `dflash watch`, over the pct transport (sshd on 127.0.0.1 + the fake pct).

Each repetition launches a small run whose drafter-1 raises at step 2 while `dflash
watch` follows it; the raise time is the errors.jsonl record's `ts` (taken by the
failing thread as it records), the print time is when the traceback's last line
arrives on watch's stdout. Prints each figure and the median; asserts nothing.

    sudo .venv/bin/python bench/crash_to_screen.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from testbed import small_config, test_bed


def one(bed, index: int) -> float:
    config = small_config(bed.work / f"crash{index}.yaml",
                          faults=[{"thread": "drafter-1", "at": "step:2", "kind": "raise", "depth": 40}])
    launched = bed.dflash("launch", "ct200", "--config", str(config), "--force")
    run_id = launched.stdout.strip()
    if launched.returncode != 0 or not run_id:
        raise SystemExit(f"launch failed: {launched.stderr}")
    watch = bed.popen_dflash("watch", run_id, "--host", "ct200")
    arrivals = []
    for line in iter(watch.stdout.readline, b""):
        arrivals.append((time.time(), line))
    watch.wait()
    errors = bed.workspace_on_node / "runs" / run_id / "errors.jsonl"
    record = json.loads(errors.read_text().splitlines()[0])
    last_line = record["traceback"].rstrip("\n").rsplit("\n", 1)[-1].encode()
    printed_at = next(t for t, line in arrivals if line.rstrip(b"\n") == last_line)
    return printed_at - record["ts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with test_bed() as bed:
        deploy = bed.dflash("deploy", "ct200")
        if deploy.returncode != 0:
            raise SystemExit(deploy.stderr)
        figures = []
        for index in range(args.repeat):
            figures.append(one(bed, index))
            print(f"run {index + 1}: crash-to-screen {figures[-1] * 1000:.0f} ms", flush=True)
    print(f"crash-to-screen over pct: median {statistics.median(figures) * 1000:.0f} ms, "
          f"min {min(figures) * 1000:.0f} ms, max {max(figures) * 1000:.0f} ms ({len(figures)} runs)")


if __name__ == "__main__":
    main()
