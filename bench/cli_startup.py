"""Launch -> first step as a user meets it: `dflash launch local --config C --follow`, cold and warm.

    HF_HUB_OFFLINE=1 python3 bench/cli_startup.py --work /tmp/cli [--case NAME ...] [--set KEY=VALUE ...]
        [--target PATH --train PATH --prompts PATH] [--timeout-s 300]

Cases (each in a fresh workspace of its own: no release, no compile cache, no warm
interpreter; "cold" is its first launch, "warm" a second launch of the same config in the
same workspace, once the warm interpreter the first one started is ready or 60 s passed;
--warm-idle-s 0: with no warm interpreter, as before there was one):
  tiny-d1-dynamic   configs/train/tiny-gpu.yaml, 1 drafter, compile cudagraphs, compile_shapes dynamic
  tiny-d2-static    configs/train/tiny-gpu.yaml, 2 drafters, compile cudagraphs, compile_shapes static
  tiny-default      configs/train/tiny-gpu.yaml as shipped but compile cudagraphs (compile_shapes its default)
  8b                configs/train/qwen3-8b.yaml as shipped, its paths pointed at --target/--train/--prompts
                    (bench/fit_h200.py prepare makes them), evaluations cut to 2 prompts of 32 tokens
The tiny cases set pad_multiple 32 (the layout the start-up was first measured with). Every case
ends after 3 steps (optim.max_steps), so --follow returns.

Each launch is the CLI in a new process, as typed: the clock starts before it starts, and
the first step is the first `step` event's timestamp in the run's events.jsonl (the line
`watch` prints comes from it). Printed per launch: launch -> first step, the deploy's
share (until run.json's started_at), run.json's started_by and warm_reason, and each
start-up phase's seconds from its `done` event, and each drafter's build as its event
breaks it down (tracing, Inductor, the caches' hits and misses, graphs traced and loaded:
a warm launch that compiles again shows as misses). $WORK/cli_startup.json holds the rows
($OUT/cli_startup.json too when OUT is set).
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

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "train" / "tiny-gpu.yaml"
TINY_SETS = ["compile=cudagraphs", "data.pad_multiple=32", "optim.max_steps=3", "eval.num_prompts=0",
             "checkpoint.every=0"]
CASES = {
    "tiny-d1-dynamic": (TINY, TINY_SETS + ["devices.drafters=[cuda:0]", "compile_shapes=dynamic"]),
    "tiny-d2-static": (TINY, TINY_SETS + ["devices.drafters=[cuda:0, cuda:0]", "compile_shapes=static"]),
    "tiny-default": (TINY, TINY_SETS),
    "8b": (REPO / "configs" / "train" / "qwen3-8b.yaml",
           ["optim.max_steps=3", "eval.num_prompts=2", "eval.max_new_tokens=32"]),
}


def launch(work: Path, workspace: Path, config: Path, sets: list[str], timeout_s: float,
           warm_idle_s: float | None) -> dict:
    hosts = work / "hosts.yaml"
    env_line = "" if warm_idle_s is None else f"    env: {{DFLASH_WARM_IDLE_S: '{warm_idle_s:g}'}}\n"
    hosts.write_text(f"hosts:\n  local:\n    transport: local\n    workspace: {workspace}\n{env_line}")
    argv = [sys.executable, "-m", "dflash_cli", "--hosts", str(hosts), "--logs-dir", str(work / "logs"),
            "launch", "local", "--config", str(config), "--follow"]
    for item in sets:
        argv += ["--set", item]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'remote'}", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    started = time.time()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    ended = time.time()
    run_id = proc.stdout.splitlines()[0].strip() if proc.stdout.strip() else None
    row = {"exit_code": proc.returncode, "run_id": run_id, "wall_s": round(ended - started, 1)}
    run_dir = workspace / "runs" / run_id if run_id else None
    if run_dir is None or not (run_dir / "events.jsonl").exists():
        row["stderr_tail"] = proc.stderr.splitlines()[-30:]
        return row
    run = json.loads((run_dir / "run.json").read_text())
    events = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    steps = [e["ts"] for e in events if e.get("type") == "step"]
    row.update(first_step_s=round(steps[0] - started, 1) if steps else None,
               deploy_s=round(run["started_at"] - started, 1) if isinstance(run.get("started_at"), (int, float)) else None,
               started_by=run.get("started_by"), warm_reason=run.get("warm_reason"),
               phases={e["label"]: e.get("duration_s") for e in events
                       if e.get("type") == "startup" and e.get("state") == "done"},
               builds=[{k: e.get(k) for k in BUILD_FIELDS} for e in events
                       if e.get("type") == "startup" and e.get("phase") == "build train step" and e.get("state") == "done"])
    if not steps:
        row["stderr_tail"] = proc.stderr.splitlines()[-30:]
    return row


# What each drafter's `build train step` event says of its build (docs/events.md).
BUILD_FIELDS = ("drafter", "duration_s", "trace_s", "inductor_s", "inductor_cache_hits", "inductor_cache_misses",
                "autograd_cache_hits", "autograd_cache_misses", "graphs_traced", "graphs_loaded", "warmup_s",
                "capture_s", "optimizer_s")


def wait_warm_ready(workspace: Path, limit_s: float = 60.0) -> float:
    """Seconds waited until a warm interpreter of the workspace says `ready` (or the limit)."""
    started = time.time()
    while time.time() - started < limit_s:
        for pid_file in (workspace / "warm").glob("*/pid.json"):
            try:
                if json.loads(pid_file.read_text()).get("state") == "ready":
                    return round(time.time() - started, 1)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)
    return round(time.time() - started, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/cli-startup"))
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="added to every case, replacing its own value of that key")
    parser.add_argument("--target", type=Path, help="8b: the target folder (fit_h200.py prepare)")
    parser.add_argument("--train", type=Path, help="8b: the chat jsonl")
    parser.add_argument("--prompts", type=Path, help="8b: the prompts jsonl")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--warm-idle-s", type=float, help="the host's DFLASH_WARM_IDLE_S (0: no warm interpreter, "
                                                           "every launch a new interpreter; default: the agent's)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.case or ["tiny-d1-dynamic", "tiny-d2-static"]:
        config, sets = CASES[case]
        given = {item.split("=", 1)[0] for item in args.set}  # --set replaces a case's own value of a key
        sets = [item for item in sets if item.split("=", 1)[0] not in given] + args.set
        if case == "8b":
            if not (args.target and args.train and args.prompts):
                raise SystemExit("case 8b needs --target, --train and --prompts (bench/fit_h200.py prepare)")
            sets = sets + [f"target.path={args.target}", f"data.train={args.train}", f"data.eval={args.prompts}"]
        workspace = args.work / f"workspace-{case}"
        shutil.rmtree(workspace, ignore_errors=True)
        for label in ("cold", "warm"):
            waited = wait_warm_ready(workspace) if label == "warm" and args.warm_idle_s != 0 else 0.0
            row = {"case": case, "launch": label, "waited_for_warm_s": waited,
                   **launch(args.work, workspace, config, sets, args.timeout_s, args.warm_idle_s)}
            rows.append(row)
            phases = ", ".join(f"{k} {v:.1f}" for k, v in (row.get("phases") or {}).items() if v is not None)
            print(f"{case:16} {label:4}  launch->first step {row.get('first_step_s')} s  (deploy {row.get('deploy_s')} s)  "
                  f"exit {row['exit_code']}  started_by {row.get('started_by')} {row.get('warm_reason') or ''}\n"
                  f"    phases (s): {phases}", flush=True)
            for build in row.get("builds") or []:
                print(f"    build drafter {build['drafter']}: {build['duration_s']} s, tracing {build['trace_s']} s, "
                      f"Inductor {build['inductor_s']} s (cache {build['inductor_cache_hits']} hit(s) "
                      f"{build['inductor_cache_misses']} miss(es)), {build['graphs_traced']} graph(s) traced, "
                      f"{build['graphs_loaded']} loaded", flush=True)
            for line in row.get("stderr_tail", []):
                print(f"    | {line}", flush=True)
    text = json.dumps(rows, indent=1)
    (args.work / "cli_startup.json").write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "cli_startup.json").write_text(text)


if __name__ == "__main__":
    main()
