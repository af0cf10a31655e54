"""Peak memory and time of `dflash deploy` sending a tree with one big file in it (what a
user gets who leaves a dataset under configs/ and passes --allow-large).

Builds a copy of remote/ and configs/ with a random file of --mib MiB under configs/data/,
deploys it to a `local` host (its workspace in a temporary folder) with the dflash of
--checkout (default: this one), and prints the CLI's peak RSS (ru_maxrss of the process,
from wait4) and wall seconds. Asserts nothing.

    .venv/bin/python bench/deploy_memory.py [--mib 300] [--checkout DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=300)
    parser.add_argument("--checkout", type=Path, default=REPO, help="the dflash whose CLI runs")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tree = work / "tree"
        for top in ("remote", "configs"):
            shutil.copytree(REPO / top, tree / top, ignore=shutil.ignore_patterns("__pycache__"))
        (tree / "configs" / "data").mkdir(exist_ok=True)
        with open(tree / "configs" / "data" / "big.bin", "wb") as fh:
            for _ in range(args.mib):
                fh.write(os.urandom(1 << 20))
        hosts = work / "hosts.yaml"
        hosts.write_text(yaml.safe_dump({"hosts": {"local": {
            "transport": "local", "workspace": str(work / "ws"), "python": sys.executable}}}))
        env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{checkout / 'remote'}", "NO_COLOR": "1"}
        argv = [sys.executable, "-m", "dflash_cli", "--hosts", str(hosts), "deploy", "local", "--source", str(tree)]
        usage = subprocess.run(argv[:5] + ["deploy", "--help"], capture_output=True, text=True, env=env, cwd=work).stdout
        if "--allow-large" in usage:
            argv.append("--allow-large")
        started = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work)
        _, status, usage_info = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - started
        err = proc.stderr.read().decode()
        proc.returncode = os.waitstatus_to_exitcode(status)
        print(f"checkout {checkout}: deploy of a tree with a {args.mib} MiB file: exit {proc.returncode}, "
              f"peak RSS {usage_info.ru_maxrss / 1024:.0f} MiB, {seconds:.1f} s")
        if proc.returncode != 0:
            print(err[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
