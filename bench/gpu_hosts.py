"""Two hosts on one machine of two GPUs (issue 11), and the drafter step at SpecForge's shape.

    HF_HUB_OFFLINE=1 PYTHONPATH=remote python3 bench/gpu_hosts.py PART [--work DIR] [...]

PART (one command each; tables on stdout, everything in $OUT/gpu_hosts-PART.json when $OUT is set):
  specforge   the drafter step at the shape SpecForge published for its DFlash-family
              trainer (Qwen3-8B drafter: hidden 4096, 5 layers; 256 anchors, block 16,
              sequence length 768; bf16 autocast), one sequence per step, timed as the
              trainer runs it (compile cudagraphs, flex attention) and eager (sdpa): ms per
              sample, FLOPs per sample counted by torch.utils.flop_counter.FlopCounterMode
              over one eager forward+backward (sdpa), our model count beside it
              (gpu_threads.step_flops, visible attention pairs only), MFU over 989 TFLOP/s.
              One GPU.
  exchange    gradient_exchange ms per step at the Qwen3-8B drafter's weights (the
              gradients' size does not depend on the context): (1) two processes, one GPU
              each, joined by the trainer's own distributed.join (NCCL): each lead's bucketed
              all-reduce, the multi-host path; (2) one process with a replica on each GPU,
              GradientExchange as the threaded trainer runs it (reduce_add onto GPU 0,
              broadcast back); (3) for reference, what the trainer did before: every
              replica's thread summing every replica's gradients onto its own GPU (R(R-1)
              peer copies), in two threads at once. Two GPUs.
  throughput  the whole trainer (`python -m dflash_train`, bench/gpu_trainer.py's random
              Qwen3-8B-architecture target, 3072-token sequences, compile cudagraphs, flex)
              in two layouts with the same global batch (two replicas, one sequence each a
              step): two "hosts" on 127.0.0.1, one process per GPU (CUDA_VISIBLE_DEVICES,
              RANK/WORLD_SIZE/MASTER_*, NCCL), each with its own target and drafter; and one
              process with a target and a drafter thread on each GPU. samples/s, step ms,
              MFU, and the drafters' wait (which holds the exchange). Two GPUs. The target is
              built once in --work (`prepare`, about a minute; /tmp/gpu from
              bench/gpu_trainer.py serves too).
  prepare     build that target in --work.

Without CUDA (or with fewer GPUs than a part needs) a part prints why and exits 0.
`--cpu-check` runs `exchange` (gloo) and `specforge` at a micro shape on the CPU, to
check this script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_threads import (H200_BF16_DENSE_PEAK, MICRO, QWEN3_8B, Frozen, Shape, build_step,  # noqa: E402
                         make_batches, make_objective, step_flops, time_mode, write_report)

REPO = Path(__file__).resolve().parent.parent
# SpecForge, docs/benchmarks/domino-disaggregated-performance.md: isolated trainer, Qwen3-8B drafter.
SPECFORGE = Shape("specforge", 4096, 5, 12288, 32, 8, 128, 151936, 16, 256, 768)
SPECFORGE_PUBLISHED = {"ms_per_sample": 105.6, "tflop_per_sample": 45.0, "mfu": 0.435}
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on the lent machines


def skip(reason: str) -> None:
    print(f"skipped: {reason}")
    raise SystemExit(0)


def need_gpus(count: int) -> None:
    if not torch.cuda.is_available():
        skip("needs CUDA")
    if torch.cuda.device_count() < count:
        skip(f"needs {count} GPUs, found {torch.cuda.device_count()}")


# -------------------------------------------------------------------------- specforge


def count_flops(shape: Shape, device: str) -> dict:
    """FlopCounterMode over one eager forward+backward (sdpa: the dense-mask attention
    counts every (query, key) pair, masked ones too, as SpecForge's count would)."""
    from torch.utils.flop_counter import FlopCounterMode

    frozen = Frozen(shape, device)
    objective = make_objective(shape, frozen, device, use_flex=False)
    batch = make_batches(shape, 1, 7, device)[0]
    step = build_step("off", objective, batch)  # one step already ran (warm-up)
    objective.drafter.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        step(batch)
    by_op = {str(op): flops for op, flops in counter.get_flop_counts().get("Global", {}).items()}
    del objective, step, batch, frozen
    return {"total": counter.get_total_flops(), "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1]))}


def part_specforge(shape: Shape, device: str, iters: int) -> dict:
    counted = count_flops(shape, device)
    ours = step_flops(shape)
    if device == "cuda":
        torch.cuda.empty_cache()
    frozen = Frozen(shape, device)
    modes = [("cudagraphs", True), ("off", False)] if device == "cuda" else [("off", False)]
    rows = []
    for mode, flex in modes:
        row = time_mode(shape, frozen, mode, device, iters, flex)
        row["ms_per_sample"] = row["step_ms"]  # one sequence per step
        row["mfu_counted"] = counted["total"] / (row["step_ms"] / 1e3) / H200_BF16_DENSE_PEAK
        row["mfu_ours"] = ours["total"] / (row["step_ms"] / 1e3) / H200_BF16_DENSE_PEAK
        rows.append(row)
        print(f"[specforge] {row}", flush=True)
    report = {"shape": shape.describe(), "flop_counter": counted, "our_count": ours, "rows": rows,
              "specforge_published": SPECFORGE_PUBLISHED}
    print(f"\n## drafter step at SpecForge's shape ({shape.describe()}), one sequence per step, median of {iters}")
    print(f"FLOPs per sample: FlopCounterMode {counted['total'] / 1e12:.2f} TFLOP (top ops: "
          + ", ".join(f"{op} {v / 1e12:.2f}" for op, v in list(counted["by_op"].items())[:4])
          + f"); our count {ours['total'] / 1e12:.2f} TFLOP (layers {ours['layers'] / 1e12:.2f}, attention "
          f"{ours['attention'] / 1e12:.2f} visible pairs only, fc {ours['fc'] / 1e12:.2f}, LM head "
          f"{ours['lm_head'] / 1e12:.2f}); SpecForge: ~{SPECFORGE_PUBLISHED['tflop_per_sample']:.0f} TFLOP")
    print("| trainer | mode | ms/sample (p10-p90) | TFLOP/sample (counter) | MFU (counter) | MFU (our count) | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| dflash | {r['mode']}{' + flex' if r['flex'] else ' (sdpa)'} | {r['step_ms']:.1f} "
              f"({r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}) | {counted['total'] / 1e12:.2f} "
              f"| {100 * r['mfu_counted']:.1f}% | {100 * r['mfu_ours']:.1f}% | {r['peak_gib']} |")
    print(f"| SpecForge (published) | isolated trainer | {SPECFORGE_PUBLISHED['ms_per_sample']} | "
          f"~{SPECFORGE_PUBLISHED['tflop_per_sample']:.0f} | {100 * SPECFORGE_PUBLISHED['mfu']:.1f}% | - | - |")
    return report


# --------------------------------------------------------------------------- exchange


def drafter_gradients(shape: Shape, device: str) -> list[torch.Tensor]:
    """Random fp32 gradients, one per parameter of the drafter at `shape` (built on the meta device)."""
    from transformers import Qwen3Config

    from dflash_train.config import DrafterConfig
    from dflash_train.model.drafter import DFlashDrafter, drafter_hf_config

    target = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=36, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, max_position_embeddings=40960)
    config = drafter_hf_config(target, DrafterConfig(num_layers=shape.layers, block_size=shape.block,
                                                     num_anchors=shape.anchors),
                               tuple(range(1, 1 + 8 * shape.feature_layers, 8)), mask_token_id=shape.vocab - 1)
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    generator = torch.Generator(device).manual_seed(0)
    return [torch.randn(p.shape, generator=generator, device=device) for p in drafter.parameters()]


def _sync(devices: list[str]) -> None:
    for device in dict.fromkeys(devices):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def time_exchange(exchange, grad_sets: list[list[torch.Tensor]], devices: list[str], block: int,
                  iters: int) -> list[float]:
    """ms of GradientExchange.average over `iters` steps (after 3 untimed), synchronized."""
    from dflash_train.devices import Fence
    from dflash_train.training.gradients import Posted

    facts = [torch.zeros(1 + 2 * (block - 1), device=device) for device in devices]
    times = []
    for i in range(iters + 3):
        _sync(devices)
        started = time.perf_counter()
        posted = [Posted(grads, fact, Fence(device), device) for grads, fact, device in zip(grad_sets, facts, devices)]
        averaged = exchange.average(posted)
        _sync(devices)
        times.append((time.perf_counter() - started) * 1e3)
        del averaged, posted
    return times[3:]


def time_peer_copies(grad_sets: list[list[torch.Tensor]], devices: list[str], iters: int) -> list[float]:
    """ms of what the trainer did before: each replica's thread (on its own stream) sums
    every replica's gradients, in replica order, onto its own device, all at once."""
    from dflash_train.devices import thread_stream

    barrier = threading.Barrier(len(devices) + 1)

    def replica(index: int) -> None:
        device = devices[index]
        with thread_stream(device):
            for _ in range(iters + 3):
                barrier.wait()
                means = []
                for grads in zip(*grad_sets):
                    total = grads[0].to(device, copy=True)
                    for grad in grads[1:]:
                        total.add_(grad.to(device, non_blocking=True))
                    means.append(total.div_(len(grads)))
                torch.cuda.current_stream(device).synchronize()
                del means
                barrier.wait()

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(len(devices))]
    for thread in threads:
        thread.start()
    times = []
    for _ in range(iters + 3):
        barrier.wait()
        started = time.perf_counter()
        barrier.wait()
        times.append((time.perf_counter() - started) * 1e3)
    for thread in threads:
        thread.join()
    return times[3:]


