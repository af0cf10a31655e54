"""A stand-in trainer for the agent's tests: `python -m dflash_train --config C --run-dir D`.

The config (JSON, which is also YAML) is a script: {"steps": [{action: argument}, ...]},
run in order; the process exits 0 after the last step unless a step ends it sooner.
It first writes standin.json describing how it was started (pid, session, cwd, stdin,
environment, whether run.json already existed), so the tests can check the launch.
"""
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

RUN_DIR = ""
KEEP = []  # objects that must outlive their step (files faulthandler writes to, memory)


def path(name):
    return os.path.join(RUN_DIR, name)


def append_line(name, obj):
    with open(path(name), "a") as handle:
        handle.write(json.dumps(obj) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_json(name, obj):
    tmp = path(name + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(obj, handle)
    os.replace(tmp, path(name))


def describe_start(argv):
    env_keys = ("PYTHONPATH", "PYTHONUNBUFFERED", "DFLASH_RUN_ID", "DFLASH_RELEASE_ID",
                "DFLASH_RELEASE_DIR", "DFLASH_WORKSPACE", "STANDIN_EXTRA")
    write_json("standin.json", {
        "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "cwd": os.getcwd(),
        "stdin": os.readlink("/proc/self/fd/0"), "stdout": os.readlink("/proc/self/fd/1"),
        "run_json_existed": os.path.exists(path("run.json")), "argv": argv,
        "env": {key: os.environ.get(key) for key in env_keys},
        "distributed_env": {key: os.environ[key] for key in (
            "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
            if key in os.environ},
    })


def load_config(config_path):
    with open(config_path) as handle:
        return json.load(handle)


def fail_deeply(message):
    """A chained exception, as a real failing thread would produce."""
    try:
        raise KeyError("root cause")
    except KeyError as cause:
        raise RuntimeError(message) from cause


def error_record(spec):
    try:
        fail_deeply(spec.get("message", "scripted failure"))
    except RuntimeError as exc:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        frames = [{"file": f.filename, "line": f.lineno, "func": f.name, "code": f.line}
                  for f in traceback.extract_tb(exc.__traceback__)]
        return {"ts": time.time(), "run_id": os.environ.get("DFLASH_RUN_ID"),
                "thread": spec.get("thread", "drafter-1"), "thread_ident": threading.get_ident(),
                "phase": spec.get("phase", "startup"), "step": spec.get("step"),
                "exc_type": type(exc).__name__, "message": str(exc), "traceback": text,
                "frames": frames, "release_id": os.environ.get("DFLASH_RELEASE_ID")}


def drafter_waits_here(event):
    event.wait()


def write_out(data):
    os.write(1, data)


def run_step(action, arg):
    if action == "print":
        print(arg, flush=True)
    elif action == "write":
        write_out(arg.encode("utf-8"))
    elif action == "write_hex":
        write_out(bytes.fromhex(arg))
    elif action == "lines":
        block = "".join("line %06d %s\n" % (i, "x" * arg.get("width", 40)) for i in range(arg["count"]))
        write_out(block.encode("ascii"))
    elif action == "event":
        append_line("events.jsonl", dict({"ts": time.time(), "thread": "coordinator"}, **arg))
    elif action == "heartbeat":
        append_line("events.jsonl", {"ts": time.time(), "type": "heartbeat", "thread": "coordinator",
                                     "step": arg})
    elif action == "error":
        append_line("errors.jsonl", error_record(arg))
    elif action == "sleep":
        time.sleep(arg)
    elif action == "wait_file":
        while not os.path.exists(path(arg)):
            time.sleep(0.01)
    elif action == "touch":
        open(path(arg), "a").close()
    elif action == "exit":
        sys.stdout.flush()
        os._exit(arg)
    elif action == "kill_self":
        os.kill(os.getpid(), getattr(signal, arg))
        time.sleep(10)
    elif action == "ignore_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif action == "faulthandler":
        handle = open(path("faulthandler.log"), "a")
        KEEP.append(handle)
        faulthandler.enable(file=handle, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    elif action == "thread":
        event = threading.Event()
        KEEP.append(event)
        threading.Thread(target=drafter_waits_here, args=(event,), name=arg, daemon=True).start()
        # As the real trainer does: {ident: name}, so the agent can name faulthandler's threads.
        write_json("threads.json", {str(t.ident): t.name for t in threading.enumerate()})
    elif action == "spawn_sleeper":
        child = subprocess.Popen(["sleep", "600"])
        KEEP.append(child)
        write_json("sleeper.json", {"pid": child.pid})
    elif action == "allocate_mib":
        chunk = bytearray(1024 * 1024)
        for _ in range(arg):
            KEEP.append(bytes(chunk) + b"x")
    else:
        raise ValueError("unknown stand-in action %r" % action)


def main(argv):
    global RUN_DIR
    config_path = argv[argv.index("--config") + 1]
    RUN_DIR = argv[argv.index("--run-dir") + 1]
    describe_start(argv)
    for step in load_config(config_path)["steps"]:
        ((action, arg),) = step.items()
        run_step(action, arg)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
