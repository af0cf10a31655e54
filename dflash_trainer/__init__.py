"""dflash's verbs as Python functions, for notebooks and scripts (docs/api.md).

    import dflash_trainer as dflash

    launched = dflash.launch("local", "configs/train/tiny-cpu.yaml")
    for item in dflash.watch(launched.run_id):
        ...
    print(dflash.status(launched.run_id).state)

Each function is the core of its CLI verb (the CLI prints what they return) and takes
the CLI's global options as keywords: `hosts_file` (--hosts; default DFLASH_HOSTS, else
./configs/hosts.yaml or the built-in `local` alone), `logs_dir` (--logs-dir; default
DFLASH_LOGS, else ./logs) and `accept_new_host_key`. A run not named is the latest one
launched or resumed with that logs folder, as for the CLI. Progress and warnings go to
stderr as the CLI's do; nothing is printed on stdout.

Every failure is a `DflashError`: `message`, `hint` (or None) and `exit_code`, the
`ExitCode` the CLI would exit with (USAGE 2: bad input or configuration; UNREACHABLE
3: a host that cannot be reached or read; LOCAL_DISK_FULL 5: this machine's disk, where
`watch` and `pull` keep the run's files; INTERRUPTED 130; docs/cli.md "CLI exit
codes"). A run that fails is no error of these functions: it is the state they return.

Importing this module is cheap: the functions import what they need when called.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

from dflash_cli.errors import DflashError, ExitCode, exit_code_for_state

if TYPE_CHECKING:
    from dflash_contract.replies import RunStatus
    from dflash_cli.commands.fetch_traceback import Traceback
    from dflash_cli.commands.launch import Launched
    from dflash_cli.commands.pull import PullResult
    from dflash_cli.commands.resume import Resumed
    from dflash_cli.multihost import RunOnHosts
    from dflash_cli.session import Session
    from dflash_cli.watching import WatchItem

__all__ = ["launch", "watch", "status", "fetch_traceback", "pull", "resume", "DflashError", "ExitCode",
           "exit_code_for_state", "Launched", "Resumed", "Traceback", "PullResult", "RunStatus", "RunOnHosts",
           "HostStatus", "RunState", "Following", "Log", "Rotated", "Events", "ErrorRecorded", "Gpus",
           "StateChange", "HostEnded", "Unfollowed", "Ended"]

# The result and item types, each imported from its module when first named.
_TYPES = {
    "Launched": "dflash_cli.commands.launch", "Resumed": "dflash_cli.commands.resume",
    "Traceback": "dflash_cli.commands.fetch_traceback", "PullResult": "dflash_cli.commands.pull",
    "RunStatus": "dflash_contract.replies", "RunState": "dflash_contract.replies",
    "RunOnHosts": "dflash_cli.multihost", "HostStatus": "dflash_cli.multihost",
    **{name: "dflash_cli.watching" for name in ("Following", "Log", "Rotated", "Events", "ErrorRecorded", "Gpus",
                                                "StateChange", "HostEnded", "Unfollowed", "Ended")},
}


def __getattr__(name: str) -> Any:
    if name in _TYPES:
        return getattr(importlib.import_module(_TYPES[name]), name)
    if name == "__version__":
        from importlib import metadata

        from dflash_cli import DISTRIBUTION

        return metadata.version(DISTRIBUTION)
    raise AttributeError(f"module 'dflash_trainer' has no attribute {name!r}")


F = TypeVar("F", bound=Callable[..., Any])


def _typed(function: F) -> F:
    """Arguments are checked against the function's annotations before anything is done,
    as the CLI's option parser checks its options: one of another type (`launch(42, ...)`,
    `status(5)`, `retry_for='soon'`) is a DflashError (USAGE) naming the function, the
    argument, what it takes and what it got, not a TypeError from somewhere inside."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(function, args, kwargs)
        return function(*args, **kwargs)

    return call  # type: ignore[return-value]


