"""Launch -> first step of the trainer, cold and warm compile cache, 1/2/4 drafter threads,
and a second "host" (another workspace on this machine) seeded with the first one's
compile cache folder.

    PYTHONPATH=remote python3 bench/startup.py --work /tmp/startup [--threads 1,2,4] [--compile cudagraphs]
        [--host2 folder|artifacts]

Each run is the trainer itself (`python -m dflash_train`, as the agent starts it) on
configs/train/tiny-gpu.yaml with its drafters on cuda:0 (`--device cpu` with
`--compile default` checks the script on a CPU), `optim.max_steps` 3, no evaluation,
no checkpoint. "cold": a fresh workspace (its cache/compile/<key>/ empty); "warm": the
same workspace again; "host2": a fresh workspace whose cache/compile/ is a copy of the
first one's (--host2 folder: the whole key folder, Inductor's and Triton's caches; --host2
artifacts: only key.json and the portable artifacts, artifacts.bin + artifacts.json, what
`dflash cache copy` and a multi-host launch send, which the trainer loads into its cold
cache). Printed per run: seconds from the process start to the first step event, and the
compile-cache line the trainer logged. $WORK/startup.json holds the numbers, with each
run's start-up phases (label -> seconds, from its `startup` events).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def write_config(path: Path, drafters: int, device: str, compile_mode: str) -> None:
    config = yaml.safe_load((REPO / "configs" / "train" / "tiny-gpu.yaml").read_text())
    config["devices"] = {"target": [device], "drafters": [device] * drafters}
    config["compile"] = compile_mode
    # 4 shape buckets of 32 over max_length 128: the layout start-up was first measured with
    # (cudagraphs captures at most 4)
    config["data"]["pad_multiple"] = 32
    config["optim"]["max_steps"] = 3
    config["eval"] = {"num_prompts": 0}
    config["checkpoint"] = {"every": 0}
    path.write_text(yaml.safe_dump(config))


def first_step_s(workspace: Path, run_dir: Path, config: Path, timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "remote"),
           "DFLASH_WORKSPACE": str(workspace)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the trainer's own per-key folder is what is measured
    run_dir.mkdir(parents=True)
    started = time.time()
    with open(run_dir / "train.log", "wb") as log:
        code = subprocess.run([sys.executable, "-m", "dflash_train", "--config", str(config), "--run-dir",
                               str(run_dir)], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e["ts"] for e in events if e["type"] == "step"]
    cache_line = next((line.split("] ", 1)[1] for line in (run_dir / "train.log").read_text().splitlines()
                       if "compile cache:" in line), "")
    phases = {e["label"]: e["duration_s"] for e in events if e["type"] == "startup" and e["state"] == "done"}
    return {"exit_code": code, "first_step_s": round(steps[0] - started, 1) if steps else None, "cache": cache_line,
            "phases": phases}


def seed_host2(host1: Path, host2: Path, what: str) -> None:
    """What deploying the first host's compile cache to a second one gives it."""
    if what == "folder":
        shutil.copytree(host1 / "cache" / "compile", host2 / "cache" / "compile")
        return
    for key_folder in (host1 / "cache" / "compile").iterdir():
        into = host2 / "cache" / "compile" / key_folder.name
        into.mkdir(parents=True)
        for name in ("key.json", "artifacts.bin", "artifacts.json"):
            if (key_folder / name).exists():
                shutil.copy2(key_folder / name, into / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--compile", default="cudagraphs", choices=["default", "cudagraphs"])
    parser.add_argument("--timeout-s", type=float, default=400)
    parser.add_argument("--host2", default="folder", choices=["folder", "artifacts"],
                        help="what the second host gets of the first one's compile cache")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    results = []
    for drafters in [int(n) for n in args.threads.split(",")]:
        config = args.work / f"d{drafters}.yaml"
        args.work.mkdir(parents=True, exist_ok=True)
        write_config(config, drafters, args.device, args.compile)
        host1, host2 = args.work / f"workspace-d{drafters}-host1", args.work / f"workspace-d{drafters}-host2"
        for label, workspace in (("cold", host1), ("warm", host1), ("host2", host2)):
            if label == "host2":
                seed_host2(host1, host2, args.host2)
            row = {"drafters": drafters, "cache": label,
                   **first_step_s(workspace, args.work / f"d{drafters}-{label}", config, args.timeout_s)}
            results.append(row)
            print(f"drafters {drafters}  {label:5}  launch->first step {row['first_step_s']} s  "
                  f"exit {row['exit_code']}  {row['cache']}", flush=True)
    (args.work / "startup.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
