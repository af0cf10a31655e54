"""The click layer: parse options, call a verb's run(...), turn DflashError into an exit code.

Command docstrings are the --help text.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import click

from . import console, retry
from .commands import watch  # its GPU_INTERVAL_S is an option's default
from .errors import DflashError, ExitCode
from .local_state import latest_host, resolve_run
from .session import Session


def _verb(name: str):
    """The module of verb `name`, imported when that verb runs: `--help` and the other
    verbs do not pay for its imports (deploy's alone cost as much as click's)."""
    return importlib.import_module(f".commands.{name}", __package__)


class _Group(click.Group):
    """Runs a command and maps the core's one error type to a message and exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DflashError as exc:
            console.human.print(f"dflash: error: {exc.message}", style="red", markup=False,
                                highlight=False, soft_wrap=True)
            if exc.hint:
                console.human.print(f"hint: {exc.hint}", markup=False, highlight=False, soft_wrap=True)
            ctx.exit(int(exc.exit_code))
        except KeyboardInterrupt:
            console.say("interrupted")
            ctx.exit(int(ExitCode.INTERRUPTED))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--hosts", "hosts_file", envvar="DFLASH_HOSTS", type=click.Path(dir_okay=False),
              help="Host inventory (default: ./configs/hosts.yaml; env DFLASH_HOSTS).")
@click.option("--logs-dir", default="logs", envvar="DFLASH_LOGS", show_default=True,
              type=click.Path(file_okay=False), help="Where fetched logs and tracebacks are kept.")
@click.option("--accept-new-host-key", is_flag=True,
              help="Record the SSH host key of a host seen for the first time instead of refusing it.")
@click.pass_context
def main(ctx: click.Context, hosts_file: str | None, logs_dir: str, accept_new_host_key: bool) -> None:
    """Train DFlash drafters on remote GPU hosts and see why they failed, at once.

    Exit codes: 0 success, 1 the run failed (traceback printed; for `status`: also
    degraded or stalled), 2 usage or configuration error, 3 host unreachable, 4 the run
    was stopped, 130 interrupted (the run keeps going). Data goes to stdout; progress and
    tables to stderr.
    """
    ctx.obj = ctx.with_resource(contextlib.closing(Session(hosts_file, Path(logs_dir), accept_new_host_key)))


@main.command("deploy")
@click.argument("host_names", nargs=-1, metavar="HOST...")
@click.option("--all", "all_hosts", is_flag=True, help="Deploy to every host of the inventory.")
@click.option("--verify", is_flag=True,
              help="Re-hash the host's release files instead of comparing size, mtime and ctime.")
@click.option("--source", "source_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Deploy this project tree (default: the one holding the current directory, "
                   "else the copy bundled with dflash).")
@click.pass_obj
def deploy_cmd(session: Session, host_names: tuple[str, ...], all_hosts: bool, verify: bool,
               source_dir: Path | None) -> None:
    """Send remote/ and configs/ to HOSTs as a content-addressed release.

    Only files the host lacks an intact copy of travel, in one tar stream; the host
    verifies every file's sha256 before switching `current`, so an interrupted deploy
    (Ctrl-C included) leaves the previous release in place. A release that was modified
    on the host is replaced by a fresh copy (result `repaired`). An unchanged tree costs
    one round trip. Prints `host<TAB>release<TAB>result` per host on stdout.

    The tree sent is --source DIR, else the project tree holding the current
    directory (the nearest folder with remote/agent.py and remote/dflash_agent/),
    else the copy bundled with dflash; a `source:` line on stderr says which, with
    its git commit and uncommitted changes.
    """
    sys.exit(_verb("deploy").run(session, list(host_names), all_hosts, verify, source_dir))


@main.command("launch")
@click.argument("host_name", metavar="HOST")
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Training config (YAML), validated here before anything is sent.")
@click.option("--name", help="Run name (default: the config's file name); the run id starts with it.")
@click.option("--follow", is_flag=True, help="Watch the run after starting it (as `dflash watch`).")
@click.option("--force", is_flag=True, help="Start next to the runs holding the same GPUs (they keep them too).")
@click.option("--source", "source_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Deploy this project tree (default: the one holding the current directory, "
                   "else the copy bundled with dflash).")