@_typed
def launch(hosts: str | Sequence[str], config: str | os.PathLike, *, name: str | None = None,
           overrides: Sequence[str] = (), force: bool = False, source: str | os.PathLike | None = None,
           allow_large: bool = False, master_addr: str | None = None, master_port: int | None = None,
           hosts_file: str | os.PathLike | None = None, logs_dir: str | os.PathLike | None = None,
           accept_new_host_key: bool = False) -> Launched:
    """`dflash launch HOST... --config CONFIG`: start a run (one host, or one run on
    several: a list, or a group's name), detached; returns its id and hosts. `overrides`
    are `--set`'s KEY=VALUE strings (VALUE read as YAML)."""
    from dflash_cli.commands import launch as verb

    options = verb.LaunchOptions((hosts,) if isinstance(hosts, str) else tuple(hosts), Path(config), name=name,
                                 force=force, source_dir=None if source is None else Path(source),
                                 overrides=(overrides,) if isinstance(overrides, str) else tuple(overrides),
                                 allow_large=allow_large, master_addr=master_addr, master_port=master_port)
    with _session(hosts_file, logs_dir, accept_new_host_key) as session:
        return verb.start(session, options)


@_typed
def watch(run: str | None = None, *, host: str | None = None, tail: int | None = None, gpu_interval: float = 5.0,
          retry_for: float = 60.0, trackers: bool = True, cli_config_file: str | os.PathLike | None = None,
          hosts_file: str | os.PathLike | None = None, logs_dir: str | os.PathLike | None = None,
          accept_new_host_key: bool = False) -> Iterator[WatchItem]:
    """`dflash watch [RUN]`: the run's items as they come, until it ends: `Following`,
    then `StateChange`, `Log`, `Events`, `ErrorRecorded`, `Gpus`, `Rotated` as the run
    makes them, `HostEnded` per host, and last `Ended` (its state and exit code). The
    log, events and tracebacks are kept under logs/<host>/<run>/ as `dflash watch` keeps
    them, and the trackers of dflash.yaml (`cli_config_file`: --cli-config) get the
    run's scalars unless `trackers` is False (--no-trackers). Leaving the loop (or
    `close()`) detaches: the run keeps going, and the next watch goes on after the last
    item received. A host that stays unreachable for `retry_for` seconds raises
    DflashError (exit code 3)."""
    from dflash_cli import run_hosts, watching
    from dflash_cli.commands import WatchOptions
    from dflash_cli.trackers.config import TrackerSettings

    options = WatchOptions(tail, gpu_interval, retry_for, trackers)
    session = _open(hosts_file, logs_dir, accept_new_host_key, cli_config_file)
    try:
        ref = run_hosts.chosen_run(session, run, host, run_hosts.Reach.ANY, naming=_naming("watch"))
        settings = TrackerSettings()
        if trackers:
            from dflash_cli.trackers.hub import checked_settings

            local = session.local_config
            settings = checked_settings(local.trackers, local.source)  # a missing package: raised here, before following
    except BaseException:
        session.close()
        raise

    def items() -> Iterator[WatchItem]:
        with contextlib.closing(session):
            yield from watching.follow(session, ref, tail=options.tail, interval=options.gpu_interval,
                                       retry_for=options.retry_for, trackers=settings)

    return items()


@_typed
def status(run: str | None = None, *, host: str | None = None, hosts_file: str | os.PathLike | None = None,
           logs_dir: str | os.PathLike | None = None, accept_new_host_key: bool = False) -> RunStatus | RunOnHosts:
    """`dflash status [RUN]`: the run's status as its host derives it (a run on several
    hosts: the whole run's state and each host's status). `exit_code_for_state(status.state)`
    is what `dflash status` would exit with."""
    from dflash_cli import run_hosts
    from dflash_cli.commands import status as verb

    with _session(hosts_file, logs_dir, accept_new_host_key) as session:
        ref = run_hosts.chosen_run(session, run, host, run_hosts.Reach.ANY, naming=_naming("status"))
        return verb.status(session, ref).status


