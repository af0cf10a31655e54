"""The `launch` verb: check what only the host can, claim the run id and its resources,
start a detached supervisor, return once run.json exists (replies.LaunchReply).

In order: the preflight (preflight.py), all at once, before anything of the run exists;
then runs/ID/ is created and the config copied to runs/ID/config.yaml (--config PATH,
relative to the release root, or "-": stdin); the locks of its resources are taken
(locks.py: gpu0, gpu1, ... or cpu; a live holder -> kind "conflict" naming every one,
unless --force); then the supervisor starts (supervisor.py), which writes run.json and
starts the trainer. The release is --release ID (installed in releases/ID, else kind
"not_found"), which `current` is switched to just before the supervisor starts and put
back if it does not start, or without it the one `current` points to now, resolved (a
run keeps its release when `current` moves on). --source-json (run.json's `source`)
must name that release as its release_id, else kind "conflict". --override strings are
recorded in run.json as given; the agent neither reads nor applies them. A launch that
fails before run.json exists leaves no run directory, no lock and `current` as it was.

One host's part of a run on several hosts (--rank, --world-size, --master-addr
together): the trainer's environment holds torch.distributed's env:// variables
(DISTRIBUTED_ENV, overriding --env and the host's own) and run.json `distributed`
(Distributed.record); without them those variables are removed from it. --check-only
makes every check above and creates nothing (replies.LaunchCheckReply).

Detaching matters over SSH and `pct exec`: the channel closes only when every process
holding its pipes is gone. The supervisor is double-forked into a new session with
stdin from /dev/null, stdout+stderr to runs/ID/agent.log and every other descriptor
closed; only a private report pipe tells this process that run.json was written.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import socket
import sys
import time
import traceback
from typing import Dict, Optional, Tuple, Union

from dflash_contract.names import RELEASE_DIR_ENV, RELEASE_ID_ENV, RUN_ID_ENV, WORKSPACE_ENV
from dflash_contract.records import ReleaseSource, RestartPolicy, RunPlace
from dflash_contract.replies import LaunchCheckReply, LaunchReply
from dflash_files.atomic import write_atomic
from dflash_files.config_paths import PathRequirement
from dflash_files.diskspace import NO_SPACE

from . import locks, preflight, warm
from .jsonio import AgentError, no_space, read_tail_text
from .layout import RunDir, Workspace
from .releases import release_dir
from .supervisor import TrainerPlan, log_error, supervise
from .supervisor_report import SupervisorReport

REPORT_TIMEOUT_S = 60.0
# The torch.distributed variables a trainer joins its process group by (init_method
# env://). Set for a run on several hosts; removed otherwise, so that a value the host's
# environment happens to hold cannot make a one-host run wait for peers.
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclasses.dataclass(frozen=True)
class Distributed:
    """This host's place in a run across several hosts (docs/multihost.md):
    one trainer process per host, rank = the host's position in the launch."""
    rank: int
    world_size: int
    master_addr: str  # where rank 0's trainer listens for the others (the rendezvous)
    master_port: int  # 0 only in a --check-only launch: this agent picks a free one
    hosts: Tuple[str, ...] = ()  # the CLI's host names, in rank order

    def check(self, check_only: bool) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise AgentError("--rank %d is not in [0, --world-size %d)" % (self.rank, self.world_size), "usage")
        if self.hosts and len(self.hosts) != self.world_size:
            raise AgentError("--host-names names %d hosts for --world-size %d"
                             % (len(self.hosts), self.world_size), "usage")
        if not self.master_addr:
            raise AgentError("--master-addr must not be empty", "usage")
        if not (0 if check_only else 1) <= self.master_port <= 65535:
            raise AgentError("--master-port %d is not a TCP port" % self.master_port, "usage")

    def env(self) -> Dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}

    def record(self) -> RunPlace:
        """run.json's `distributed`."""
        return RunPlace(rank=self.rank, world_size=self.world_size, master_addr=self.master_addr,
                        master_port=self.master_port, hosts=self.hosts)


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
    run_id: str
    config: str  # a path (relative: to the release root) or "-" for stdin
    name: Optional[str] = None
    resources: Tuple[str, ...] = ()
    force: bool = False
    env: Tuple[Tuple[str, str], ...] = ()
    python: str = sys.executable
    stall_after: float = 300.0
    startup_stall_after: float = 300.0
    source: Optional[ReleaseSource] = None  # where the release came from; names its release_id
    modules: Tuple[str, ...] = ()  # the trainer's interpreter must find these
    paths: Tuple[PathRequirement, ...] = ()  # the config's host paths that must exist
    overrides: Tuple[str, ...] = ()  # the --set KEY=VALUE the CLI resolved the config with
    restart: Optional[RestartPolicy] = None  # the config's restart policy (attempts.py)
    release: Optional[str] = None  # the installed release to run; None: the current one
    distributed: Optional[Distributed] = None  # None: a run on this host alone
    check_only: bool = False  # check what a launch would, start nothing (several hosts)


def _read_config(request: LaunchRequest, release_root: str) -> bytes:
    if request.config == "-":
        return sys.stdin.buffer.read()
    path = os.path.join(release_root, os.path.expanduser(request.config))
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise AgentError("cannot read config %s: %s" % (path, exc.strerror or exc), "not_found")


