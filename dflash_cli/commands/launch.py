"""dflash launch: validate a training config here, deploy if needed, start the run there
(on several hosts: one run, one trainer per host, docs/multihost.md)."""
from __future__ import annotations

import dataclasses
import datetime
import re
import secrets
from pathlib import Path

from dflash_contract import requests
from dflash_contract.names import MAX_RUN_ID, TRAINER_PACKAGES
from dflash_contract.records import ReleaseSource, RestartPolicy
from dflash_contract.replies import LaunchReply
import dflash_schema
from dflash_train.config import JobConfig, load_job_config, resolved_yaml  # torch-free by contract

from .. import console, evaluate_drafter, fit_check, host_check
from ..compile_artifacts import seed_hosts
from ..deployment import deploy_host, source_tree
from ..errors import BadOption, DflashError, ExitCode
from ..inventory import Host, is_address
from ..local_state import RunRef, set_latest
from ..progress import cancel_on_ctrl_c, transfer_bars
from ..release import Release, find_source
from ..release_store import ReleaseStore, change_since
from ..run_start import refuse, start_together
from ..session import Session

_BAD_NAME = re.compile(r"[/\x00-\x1f\x7f]")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What a launch (or its --dry-run) was asked for."""
    host_names: tuple[str, ...]  # hosts and groups, rank 0 first
    config_path: Path
    name: str | None = None  # the run name; None: the config's file name
    force: bool = False  # start next to the runs holding the same GPUs
    source_dir: Path | None = None  # the tree to deploy; None: chosen as `deploy` chooses it
    overrides: tuple[str, ...] = ()  # --set KEY=VALUE, in order
    allow_large: bool = False  # send a release over the size threshold
    master_addr: str | None = None  # several hosts: where the others reach rank 0
    master_port: int | None = None  # several hosts: rank 0's rendezvous port; None: one free there

    def __post_init__(self) -> None:
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise BadOption(f"{{master_port}} {self.master_port}: a TCP port is 1 to 65535", "master_port")

    @property
    def run_name(self) -> str:
        return self.config_path.stem if self.name is None else self.name


@dataclasses.dataclass(frozen=True)
class Launched:
    """A run started: its id, its hosts in rank order (one for a run on one host), each
    host's launch reply (the trainer's pid, the release it runs) and, on several hosts,
    the rendezvous `address:port` of rank 0."""
    run_id: str
    hosts: tuple[str, ...]
    started: tuple[LaunchReply, ...]
    rendezvous: str | None = None

    @property
    def ref(self) -> RunRef:
        return RunRef(self.hosts[0], self.run_id, self.hosts if len(self.hosts) > 1 else ())


def load_config(path: Path, overrides: tuple[str, ...] = ()) -> JobConfig:
    """The training config with the `--set KEY=VALUE` overrides merged in, checked by the
    trainer's own schema before anything is sent."""
    try:
        return load_job_config(path, tuple(map(dflash_schema.parse_override, overrides)))
    except dflash_schema.SchemaError as exc:
        raise DflashError(str(exc), ExitCode.USAGE) from exc


def new_run_id(name: str) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


# The run id is the name plus a stamp; the agent refuses ids longer than MAX_RUN_ID.
MAX_NAME = MAX_RUN_ID - len(new_run_id(""))


def check_name(name: str) -> None:
    """A run name becomes the start of a run id: one path component on the host, and an
    argument of later commands (`dflash watch RUN`), so it may not look like an option."""
    if not name.strip() or name[0] in ".-" or _BAD_NAME.search(name) or len(name) > MAX_NAME:
        raise BadOption(f"{{name}} {name!r}: a run name has 1 to {MAX_NAME} characters, does not start "
                        "with '.' or '-', and holds no '/' or control characters", "name")


def host_paths(config: JobConfig) -> list[tuple[str, str, str]]:
    """(kind, key, path) of every path in the config, for the agent to check on the host
    (the agent's --require-path: a file, the training data, a model folder or hub id, a
    checkpoint)."""
    paths = []
    if config.target.path is not None:
        paths.append(("model", "target.path", config.target.path))
    for key, kind in (("train", "jsonl"), ("eval", "file")):
        if config.data is not None and getattr(config.data, key) is not None:
            paths.append((kind, f"data.{key}", getattr(config.data, key)))
    if config.regenerate is not None:
        paths.append(("file", "regenerate.prompts", config.regenerate.prompts))
    if config.evaluate is not None:
        paths.append(("model", "evaluate.drafter", config.evaluate.drafter))
        if config.evaluate.prompts is not None:
            paths.append(("file", "evaluate.prompts", config.evaluate.prompts))
    if config.checkpoint.resume not in (None, "latest"):
        paths.append(("checkpoint", "checkpoint.resume", config.checkpoint.resume))
    return paths


