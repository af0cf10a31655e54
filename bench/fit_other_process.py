"""The fit check on a GPU another process holds memory on, and the estimate against what the
shipped one-GPU config holds, on one CUDA GPU (issue 51, docs/fit-check.md).

    PYTHONPATH=.:remote:bench python3 bench/fit_other_process.py [--work /tmp/fit51] [--hold-gb 16] [--budget-s 235]
        [--steps 4] [--conversations 200]

No network: the target is a random-weight Qwen3-8B-architecture model built here
(bench/gpu_trainer.py), the data chat rows of its word-level vocabulary (bench/fit_h200.py).
Each check prints one line `CHECK <name>: PASS|FAIL|SKIP - <what was seen>`, each record
also as a JSON line (and to $OUT/fit_other_process.jsonl when OUT is set); the last line
is the summary, and the exit code is 0 only when no check failed.

1. `alone`: `python -m dflash_cli launch local --config configs/train/qwen3-8b.yaml --dry-run`
   (the built-in `local` host; HF_HOME points at a cache holding Qwen/Qwen3-8B's
   config.json, as a host's would; --set data.train/data.eval to the work folder's data)
   with nothing else on cuda:0 must exit 0 with `fits`.
2. `held`: a child process builds the random-weight target on cuda:0 (what the next part
   trains) and allocates more until it holds --hold-gb GB there; the same dry run must
   exit 2, say DOES NOT FIT, and name the memory other processes hold (the line says
   whether by the child's pid: nvidia-smi may see another PID namespace than this one).
   The child then saves the target and exits.
3. `estimate`: `python -m dflash_train` on qwen3-8b.yaml as shipped but for its paths,
   optim.max_steps (--steps) and a short evaluation (bench/fit_h200.py's `train`), in what
   is left of --budget-s: the fit check's estimate for that config against the peak of
   nvidia-smi's memory.used on cuda:0 (less what it showed before the run) and against
   torch's (the step events' max_memory_allocated plus the graph pools' reserve, the
   `ready` events' parts); PASS when within 2% of nvidia-smi's. A run the budget cuts
   after a step is measured as far as it went; one cut before any step is a SKIP (a rerun
   with the same --work skips building the target and finds the compile cache warm).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "remote"), str(REPO / "bench")]
CONFIG = REPO / "configs" / "train" / "qwen3-8b.yaml"
TARGET = "Qwen/Qwen3-8B"
SNAPSHOT = "0" * 40  # a commit id, as the hub names snapshots
GIB = 1 << 30
TOLERANCE = 0.02
STARTED = time.monotonic()
results: list[dict] = []


def record(item: dict) -> None:
    results.append(item)
    print(json.dumps(item), flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "fit_other_process.jsonl", "a") as f:
            f.write(json.dumps(item) + "\n")


def check(name: str, outcome: str, seen: str, **detail) -> None:
    elapsed = round(time.monotonic() - STARTED)
    print(f"CHECK {name}: {outcome} - {seen} [{elapsed} s in]", flush=True)
    record({"check": name, "outcome": outcome, "seen": seen, "elapsed_s": elapsed, **detail})


def env_for_children(work: Path) -> dict[str, str]:
    paths = [str(REPO), str(REPO / "remote"), str(REPO / "bench"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "HF_HOME": str(work / "hf"),
            "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}


def gpu0_used_mib() -> float:
    """cuda:0's memory.used, as the fit check reads it (dflash_agent/gpus.py)."""
    from dflash_agent.gpus import query_gpus

    found, problem = query_gpus()
    if problem or not found:
        raise RuntimeError(f"nvidia-smi: {problem or 'no GPU listed'}")
    return float(next(gpu["memory_used_mib"] for gpu in found if gpu["index"] == 0) or 0.0)