def trainer_env(ws: Workspace, run: RunDir, release_id: str, release_root: str,
                extra: Tuple[Tuple[str, str], ...],
                distributed: Optional[Distributed] = None) -> Tuple[Tuple[str, str], ...]:
    env = dict(os.environ)
    remote = os.path.join(release_root, "remote")
    env["PYTHONPATH"] = remote + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # nothing is written into a release
        RUN_ID_ENV: run.run_id,
        RELEASE_ID_ENV: release_id,
        RELEASE_DIR_ENV: release_root,
        WORKSPACE_ENV: ws.root,
    })
    env.update(dict(extra))  # the host's and the user's settings win
    for key in DISTRIBUTED_ENV:  # ... but the layout is the launch's, not the host's
        env.pop(key, None)
    if distributed is not None:
        env.update(distributed.env())
    return tuple(sorted(env.items()))


def free_port() -> int:
    """A TCP port nothing listens on here now, as the kernel hands one out for port 0.
    Free when asked: rank 0's trainer binds it moments later (docs/multihost.md)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _check_only(ws: Workspace, request: LaunchRequest, run: RunDir, release_id: str) -> LaunchCheckReply:
    """A launch's checks without its effects: the run id is free and no live run holds
    the resources (unless --force). The first host of a run on several hosts also picks
    the rendezvous port here when none was given, in the round trip the check costs."""
    if os.path.lexists(run.path):
        raise AgentError("run %r already exists in %s" % (run.run_id, ws.runs), "conflict")
    locks.check_free(ws, request.resources, request.force)
    picks_port = request.distributed is not None and request.distributed.master_port == 0
    return LaunchCheckReply(run_id=run.run_id, checked=True, release_id=release_id,
                            master_port=free_port() if picks_port else None)


def launch(ws: Workspace, request: LaunchRequest) -> Union[LaunchReply, LaunchCheckReply]:
    for resource in request.resources:
        locks.check_resource(resource)
    if request.stall_after <= 0 or request.startup_stall_after <= 0:
        raise AgentError("--stall-after and --startup-stall-after must be positive", "usage")
    if request.distributed is not None:
        request.distributed.check(request.check_only)
    if request.release is None:
        release_id, release_root = ws.current_release()
    else:
        release_id, release_root = request.release, release_dir(ws, request.release)
    if request.source is not None and request.source.release_id != release_id:
        raise AgentError("the release to run is %s, not %s whose source was given (another deploy "
                         "ran in between?)" % (release_id, request.source.release_id), "conflict")
    config = _read_config(request, release_root)
    run = ws.run(request.run_id)
    env = trainer_env(ws, run, release_id, release_root, request.env, request.distributed)
    warm.idle_s(dict(env))  # a bad DFLASH_WARM_IDLE_S is the launch's error, not a silent default
    preflight.check(ws.root, release_root, request.python, env, request.modules, request.paths)
    if request.check_only:
        return _check_only(ws, request, run, release_id)
    os.makedirs(ws.runs, exist_ok=True)
    try:
        os.mkdir(run.path)  # claims the run id
    except FileExistsError:
        raise AgentError("run %r already exists in %s" % (run.run_id, ws.runs), "conflict")
    try:
        locks.acquire(ws, request.resources, run.run_id, request.force)
    except BaseException:
        os.rmdir(run.path)
        raise
    switched = False
    try:
        write_atomic(run.config, config)
        plan = TrainerPlan(
            workspace=ws, run=run, name=request.name, release_id=release_id,
            release_root=release_root, config_source=request.config, python=request.python,
            env=env,
            env_keys=tuple(key for key, _ in request.env), resources=request.resources,
            stall_after=request.stall_after, startup_stall_after=request.startup_stall_after,
            source=request.source, overrides=request.overrides,
            restart=request.restart, distributed=request.distributed.record() if request.distributed else None)
        # `current` moves with a run that starts, never with a launch refused before it.
        previous = ws.switch_current(release_id)
        switched = True
        report = start_supervisor(plan)
    except BaseException:
        if not os.path.exists(run.run_json):  # nothing started: the locks are ours to drop
            locks.release(ws, request.resources, run.run_id)
            shutil.rmtree(run.path, ignore_errors=True)  # and the run id: it never became a run
            if switched:  # and `current` is put back
                ws.switch_current(previous)
        raise
    return LaunchReply(run_id=run.run_id, run_dir=run.path, pid=report.pid, pgid=report.pgid,
                       release_id=release_id)


def _daemonize(log_path: str, keep_fd: int) -> None:
    """Become a background process holding nothing of the caller's: stdin /dev/null,
    stdout and stderr to `log_path`, every other descriptor but `keep_fd` closed."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep_fd:
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor of the listing itself, already closed
    os.chdir("/")


def start_supervisor(plan: TrainerPlan) -> SupervisorReport:
    report_r, report_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(report_r)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            # Grandchild: not a session leader, so it can never regain a terminal.
            _daemonize(plan.run.agent_log, report_w)
            code = supervise(plan, report_w)
        except BaseException as exc:  # noqa: BLE001 - whatever ends the supervisor is said in agent.log
            log_error("%s: %s" % (type(exc).__name__, exc))
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(report_w)
    os.waitpid(child, 0)
    try:
        message = _read_report(report_r)
    finally:
        os.close(report_r)
    if message.errno in NO_SPACE:
        raise no_space(message.filename)
    if not message.ok:
        detail = message.error or "the supervisor exited without reporting"
        raise AgentError("launch of run %r failed: %s\n%s" % (
            plan.run.run_id, detail, read_tail_text(plan.run.agent_log, 40)), "internal")
    return message


def _read_report(fd: int) -> SupervisorReport:
    """The supervisor's one line; a report of no start when it closed the pipe without one."""
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AgentError("the supervisor did not report within %.0f s" % REPORT_TIMEOUT_S, "internal")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return SupervisorReport.from_json(json.loads(data.decode("utf-8")))
    except ValueError:  # no line, a torn one, or not a report
        return SupervisorReport(ok=False)