def rank_paths(config: JobConfig, rank: int) -> list[tuple[str, str, str]]:
    """host_paths that rank `rank`'s host must hold: only rank 0 reads checkpoint.resume
    (it sends the checkpoint to the others)."""
    return [(kind, key, path) for kind, key, path in host_paths(config) if rank == 0 or key != "checkpoint.resume"]


def say_what_is_new(session: Session, host_name: str, tree: Release) -> None:
    """One line: what this release changed since the newest run on the host, so the same
    patch is not launched twice by mistake (nothing before the host's first run)."""
    try:
        runs = session.agent(host_name).call(requests.Status()).runs
    except DflashError as exc:  # a hint, not a check: the launch's own checks come next
        console.warn(f"{host_name}: cannot compare with the previous run ({exc.message})")
        return
    previous = next((r for r in runs if r.release_id), None)
    if previous is None:
        return
    store = ReleaseStore(session)
    store.add_local(tree)
    console.say(f"{host_name}: {change_since(store, host_name, previous, tree.release_id)['text']}")


def _deploy(session: Session, hosts: list[Host], source_dir: Path | None, allow_large: bool) -> ReleaseSource:
    """The source tree installed on every host, in parallel, and its agent the one this
    launch asks there from now on; its provenance record for run.json. `current` is left
    as it is: the agent makes the release current as the run starts, so a launch refused
    or interrupted before that leaves it where it was. Any host that failed (or a Ctrl-C)
    starts nothing. Then each host says what the release changed since its newest run."""
    tree, source = source_tree(source_dir, allow_large)
    with transfer_bars() as bars, cancel_on_ctrl_c() as cancel:
        results = session.on_each_host(hosts, lambda host: deploy_host(session, host, tree, bars,
                                                                        cancel=cancel, switch=False))
    for host in hosts:
        result = results[host.name]
        if isinstance(result, DflashError):
            raise result
        if cancel.is_set():  # Ctrl-C came after the host had the release: start nothing
            raise DflashError(f"{host.name}: interrupted; no run was started (release {result.release_id} is on "
                              "the host; `current` was not moved)", ExitCode.INTERRUPTED)
        if result.status in ("installed", "repaired"):
            console.say(f"{host.name}: release {result.release_id} {result.status} "
                        f"({result.files_sent} files sent)")
        session.use_release(host.name, tree.release_id)
    for host in hosts:
        say_what_is_new(session, host.name, tree)
    return source


def _request(host: Host, config: JobConfig, run_id: str, options: LaunchOptions, source: ReleaseSource,
             layout: requests.Layout | None = None, check_only: bool = False) -> requests.Launch:
    """The agent's launch for `host`, its part of the run at `layout` (None: the only one)."""
    restart = RestartPolicy(config.restart.max, config.restart.on, config.restart.backoff_s)
    return requests.Launch(
        run_id, "-", options.run_name, config.stall_after, config.startup_stall_after, source, restart,
        tuple(config.resources()), tuple(host.env.items()), TRAINER_PACKAGES,
        tuple(rank_paths(config, layout.rank if layout else 0)), tuple(options.overrides),
        release=source.release_id,  # installed by _deploy; current once the run starts
        force=options.force, layout=layout, check_only=check_only)


def check_hosts(session: Session, hosts: list[Host], config: JobConfig,
                source_dir: Path | None) -> list[host_check.HostReport]:
    """Every host's checks (host_check.py: what its agent's preflight will check, its
    devices, the memory estimate), in parallel, one round trip each; a host that cannot
    be asked stops the launch here, before anything is deployed."""
    root = find_source(source_dir).root
    names = [host.name for host in hosts]
    reports = session.on_each_host(hosts, lambda host: host_check.check_host(
        session, host, config, rank_paths(config, names.index(host.name)), root, len(hosts), names.index(host.name)))
    refuse(hosts, reports, "nothing was deployed or started")
    return [reports[name] for name in names]


def _check_layout(hosts: list[Host], config: JobConfig, options: LaunchOptions) -> str | None:
    """The run's layout over its hosts checked: on several hosts, where the others reach
    rank 0 (returned); None for a run on one host."""
    if len(hosts) == 1:
        if options.master_addr is not None or options.master_port is not None:
            raise BadOption("{master_addr} and {master_port} are for a run on several hosts; "
                            f"{hosts[0].name} is one", "master_addr", "master_port")
        return None
    if options.master_addr is not None and not is_address(options.master_addr):
        raise BadOption(f"{{master_addr}} {options.master_addr!r}: expected a host name or IP address", "master_addr")
    if config.restart.max > 0:
        # Each host's supervisor restarts only its own trainer, which would wait for peers
        # that ended: restarting together needs a coordinator (docs/multihost.md "Resume and restart").
        raise DflashError(f"restart.max {config.restart.max}: a run on several hosts is not restarted "
                          "automatically (the hosts' supervisors cannot restart together without a "
                          "coordinator); set restart.max: 0 and resume it by hand with `dflash resume RUN`",
                          ExitCode.USAGE)
    address = options.master_addr or hosts[0].rendezvous_address()
    if address is None:
        raise DflashError(f"{hosts[0].name} (rank 0) has no address the other hosts can reach it at",
                          ExitCode.USAGE, hint=f"set address: in the inventory entry of {hosts[0].name} "
                          "(a container's own, not its node's), or pass --master-addr")
    return address