def cache_config_json(work: Path) -> None:
    """Qwen/Qwen3-8B's config.json in work/hf as huggingface_hub lays a cache out, from the
    architecture the random-weight target is built with."""
    from transformers import AutoConfig

    from gpu_trainer import QWEN3_8B_TARGET, QWEN3_DEFAULTS

    repo = work / "hf" / "hub" / f"models--{TARGET.replace('/', '--')}"
    fields = {**QWEN3_DEFAULTS, **QWEN3_8B_TARGET}
    AutoConfig.for_model(fields.pop("model_type"), **fields, tie_word_embeddings=False).save_pretrained(
        repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)


def dry_run(work: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "dflash_cli", "--logs-dir", str(work / "logs"), "launch", "local",
            "--config", str(CONFIG.relative_to(REPO)), "--dry-run",
            "--set", f"data.train={work / 'chat.jsonl'}", "--set", f"data.eval={work / 'prompts.jsonl'}"]
    print("$ " + " ".join(argv), flush=True)
    done = subprocess.run(argv, cwd=REPO, env=env_for_children(work), capture_output=True, text=True, timeout=120)
    said = " ".join(done.stderr.split())
    record({"dry_run": argv[3:], "exit_code": done.returncode, "stderr_tail": said[-1500:]})
    return done


def verdict_line(stderr: str) -> str:
    """The refusal, else the table's total row."""
    said = " ".join(stderr.split())
    found = re.search(r"dflash: error: (.*)", said) or re.search(r"(total .*?(fits|DOES NOT FIT): .*?\))", said)
    return found.group(1)[:600] if found else said[-600:]


# -- the child: holds memory on cuda:0 ------------------------------------------------------

def hold(gigabytes: float, build: Path | None) -> None:
    """Build the random-weight target on cuda:0 (unless `build` is None), allocate more until
    `gigabytes` GB are held, say `holding <bytes> <pid>`, save the target (`saved`), and
    hold it all until stdin closes."""
    import torch

    held = []
    if build is not None:
        from gpu_trainer import QWEN3_8B_TARGET, make_target

        model, tokenizer = make_target(QWEN3_8B_TARGET, "cuda:0")
        held.append(model)
    torch.cuda.synchronize()
    have = torch.cuda.memory_allocated(0)
    if gigabytes * 1e9 > have:
        held.append(torch.empty(int(gigabytes * 1e9 - have), dtype=torch.uint8, device="cuda:0"))
    torch.cuda.synchronize()
    print(f"holding {torch.cuda.memory_allocated(0)} {os.getpid()}", flush=True)
    if build is not None:
        staging = build.with_name(build.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(str(staging), max_shard_size="4GB")
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, build)
        print(f"saved {build}", flush=True)
    sys.stdin.read()  # until the parent closes it