@_typed
def fetch_traceback(run: str | None = None, *, host: str | None = None, thread: str | None = None,
                    all_records: bool = False, stacks: bool = False, hosts_file: str | os.PathLike | None = None,
                    logs_dir: str | os.PathLike | None = None, accept_new_host_key: bool = False) -> Traceback:
    """`dflash fetch-traceback [RUN]`: the root cause's traceback (`text`, exactly as the
    thread formatted it, under its header; `diagnosis` for a failure dflash knows), what
    is known of a run that failed without a record, or with `stacks` every thread's stack."""
    from dflash_cli import run_hosts
    from dflash_cli.commands import fetch_traceback as verb

    with _session(hosts_file, logs_dir, accept_new_host_key) as session:
        ref = run_hosts.chosen_run(session, run, host, run_hosts.Reach.ANY, naming=_naming("fetch_traceback"))
        return verb.find(session, ref, thread=thread, all_records=all_records, stacks=stacks)


@_typed
def pull(run: str | None = None, *, host: str | None = None, checkpoint: bool = False, retry_for: float = 60.0,
         hosts_file: str | os.PathLike | None = None, logs_dir: str | os.PathLike | None = None,
         accept_new_host_key: bool = False) -> PullResult:
    """`dflash pull [RUN]`: the run's export (and with `checkpoint` its newest checkpoint)
    brought to logs/<host>/<run>/, every file checked against its sha256."""
    from dflash_cli import run_hosts
    from dflash_cli.commands import pull as verb

    options = verb.PullOptions(checkpoint, retry_for)
    with _session(hosts_file, logs_dir, accept_new_host_key) as session:
        ref = run_hosts.chosen_run(session, run, host, run_hosts.Reach.FIRST, naming=_naming("pull"))
        return verb.pull(session, ref, options)


@_typed
def resume(run: str | None = None, *, host: str | None = None, current_release: bool = False,
           step: int | None = None, hosts_file: str | os.PathLike | None = None,
           logs_dir: str | os.PathLike | None = None, accept_new_host_key: bool = False) -> Resumed:
    """`dflash resume [RUN]`: the next attempt of a run that ended, from its newest
    intact checkpoint (or that of `step`; `Resumed.corrupt` names the newer ones passed
    over), on the run's release unless `current_release`."""
    from dflash_cli import run_hosts
    from dflash_cli.commands import resume as verb

    options = verb.ResumeOptions(current_release, step)
    with _session(hosts_file, logs_dir, accept_new_host_key) as session:
        ref = run_hosts.chosen_run(session, run, host, run_hosts.Reach.EVERY, naming=_naming("resume"))
        return verb.start(session, ref, options)


def _open(hosts_file: str | os.PathLike | None, logs_dir: str | os.PathLike | None,
          accept_new_host_key: bool, cli_config_file: str | os.PathLike | None = None) -> Session:
    from dflash_cli.session import Session

    return Session.from_environment(hosts_file, logs_dir, accept_new_host_key, cli_config_file)


def _session(hosts_file: str | os.PathLike | None, logs_dir: str | os.PathLike | None,
             accept_new_host_key: bool) -> contextlib.closing[Session]:
    return contextlib.closing(_open(hosts_file, logs_dir, accept_new_host_key))


def _naming(function: str) -> str:
    """How a call names a run and its host, for the hint when it names none."""
    return f"dflash.{function}(RUN, host=HOST)"


def _check_arguments(function: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    import inspect

    signature = inspect.signature(function)
    where = f"dflash.{function.__name__}"
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise DflashError(f"{where}: {exc}", ExitCode.USAGE) from None
    for name, value in bound.arguments.items():
        annotation = signature.parameters[name].annotation  # a string: this module's annotations are postponed
        if not _matches(value, eval(annotation, globals())):  # noqa: S307 - our own annotations, not input
            raise DflashError(f"{where}: {name}={value!r:.80}: expected {annotation}, got {type(value).__name__}",
                              ExitCode.USAGE)


def _matches(value: Any, kind: Any) -> bool:
    """isinstance for the annotations of this module: classes, `X | Y`, Sequence[X];
    bool is no number here, as for the CLI's options."""
    import collections.abc
    import types
    import typing

    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, option) for option in typing.get_args(kind))
    if origin is collections.abc.Sequence:
        (item,) = typing.get_args(kind)
        return isinstance(value, collections.abc.Sequence) and all(_matches(entry, item) for entry in value)
    if kind is type(None):
        return value is None
    if kind in (int, float):
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    return isinstance(value, kind)
