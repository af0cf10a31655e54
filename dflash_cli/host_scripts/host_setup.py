"""The host side of `dflash setup`. Standard library only, Python 3.8+.

This file is not imported on the host: the CLI sends its source as `python -c SOURCE
WORKSPACE REQUEST`, run by the host's own interpreter before anything is installed
there. REQUEST is a JSON object:

    requirements  the text of remote/requirements.txt (one requirement a line)
    torch         a torch version to install instead of the requirements' range, or null
    index_url     where torch comes from: a URL, "pip" (the indexes pip on the host is
                  configured with), or null: the PyTorch index matching the host's CUDA
                  driver (TORCH_INDEXES), the CPU one where there is no nvidia-smi

It writes JSON lines on stdout: {"pip": LINE} for each line venv and pip print, as they
come, then one result:

    {"status": "unchanged" | "switched" | "installed", "env": PATH, "key": KEY,
     "torch_index": URL or "pip", "previous": PATH or null}
    {"status": "failed", "step": "lock" | "driver" | "venv" | "torch" | "requirements",
     "error": MESSAGE, "env": PATH of the environment still in use, or null}

Layout: <workspace>/envs/<KEY>/ is a virtualenv; KEY hashes its STAMP (the requirements,
the torch requirement, the torch index and the interpreter's version), and SETUP.json in
it, written last, holds that stamp: an environment without it is unfinished. The link
<workspace>/env points at the environment in use and is switched with one atomic
rename, only after the new one is complete, so a failed or interrupted install leaves
the previous one working (SIGTERM, SIGHUP or a closed stdout kill pip and remove the
unfinished folder; after SIGKILL the next setup removes it). After a switch,
environments other than the new and the previous one are removed. Setups of one
workspace take turns (.setup.lock).
"""
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from collections import deque

STAMP = "SETUP.json"
PYTORCH_WHEELS = "https://download.pytorch.org/whl/"
# The newest PyTorch CUDA build a driver runs, from NVIDIA's CUDA toolkit release notes
# ("CUDA Toolkit and Corresponding Driver Versions", Linux, GA releases): a build for CUDA
# X needs at least the driver that toolkit shipped with. Newest first.
TORCH_INDEXES = (
    ((580, 65), "cu130"),
    ((575, 51), "cu129"),
    ((570, 26), "cu128"),
    ((560, 28), "cu126"),
    ((550, 54), "cu124"),
    ((530, 30), "cu121"),
    ((520, 61), "cu118"),
)
TAIL_LINES = 40


class SetupFailed(Exception):
    def __init__(self, step, message):
        super().__init__(message)
        self.step = step


def emit(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def index_for_driver(driver):
    """The PyTorch wheel index for an NVIDIA driver version such as "550.54.15"."""
    numbers = tuple(int(part) for part in re.findall(r"\d+", driver)[:2])
    for minimum, variant in TORCH_INDEXES:
        if numbers >= minimum:
            return PYTORCH_WHEELS + variant
    raise SetupFailed("driver", "NVIDIA driver %s is older than every PyTorch CUDA build supports "
                                "(%s needs %d.%d); upgrade it, or pass --index-url"
                      % (driver, TORCH_INDEXES[-1][1], TORCH_INDEXES[-1][0][0], TORCH_INDEXES[-1][0][1]))


def torch_index(index_url):
    if index_url:
        return index_url
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return PYTORCH_WHEELS + "cpu"
    try:
        done = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupFailed("driver", "nvidia-smi: %s; pass --index-url" % exc)
    versions = done.stdout.decode("utf-8", "replace").split()
    if done.returncode != 0 or not versions:
        text = (done.stdout + done.stderr).decode("utf-8", "replace").strip()[-300:]
        raise SetupFailed("driver", "nvidia-smi exited %d: %s; pass --index-url" % (done.returncode, text))
    return index_for_driver(versions[0])


def requirement_lines(text):
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def is_torch(line):
    return re.match(r"torch(?![A-Za-z0-9._-])", line) is not None


def run_streamed(step, argv):
    """Run argv, passing each line it prints on as {"pip": LINE}; SetupFailed with its
    last lines if it fails."""
    env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONUNBUFFERED="1")
    tail = deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            tail.append(line)
            emit({"pip": line})
    except BaseException:  # the CLI is gone (a broken pipe), or a signal: so is pip
        proc.kill()
        proc.wait()
        raise
    if proc.wait() != 0:
        raise SetupFailed(step, "%s exited %d:\n%s" % (" ".join(argv[:4]), proc.returncode, "\n".join(tail)))