def _refuse_unless_ready(session: Session, hosts: list[Host], config: JobConfig, source_dir: Path | None) -> None:
    reports = check_hosts(session, hosts, config, source_dir)
    host_check.refuse(reports, "nothing was deployed or started",
                      hint="`dflash launch … --dry-run` prints every check's verdict and every term of the estimate")
    fit_check.report([report.fit for report in reports if report.fit is not None])


@dataclasses.dataclass(frozen=True)
class DryRun:
    """`launch --dry-run`: every host's checks (their verdicts, problems and memory
    estimate), why the fit was not checked (None: it was), and the refusal naming every
    problem (None: all pass)."""
    config_path: Path
    reports: tuple[host_check.HostReport, ...]
    unchecked: str | None
    refusal: DflashError | None


def dry_run(session: Session, options: LaunchOptions) -> DryRun:
    """Every check `start` makes before it starts anything, nothing deployed or started.
    The checks the agent makes as it starts the run (the run id, the GPUs' locks) are not
    made."""
    check_name(options.run_name)
    hosts = session.inventory.expand(options.host_names)
    config = evaluate_drafter.resolved(session, hosts[0].name, load_config(options.config_path, options.overrides))
    _check_layout(hosts, config, options)
    reports = check_hosts(session, hosts, config, options.source_dir)
    return DryRun(options.config_path, tuple(reports), fit_check.unchecked(config),
                  host_check.refusal(reports, "a dry run: nothing was deployed or started"))


def start(session: Session, options: LaunchOptions) -> Launched:
    """Start a run on one host, or one run on several (a group names several). The hosts
    get the resolved config (every default filled in, the overrides applied), which the
    trainer loads through the same schema again. A run the GPUs cannot hold (fit_check)
    is refused before anything is deployed."""
    check_name(options.run_name)
    hosts = session.inventory.expand(options.host_names)
    config = evaluate_drafter.resolved(session, hosts[0].name, load_config(options.config_path, options.overrides))
    address = _check_layout(hosts, config, options)
    if address is not None:
        return _launch_on_hosts(session, hosts, config, options, address)
    (host,) = hosts
    _refuse_unless_ready(session, hosts, config, options.source_dir)
    source = _deploy(session, hosts, options.source_dir, options.allow_large)
    run_id = new_run_id(options.run_name)
    reply = session.agent(host.name).call(_request(host, config, run_id, options, source), stdin=_resolved(config))
    launched = Launched(run_id, (host.name,), (reply,))  # the id sent: an answer picks no local folder
    set_latest(session.logs_dir, launched.ref)
    return launched


def _resolved(config: JobConfig) -> bytes:
    """What the hosts get as config.yaml: the resolved config."""
    return resolved_yaml(config).encode()


def _launch_on_hosts(session: Session, hosts: list[Host], config: JobConfig, options: LaunchOptions,
                     address: str) -> Launched:
    """One run id on every host, rank = position in `hosts`, rank 0 reached at `address`.
    Every host checks what it can before any starts (one refusal starts nothing
    anywhere); a start that fails after that stops the parts already started: no
    half-started run is left."""
    first = hosts[0]
    _refuse_unless_ready(session, hosts, config, options.source_dir)
    source = _deploy(session, hosts, options.source_dir, options.allow_large)
    run_id = new_run_id(options.run_name)
    config_bytes = _resolved(config)
    names = [host.name for host in hosts]

    def launch_on(host: Host, port: int, check_only: bool = False):
        layout = requests.Layout(names.index(host.name), len(hosts), address, port, tuple(names))
        return session.agent(host.name).call(_request(host, config, run_id, options, source, layout, check_only),
                                             stdin=config_bytes)

    checks = session.on_each_host(hosts, lambda host: launch_on(host, options.master_port or 0, check_only=True))
    refuse(hosts, checks, "nothing was started on any host")
    seed_hosts(session, names)  # hosts lacking another's compile artifacts get them: they start warm
    # The first host's agent picked a port free there, in the round trip of its check.
    port = options.master_port or checks[first.name].master_port
    started = start_together(session, hosts, run_id, lambda host: launch_on(host, port))
    launched = Launched(run_id, tuple(names), tuple(started[name] for name in names), f"{address}:{port}")
    set_latest(session.logs_dir, launched.ref)
    return launched