@click.pass_obj
def launch_cmd(session: Session, host_name: str, config_path: Path, name: str | None,
               follow: bool, force: bool, source_dir: Path | None) -> None:
    """Start a training run on HOST, detached; print its run id on stdout.

    Deploys first if the host's current release differs from the source tree (chosen
    as for `deploy`; run.json records it, with its git commit and uncommitted
    changes, for `status`). Refuses a second run on the same GPUs of a host unless --force.
    """
    ref = _verb("launch").run(session, host_name, config_path, name, force, source_dir)
    console.data(ref.run_id + "\n")
    if follow:
        sys.exit(watch.run(session, ref, tail=None, interval=watch.GPU_INTERVAL_S, as_json=False,
                           retry_for=retry.RETRY_FOR_S))


@main.command("watch")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--host", "host_name", help="Host of the run (default: the latest run's host).")
@click.option("--tail", type=click.IntRange(min=0), help="First show the last N lines of the log.")
@click.option("--interval", default=watch.GPU_INTERVAL_S, show_default=True, type=click.FloatRange(min=0.5),
              help="Seconds between GPU lines.")
@click.option("--json", "as_json", is_flag=True, help="Print every message as a JSON line on stdout.")
@click.option("--retry-for", default=retry.RETRY_FOR_S, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to keep reconnecting to an unreachable host before exit 3.")
@click.pass_obj
def watch_cmd(session: Session, run_id: str | None, host_name: str | None, tail: int | None,
              interval: float, as_json: bool, retry_for: float) -> None:
    """Follow RUN live (default: the latest run): log lines, GPU line, failures.

    When a thread records an error its full traceback is printed at once and saved
    under logs/<host>/<run>/. A dropped connection resumes where it stopped, with no
    gap and no duplicate. Ctrl-C detaches; the run keeps going. A STALLED run is
    followed on (a stall may end: a slow compile, a long checkpoint; `dflash stacks`
    shows where it hangs). Exits when the run ends: 0 succeeded, 1 failed or lost,
    4 stopped; 3 host unreachable.
    """
    ref = resolve_run(session.logs_dir, run_id, host_name)
    sys.exit(watch.run(session, ref, tail, interval, as_json, retry_for))


def _output_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """-o FILE: its folder must exist, checked before the host is asked anything."""
    if value is not None and not value.parent.is_dir():
        raise click.BadParameter(f"{value}: the folder {value.parent} does not exist", ctx, param)
    return value


@main.command("fetch-traceback")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--host", "host_name", help="Host of the run (default: the latest run's host).")
@click.option("--thread", help="The record of this thread (e.g. drafter-1).")
@click.option("--all", "all_records", is_flag=True, help="Every error record, earliest first.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), callback=_output_file,
              help="Write to FILE.")
@click.option("--stacks", "show_stacks", is_flag=True,
              help="Every thread's stack instead: a fresh dump of a live run, else the last dump.")
@click.pass_obj
def fetch_traceback_cmd(session: Session, run_id: str | None, host_name: str | None,
                        thread: str | None, all_records: bool, output: Path | None,
                        show_stacks: bool) -> None:
    """Print the complete traceback of the run's root cause (its earliest error record).

    The text is exactly what the failing thread formatted, chained causes included,
    under a one-line header. A run that died with no record (killed, OOM, segfault,
    abort) gets its exit.json, the last faulthandler dump and last log lines by thread
    instead. A hang records no error: for a STALLED run the host dumps every thread's
    stack now, and a STOPPED run shows its last dump, threads named (drafter-1, ...).
    """
    ref = resolve_run(session.logs_dir, run_id, host_name)
    sys.exit(_verb("fetch_traceback").run(session, ref, thread, all_records, output, show_stacks))


@main.command("stacks")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--host", "host_name", help="Host of the run (default: the latest run's host).")
@click.pass_obj
def stacks_cmd(session: Session, run_id: str | None, host_name: str | None) -> None:
    """Print every thread's stack of RUN (default: the latest run), by thread name.

    A live run dumps its stacks now (faulthandler, so even a thread hung while holding
    the GIL shows); a run that ended shows the last dump it left. Short for
    `dflash fetch-traceback --stacks`.
    """
    ref = resolve_run(session.logs_dir, run_id, host_name)
    sys.exit(_verb("stacks").run(session, ref))


@main.command("status")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--host", "host_name", help="Host of the run (default: the latest run's host).")
@click.option("--json", "as_json", is_flag=True, help="The status as JSON on stdout.")
@click.pass_obj
def status_cmd(session: Session, run_id: str | None, host_name: str | None, as_json: bool) -> None:
    """Print RUN's state (default: the latest run) on stdout, details on stderr.

    Exit code 0 while it is fine (STARTING, RUNNING) or succeeded; 1 FAILED, LOST,
    DEGRADED (a thread failed) or STALLED (no heartbeat for stall_after seconds:
    `dflash stacks` shows where it hangs); 4 STOPPED.
    """
    ref = resolve_run(session.logs_dir, run_id, host_name)
    sys.exit(_verb("status").run_status(session, ref, as_json))


@main.command("stop")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--host", "host_name", help="Host of the run (default: the latest run's host).")
@click.option("--grace", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds between SIGTERM and SIGKILL.")
@click.pass_obj
def stop_cmd(session: Session, run_id: str | None, host_name: str | None, grace: float) -> None:
    """Stop RUN: SIGTERM to its process group, then SIGKILL after --grace seconds.

    Returns only when none of the run's processes is left.
    """
    ref = resolve_run(session.logs_dir, run_id, host_name)
    sys.exit(_verb("stop").run(session, ref, grace))


@main.command("pull")
@click.argument("run_id", metavar="[RUN]", required=False)
@click.option("--host", "host_name", help="Host of the run (default: the latest run's host).")
@click.option("--checkpoint", is_flag=True, help="Also the run's newest checkpoint, to checkpoint/<step>/.")
@click.option("--retry-for", default=retry.RETRY_FOR_S, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to keep reconnecting after a dropped connection before exit 3.")
@click.pass_obj
def pull_cmd(session: Session, run_id: str | None, host_name: str | None, checkpoint: bool,
             retry_for: float) -> None:
    """Bring RUN's export (default: the latest run) to logs/<host>/<run>/export/.

    Every file is checked against the sha256 the trainer recorded (SHA256SUMS) before
    it takes its name; files whose local copy matches are not sent again, and a pull cut
    short (dropped connection, Ctrl-C) goes on from the bytes it had. A run still
    training can be pulled: a folder it replaces meanwhile is listed again. Prints the
    local folders on stdout; exit 2 when the run has no export (or no checkpoint) yet,
    3 when the host stays unreachable.
    """
    ref = resolve_run(session.logs_dir, run_id, host_name)
    sys.exit(_verb("pull").run(session, ref, checkpoint, retry_for))


@main.command("runs")
@click.option("--host", "host_names", multiple=True,
              help="This host (repeatable; default: the latest run's host, else local).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run on stdout.")
@click.pass_obj
def runs_cmd(session: Session, host_names: tuple[str, ...], as_json: bool) -> None:
    """List the runs on hosts, newest first: `host<TAB>run<TAB>state` on stdout."""
    sys.exit(_verb("status").list_runs(session, list(host_names) or [latest_host(session.logs_dir)], as_json))


@main.command("hosts")
@click.option("--check", "do_check", is_flag=True,
              help="Connect to each host: reachable, container running, python/torch/transformers, GPUs, "
                   "and whether the current release was modified on the host (exit 2).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per host on stdout.")
@click.option("-v", "--verbose", is_flag=True,
              help="Per SSH host, the effective SSH options (as `ssh -G` resolves the alias) and where each "
                   "came from: your ssh config, the inventory, or the default.")
@click.pass_obj
def hosts_cmd(session: Session, do_check: bool, as_json: bool, verbose: bool) -> None:
    """List the hosts of the inventory (the built-in `local` included).

    With --check, exit 3 when a host is unreachable, 2 when one cannot run the trainer
    (its python lacks torch or transformers, or the check failed there).
    """
    sys.exit(_verb("hosts").run(session, do_check, as_json, verbose))