def exchange_child(shape_name: str, iters: int) -> None:
    """One rank of the two-process exchange (started by part_exchange with the rank's variables)."""
    from dflash_train.config import DistributedConfig
    from dflash_train.training.distributed import join
    from dflash_train.training.gradients import GradientExchange
    from dflash_train.runlog import ErrorLog, ThreadNames
    from dflash_train.threads import StopLatch

    shape = {"8b": QWEN3_8B, "micro": MICRO}[shape_name]
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"  # CUDA_VISIBLE_DEVICES gives each rank its own GPU
    if cuda:
        torch.cuda.set_device(0)
    scratch = Path(tempfile.mkdtemp(prefix="exchange-"))
    latch = StopLatch(ErrorLog(scratch / "errors.jsonl"), ThreadNames(scratch / "threads.json"))
    peers = join(DistributedConfig(), 1, cuda, latch, where=lambda: ("exchange", None), on_stuck=os._exit,
                 exit_after_s=10.0)
    assert peers is not None, "started without WORLD_SIZE"
    grads = drafter_gradients(shape, device)
    times = time_exchange(GradientExchange(peers.layout, peers), [grads], [device], shape.block, iters)
    peers.leave(ok=True)
    print("RESULT " + json.dumps({"rank": peers.rank, "backend": peers.backend, "ms": times,
                                  "gradient_bytes": sum(g.numel() * g.element_size() for g in grads)}), flush=True)