def read_stamp(env_dir):
    try:
        with open(os.path.join(env_dir, STAMP)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def write_atomically(path, text):
    tmp = "%s.%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def in_use(workspace):
    """The environment <workspace>/env points at, or None."""
    try:
        return os.path.join(workspace, os.readlink(os.path.join(workspace, "env")))
    except OSError:
        return None


def switch(workspace, key):
    link = os.path.join(workspace, "env")
    tmp = os.path.join(workspace, ".env.%d" % os.getpid())
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("envs", key), tmp)
    os.replace(tmp, link)


def build(env_dir, stamp, requirements):
    if os.path.exists(env_dir):  # an unfinished build, killed before its stamp
        shutil.rmtree(env_dir)
    run_streamed("venv", [sys.executable, "-m", "venv", env_dir])
    python = os.path.join(env_dir, "bin", "python")
    # torch first, from its own index (a PyTorch index also serves torch's dependencies);
    # the rest from pip's configured indexes, with the torch just installed satisfying them.
    index = [] if stamp["torch_index"] == "pip" else ["--index-url", stamp["torch_index"]]
    run_streamed("torch", [python, "-m", "pip", "install", stamp["torch"]] + index)
    others = os.path.join(env_dir, "requirements.txt")
    write_atomically(others, "".join(line + "\n" for line in requirements if not is_torch(line)))
    run_streamed("requirements", [python, "-m", "pip", "install", "-r", others])
    write_atomically(os.path.join(env_dir, STAMP), json.dumps(stamp, sort_keys=True, indent=1))


def prune(envs, keep):
    for name in os.listdir(envs):
        if name not in keep:
            shutil.rmtree(os.path.join(envs, name), ignore_errors=True)


def setup(workspace, request):
    lock = os.open(os.path.join(workspace, ".setup.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SetupFailed("lock", "another dflash setup is running in %s" % workspace)
    requirements = requirement_lines(request["requirements"])
    torch_lines = [line for line in requirements if is_torch(line)]
    stamp = {
        "requirements": requirements,
        "torch": "torch==%s" % request["torch"] if request.get("torch") else torch_lines[0],
        "torch_index": torch_index(request.get("index_url")),
        "python": "%s %s" % (platform.python_implementation(), platform.python_version()),
    }
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    envs = os.path.join(workspace, "envs")
    env_dir = os.path.join(envs, key)
    previous = in_use(workspace)
    result = {"env": env_dir, "key": key, "torch_index": stamp["torch_index"], "previous": previous}
    if read_stamp(env_dir) == stamp:
        if previous is not None and os.path.realpath(previous) == os.path.realpath(env_dir):
            return dict(result, status="unchanged")
        switch(workspace, key)
        return dict(result, status="switched")
    os.makedirs(envs, exist_ok=True)
    try:
        build(env_dir, stamp, requirements)
    except BaseException:
        shutil.rmtree(env_dir, ignore_errors=True)
        raise
    switch(workspace, key)
    prune(envs, {key} | ({os.path.basename(previous)} if previous else set()))
    return dict(result, status="installed")


def _exit_on_signal(signum, _frame):
    sys.exit(128 + signum)  # SystemExit: pip is killed and the unfinished folder removed


def main(argv):
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    workspace = os.path.abspath(os.path.expanduser(argv[0]))
    os.makedirs(workspace, exist_ok=True)
    try:
        result = setup(workspace, json.loads(argv[1]))
    except SetupFailed as exc:
        result = {"status": "failed", "step": exc.step, "error": str(exc), "env": in_use(workspace)}
    except Exception as exc:  # reported to the CLI as data, with the exact cause
        result = {"status": "failed", "step": "setup", "error": "%s: %s" % (type(exc).__name__, exc),
                  "env": in_use(workspace)}
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