class Holder:
    """The child process that holds memory, talked to over its stdin and stdout (its lines
    read by a thread into a queue, so that waiting for one has a deadline)."""

    def __init__(self, work: Path, gigabytes: float, build: Path | None):
        argv = [sys.executable, __file__, "--work", str(work), "hold", "--hold-gb", str(gigabytes)]
        if build is not None:
            argv += ["--build", str(build)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env_for_children(work))
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # it ended

    def line(self, prefix: str, timeout_s: float) -> str:
        """The child's next line that starts with `prefix` (others are shown)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"no {prefix!r} from the holding process within {timeout_s:.0f} s") from None
            if line is None:
                raise RuntimeError(f"the holding process ended (exit {self.proc.wait()}) before {prefix!r}")
            if line.startswith(prefix):
                return line.strip()
            print(f"  holder: {line.rstrip()}", flush=True)

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the parts --------------------------------------------------------------------------------

def refused_while_held(work: Path, gigabytes: float, target_folder: Path) -> bool:
    """Checks `alone` and `held`; whether the target is saved for `estimate`."""
    alone = dry_run(work)
    fits = alone.returncode == 0 and re.search(r"\bfits: ", alone.stderr) is not None
    check("alone", "PASS" if fits else "FAIL",
          f"exit {alone.returncode} with nothing held on cuda:0: {verdict_line(alone.stderr)}")
    build = None if (target_folder / "config.json").exists() else target_folder
    target_folder.parent.mkdir(parents=True, exist_ok=True)
    holder = Holder(work, gigabytes, build)
    saved = build is None
    try:
        _, allocated, pid = holder.line("holding ", 600).split()
        time.sleep(2)  # nvidia-smi's view catches up
        print(f"  holder pid {pid}: {int(allocated) / 1e9:.1f} GB allocated; cuda:0 memory.used "
              f"{gpu0_used_mib() / 1024:.1f} GiB", flush=True)
        held = dry_run(work)
        said = " ".join(held.stderr.split())
        named = re.search(rf"held by other processes: [^;]*\bpid {pid}\b", said) is not None
        counted = "held by other processes: " in said
        refused = held.returncode == 2 and "DOES NOT FIT" in said and counted
        how = ("naming the holder's pid" if named else "naming the held memory, not by the holder's pid (nvidia-smi "
               "sees processes in another PID namespace than this one)" if counted else "naming no held memory")
        check("held", "PASS" if refused else "FAIL", f"exit {held.returncode}, {how}: {verdict_line(held.stderr)}",
              holder_pid=int(pid), allocated_bytes=int(allocated))
        if build is not None:
            holder.line("saved ", 600)
            saved = True
    except RuntimeError as exc:
        check("held", "FAIL", str(exc))
    finally:
        holder.release()
    deadline = time.monotonic() + 30
    while gpu0_used_mib() > 2048 and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"  holder gone: cuda:0 memory.used {gpu0_used_mib() / 1024:.2f} GiB", flush=True)
    return saved


def estimate_against_measured(work: Path, target_folder: Path, steps: int, timeout_s: float) -> None:
    import yaml

    import fit_h200
    from dflash_train.config import load_job_config
    from dflash_train.memory.plan import TargetShape, estimate

    if timeout_s < 90:
        check("estimate", "SKIP", f"only {timeout_s:.0f} s of the budget left for the run (raise --budget-s)")
        return
    target = TargetShape.from_config_json(json.loads((target_folder / "config.json").read_text()))
    shipped = estimate(load_job_config(CONFIG), target).devices[0].total
    idle_mib = gpu0_used_mib()
    # A short evaluation, as bench/fit_h200.py's `train` runs it; no checkpoint on the stop
    # the budget may make (it would write 12.6 GB first).
    overrides = {"target.path": str(target_folder), "data.train": str(work / "chat.jsonl"),
                 "data.eval": str(work / "prompts.jsonl"), "optim.max_steps": steps, "eval.num_prompts": 2,
                 "eval.max_new_tokens": 32, "checkpoint.on_stop": False}
    print(f"training {CONFIG.name} for {steps} steps (at most {timeout_s:.0f} s)", flush=True)
    run_dir = fit_h200.run_job(CONFIG, work, overrides, "fit51", timeout_s)
    summary = fit_h200.summarize(run_dir, CONFIG)
    planned = estimate(load_job_config(run_dir / "config.yaml"), target).devices[0].total
    smi = (summary.get("nvidia_smi") or {}).get("0") or (summary.get("nvidia_smi") or {}).get(0) or {}
    measured = (smi.get("peak_mib", 0.0) - idle_mib) * (1 << 20)
    torch_peak = summary.get("peak_memory_gib")  # the step events' max_memory_allocated
    pools = [part["bytes"] / GIB for event in summary.get("ready") or [] for part in event.get("memory") or []
             if part.get("part", "").endswith(" CUDA graphs")]  # their reserve beyond live tensors
    torch_held = None if torch_peak is None else torch_peak + sum(pools)
    code = summary.get("exit_code")
    detail = {"estimate_gib": round(planned / GIB, 2), "shipped_estimate_gib": round(shipped / GIB, 2),
              "nvidia_smi_peak_gib": round(measured / GIB, 2), "idle_gib": round(idle_mib / 1024, 2),
              "torch_peak_allocated_gib": torch_peak, "graph_pools_gib": [round(g, 2) for g in pools],
              "steps": summary.get("steps"), "exit_code": code, "wall_s": summary.get("wall_s"),
              "error": summary.get("error"), "log_tail": summary.get("log_tail")}
    if summary.get("error"):  # the trainer recorded a failure (an out-of-memory one, say)
        check("estimate", "FAIL", f"the run failed at step {summary.get('steps')} (exit {code}): "
              f"{summary['error'][:400]}; nvidia-smi's peak {measured / GIB:.1f} GiB, estimate "
              f"{planned / GIB:.1f} GiB", **detail)
        return
    if not summary.get("steps") or measured <= 0:
        check("estimate", "SKIP", f"no step within {timeout_s:.0f} s (exit {code}): nothing measured at the run's "
              "peak; its log's tail is in the JSON record", **detail)
        return
    error = (planned - measured) / measured
    cut = "" if code == 0 else f"; the budget cut the run after step {summary.get('steps')} (exit {code})"
    torch_said = (f"torch's peak allocated {torch_peak:.1f} GiB + graph pools' reserve {sum(pools):.1f} GiB = "
                  f"{torch_held:.1f} GiB" if torch_held is not None else "no torch figure")
    check("estimate", "PASS" if abs(error) <= TOLERANCE else "FAIL",
          f"estimate {planned / GIB:.1f} GiB (the shipped config's, with its own evaluation: {shipped / GIB:.1f}) "
          f"vs nvidia-smi's peak memory.used {measured / GIB:.1f} GiB above idle: {error:+.1%} (the goal: within "
          f"{TOLERANCE:.0%}); {torch_said}{cut}", **detail)


def preflight() -> str | None:
    """Why this machine cannot run the checks, or None."""
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi on PATH"
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported: {exc}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    done = subprocess.run([sys.executable, "-c", "import dflash_cli.cli, dflash_train.memory.plan, fit_h200"],
                          env=env_for_children(Path("/nonexistent")), capture_output=True, text=True)
    if done.returncode != 0:
        return f"the CLI cannot be imported here: {done.stderr.strip().splitlines()[-1:]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", nargs="?", choices=["all", "hold"], default="all", help="hold: the child's part")
    parser.add_argument("--work", type=Path, default=Path("/tmp/fit51"))
    parser.add_argument("--hold-gb", type=float, default=16.0)
    parser.add_argument("--build", type=Path, help="(hold) build and save the target here")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=200,
                        help="training rows (bench/fit_h200.py's); fewer than its 600 to tokenize in seconds")
    parser.add_argument("--budget-s", type=float, default=235.0, help="the whole script's time")
    args = parser.parse_args()
    if args.part == "hold":
        hold(args.hold_gb, args.build)
        return
    problem = preflight()
    if problem is not None:
        check("machine", "FAIL", problem)
        sys.exit(1)
    import fit_h200

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    cache_config_json(work)
    fit_h200.write_chat_data(work, args.conversations, 8)
    target_folder, _ = fit_h200.target_folder(work, CONFIG)
    try:
        saved = refused_while_held(work, args.hold_gb, target_folder)
        if saved:
            left = args.budget_s - (time.monotonic() - STARTED) - 15
            estimate_against_measured(work, target_folder, args.steps, left)
        else:
            check("estimate", "SKIP", "the target was not saved: nothing to train")
    except Exception as exc:  # noqa: BLE001 - said as a failed check, with what came before
        check("script", "FAIL", f"{type(exc).__name__}: {exc}")
    failed = [r["check"] for r in results if r.get("outcome") == "FAIL"]
    outcomes = ", ".join(f"{r['check']} {r['outcome']}" for r in results if "outcome" in r)
    print(f"SUMMARY: {outcomes}; {time.monotonic() - STARTED:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