def two_processes(argv: list[str], envs: list[dict[str, str]], timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Run `argv` once per env at once; their output goes to files (a full pipe would block one)."""
    logs = [tempfile.TemporaryFile("w+") for _ in envs]
    procs = [subprocess.Popen(argv, env={**os.environ, **NCCL_ENV, **env}, stdout=log, stderr=subprocess.STDOUT,
                              text=True) for env, log in zip(envs, logs)]
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [subprocess.CompletedProcess(argv, proc.returncode, output) for proc, output in zip(procs, outputs)]


def rank_envs(cuda: bool) -> list[dict[str, str]]:
    import socket  # not tests/support, which imports dflash_cli: the GPU machine has the trainer's packages only
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_RANK": "0",
             "LOCAL_WORLD_SIZE": "1", "DFLASH_RUN_ID": f"bench-{port}",
             **({"CUDA_VISIBLE_DEVICES": str(r)} if cuda else {})} for r in range(2)]


def _summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": statistics.median(times), "p10_ms": ordered[len(ordered) // 10],
            "p90_ms": ordered[(9 * len(ordered)) // 10], "iters": len(times)}


def part_exchange(shape_name: str, iters: int, cuda: bool) -> dict:
    from dflash_train.training.distributed import Layout
    from dflash_train.training.gradients import GradientExchange

    shape = {"8b": QWEN3_8B, "micro": MICRO}[shape_name]
    rows = {}
    argv = [sys.executable, __file__, "exchange-child", "--shape", shape_name, "--iters", str(iters)]
    ranks = two_processes(argv, rank_envs(cuda), timeout_s=180)
    results = [json.loads(line[len("RESULT "):]) for r in ranks for line in r.stdout.splitlines()
               if line.startswith("RESULT ")]
    if len(results) != 2:
        rows["two processes"] = {"error": "; ".join(f"rank {i} exit {r.returncode}: {r.stdout[-1500:]}"
                                                   for i, r in enumerate(ranks))}
    else:
        rows["two processes"] = {**_summary(results[0]["ms"]), "backend": results[0]["backend"],
                                 "rank1_median_ms": statistics.median(results[1]["ms"])}
    devices = ["cuda:0", "cuda:1"] if cuda else ["cpu", "cpu"]
    grad_sets = [drafter_gradients(shape, device) for device in devices]
    gradient_bytes = sum(g.numel() * g.element_size() for g in grad_sets[0])
    exchange = GradientExchange(Layout(local_replicas=2), None)
    rows["one process, two replicas"] = _summary(time_exchange(exchange, grad_sets, devices, shape.block, iters))
    if cuda:
        rows["before: peer copies, one process"] = _summary(time_peer_copies(grad_sets, devices, iters))
    report = {"shape": shape.describe(), "gradient_gib": gradient_bytes / 2**30, "rows": rows}
    print(f"\n## gradient exchange per step, {shape.name} drafter weights ({gradient_bytes / 2**30:.2f} GiB of fp32 "
          f"gradients per replica), two replicas, median of {iters}")
    print("| layout | what runs | ms per step (p10-p90) | GB/s of gradients |")
    print("| --- | --- | --- | --- |")
    backend = rows["two processes"].get("backend", "nccl")
    what = {"two processes": f"each lead: bucketed all-reduce ({backend} between the processes)",
            "one process, two replicas": "lead: reduce_add onto GPU 0, /2, broadcast back",
            "before: peer copies, one process": "each replica's thread: copy the other's, sum (R(R-1) copies)"}
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | {what[name]} | {row['error'][:300]} | - |")
            continue
        print(f"| {name} | {what[name]} | {row['median_ms']:.1f} ({row['p10_ms']:.1f}-{row['p90_ms']:.1f}) "
              f"| {gradient_bytes / (row['median_ms'] / 1e3) / 1e9:.0f} |")
    return report


# ------------------------------------------------------------------------- throughput


def part_throughput(work: Path, steps: int, warmup: int, timeout_s: float) -> dict:
    import gpu_trainer as trainer

    target = work / "qwen3-8b-random"
    if not target.exists():
        skip(f"no target in {target}: run `bench/gpu_hosts.py prepare --work {work}` first")
    shape = QWEN3_8B
    data = work / "train.jsonl"
    trainer.write_data(data, samples=2 * steps, words=shape.seq_len + 64)
    from dflash_train.model.drafter import default_target_layer_ids

    architecture = trainer.QWEN3_8B_TARGET
    layers_run = max(default_target_layer_ids(architecture["num_hidden_layers"], shape.feature_layers)) + 1
    flops = (step_flops(shape)["total"], trainer.target_forward_flops(architecture, layers_run, shape.seq_len))
    both = trainer.RunSpec("threaded", (0, 1), (0, 1), steps)  # the global batch of both layouts
    sampler = trainer.GpuSampler()
    runs = {}
    shutil.rmtree(work / f"run-{both.name}", ignore_errors=True)  # events.jsonl is appended to
    try:
        runs["one process, a target and a drafter thread per GPU"] = trainer.run_trainer(
            both, work, target, data, shape, False, warmup, flops, sampler, timeout_s)
        runs["two processes (hosts), one GPU each, NCCL"] = two_hosts(
            work, target, data, shape, steps, warmup, flops, sampler, timeout_s)
    finally:
        sampler.stop()
    report = {"target": "Qwen3-8B-architecture", "warmup": warmup, "compile": "cudagraphs", "runs": runs,
              "flops_per_sample": {"drafter": flops[0], "target": flops[1], "target_layers_run": layers_run}}
    trainer.print_tables(report, shape)
    one, two = runs.values()
    if "samples_per_s" in one and "samples_per_s" in two:
        print(f"two processes / one process samples/s: {two['samples_per_s'] / one['samples_per_s']:.3f}")
    return report


def two_hosts(work: Path, target: Path, data: Path, shape: Shape, steps: int, warmup: int, flops, sampler,
              timeout_s: float) -> dict:
    """Both ranks of the trainer, each on the GPU CUDA_VISIBLE_DEVICES gives it; rank 0's
    events are the run's (its step events count every replica)."""
    import gpu_trainer as trainer

    per_host = trainer.RunSpec("threaded", (0,), (0,), steps)
    for rank in range(2):  # events.jsonl is appended to: start from none
        shutil.rmtree(work / f"run-two-hosts-rank{rank}", ignore_errors=True)
    config = work / "two-hosts.yaml"
    trainer.write_config(config, target, data, per_host, shape, False)
    config.write_text(config.read_text() + "distributed: {backend: nccl}\n")
    argv = lambda rank: [sys.executable, "-m", "dflash_train", "--config", str(config),  # noqa: E731
                         "--run-dir", str(work / f"run-two-hosts-rank{rank}")]
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "remote")}
    started = time.perf_counter()
    procs = [subprocess.Popen(argv(rank), env={**os.environ, **NCCL_ENV, **env, **rank_env})
             for rank, rank_env in enumerate(rank_envs(True))]
    error = None
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout_s:.0f}s"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    both = trainer.RunSpec("threaded", (0, 1), (0, 1), steps)  # samples and MFU over both GPUs
    result = trainer.summarize(work / "run-two-hosts-rank0", both, warmup, *flops, shape.seq_len, sampler)
    result["exit_codes"] = [proc.returncode for proc in procs]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    replicas = [json.loads(line) for rank in range(2)
                for line in (work / f"run-two-hosts-rank{rank}" / "events.jsonl").read_text().splitlines()
                if '"type": "replicas"' in line]
    if replicas:
        result["replica_sha256"] = [c for sums in replicas[0]["sha256_by_rank"] for c in sums]
    if error:
        result["error"] = error
    for rank in range(2):
        errors = work / f"run-two-hosts-rank{rank}" / "errors.jsonl"
        if errors.exists() and errors.read_text().strip():
            first = json.loads(errors.read_text().splitlines()[0])
            result.setdefault("first_error", f"rank {rank} {first['thread']}: {first['exc_type']}: "
                                             f"{first['message'][:400]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["specforge", "exchange", "throughput", "prepare", "exchange-child"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu"))
    parser.add_argument("--iters", type=int, default=20, help="timed steps (specforge, exchange)")
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per layout (throughput)")
    parser.add_argument("--warmup", type=int, default=5, help="trainer steps left out of the averages")
    parser.add_argument("--timeout-s", type=float, default=200, help="per trainer run (throughput)")
    parser.add_argument("--shape", default="8b", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-check", action="store_true", help="micro shapes on the CPU (gloo)")
    args = parser.parse_args()
    if args.part == "exchange-child":
        exchange_child(args.shape, args.iters)
        return
    if args.cpu_check:
        report = {"exchange": part_exchange("micro", 3, cuda=False),
                  "specforge": part_specforge(MICRO, "cpu", 2)}
        write_report(report, "gpu_hosts-cpu-check.json")
        return
    if args.part == "prepare":
        import gpu_trainer as trainer

        need_gpus(1)
        args.work.mkdir(parents=True, exist_ok=True)
        if not (args.work / "qwen3-8b-random").exists():
            trainer.build_target(args.work / "qwen3-8b-random", trainer.QWEN3_8B_TARGET, "cuda:0")
        return
    need_gpus(1 if args.part == "specforge" else 2)
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "argv": sys.argv}
    if args.part == "specforge":
        from dflash_train.compiling.policy import configure_compiler

        configure_compiler("cudagraphs", 16)  # as gpu_threads: every drafter compiled here guards the same code
        report["specforge"] = part_specforge(SPECFORGE, "cuda", args.iters)
    elif args.part == "exchange":
        report["exchange"] = part_exchange("8b", args.iters, cuda=True)
    else:
        report["throughput"] = part_throughput(args.work, args.steps, args.warmup, args.timeout_s)
    write_report(report, f"gpu_hosts-{args.part}.json")


if __name__ == "__main__":
    main()
