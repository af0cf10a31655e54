"""Said for a trainer of a run on several hosts that died without a word (killed by a
signal: SIGKILL, the OOM killer, a crash): its supervisor runs

    python -m dflash_train.peer_notice --message "the trainer was killed by SIGKILL"

in the trainer's environment (RANK, MASTER_ADDR, MASTER_PORT, DFLASH_RUN_ID), which
writes the `abort` record on the run's store that the trainer would have written
(training/distributed.py), so the other ranks end within seconds, even while they wait in the
join, and name this rank. A record already there (the trainer's own) is kept.

Exit 0 once the record is on the store (or another was first), 1 when the store cannot
be reached in --timeout-s (rank 0, its host, is gone too, or never formed it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


from dflash_contract.names import ABORT_KEY
from dflash_contract.records import AbortRecord

from .training.distributed import first_line, run_store_prefix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_train.peer_notice")
    parser.add_argument("--message", required=True, help="why this rank's trainer ended")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="how long to try to reach the store")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    record = AbortRecord(int(os.environ["RANK"]), AbortRecord.FAILED, None, args.message)
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                              datetime.timedelta(seconds=args.timeout_s))
        dist.PrefixStore(run_store_prefix(), store).compare_set(ABORT_KEY, "", json.dumps(record.to_json()))
    except Exception as exc:  # noqa: BLE001 - c10d raises several types for an unreachable store
        print(f"peer notice: the run's store at {address} cannot be reached ({type(exc).__name__}: "
              f"{first_line(exc)}); the peers were not told", file=sys.stderr)
        return 1
    print(f"peer notice: told the peers at {address}: rank {record['rank']}: {args.message}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
