"""How long a checkpoint's verification against its SHA256SUMS takes (dflash_files.checksums.verify,
what `resume`, a restart and `status` run on the host before they trust a checkpoint).

    python3 bench/checkpoint_verify.py [--gb 4.2] [--folder /tmp/ckpt-verify] [--keep]

Writes a checkpoint-shaped folder of random bytes, --gb in all, split as the Qwen3-8B
drafter's (configs/train/qwen3-8b.yaml): model.safetensors 1/3 (fp32 weights, 4.19 GB at
that size), optimizer.pt 2/3 (AdamW's two moments, 8.39 GB), state.json and config.yaml;
then its SHA256SUMS. It times `verify` from the page cache (warm), and, as root, from the
disk after dropping the page cache (cold); the file read alone (`cat` at 16 MiB a read)
and one core's SHA-256 on a buffer in memory, for comparison; and prints what each rate
means for the 8B checkpoint's 12.58 GB.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "remote"))
from dflash_files.checkpoint_files import LOADED_FILES, SHA256SUMS  # noqa: E402
from dflash_files.checksums import sums_text, verify  # noqa: E402

EIGHT_B_GB = 4.194505728 + 8.389011456  # the qwen3-8b.yaml drafter's fp32 weights and AdamW moments
BLOCK = 64 << 20


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as handle:
        left = size
        while left:
            count = min(BLOCK, left)
            handle.write(os.urandom(count))
            left -= count


def drop_page_cache() -> bool:
    """Whether the page cache could be dropped (root only)."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(what) -> float:
    start = time.perf_counter()
    what()
    return time.perf_counter() - start


def report(label: str, seconds: float, size: int) -> None:
    rate = size / seconds / 1e9
    print(f"{label:<44} {seconds:7.2f} s  {rate:5.2f} GB/s  -> 8B checkpoint ({EIGHT_B_GB:.2f} GB): "
          f"{EIGHT_B_GB / rate:5.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=4.2)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ckpt-verify"))
    parser.add_argument("--keep", action="store_true", help="leave the folder (default: removed at the end)")
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    folder = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"model.safetensors": total // 3, "optimizer.pt": total - total // 3}
    try:
        for name, size in sizes.items():
            if not (folder / name).exists() or (folder / name).stat().st_size != size:
                write_random(folder / name, size)
        (folder / "state.json").write_text('{"step": 1}\n')
        (folder / "config.yaml").write_text("job: train\n")
        names = [*sizes, "state.json", "config.yaml"]
        (folder / SHA256SUMS).write_text(sums_text(str(folder), names))
        size = sum((folder / name).stat().st_size for name in names)
        print(f"{folder}: {size / 1e9:.2f} GB ({', '.join(f'{n} {s / 1e9:.2f} GB' for n, s in sizes.items())}); "
              f"{os.cpu_count()} CPUs; {sys.version.split()[0]}; hashlib {hashlib.sha256().name} via OpenSSL",
              flush=True)

        buffer = os.urandom(256 << 20)
        digest = hashlib.sha256()
        report("one core's SHA-256, in memory", timed(lambda: [digest.update(buffer) for _ in range(8)]),
               8 * len(buffer))
        for cold in (True, False):
            if cold and not drop_page_cache():
                print("cold: not measured (dropping the page cache needs root)")
                continue
            state = "cold (from the disk)" if cold else "warm (page cache)"
            read = ["cat", *[str(folder / name) for name in sizes]]
            report(f"the files read alone, {state}", timed(lambda: subprocess.run(read, stdout=subprocess.DEVNULL,
                                                                                 check=True)), size)
            if cold:
                drop_page_cache()
            verdict = None

            def check() -> None:
                nonlocal verdict
                verdict = verify(str(folder), LOADED_FILES)
            report(f"verify, {state}", timed(check), size)
            assert verdict is not None and verdict.intact and verdict.hashed_bytes == size, verdict
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
