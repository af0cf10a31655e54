"""The click layer: parse options, call a verb's core, render its result (results.py) and
exit with its code; turn DflashError into a message and an exit code.

Command docstrings are the --help text. Each command imports its verb's module when it
runs: `--help` and the other verbs do not pay for its imports (deploy's alone cost as
much as click's).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import NoReturn

import click

from . import completion, console, results, retry, run_hosts, run_names
from .commands import GPU_INTERVAL_S, GRACE_S, WatchOptions
from .errors import BadOption, DflashError, ExitCode
from .local_state import RunRef, latest_or_refuse
from .project_tree import LARGE_RELEASE_BYTES, in_state_root
from .run_hosts import Reach
from .session import CLI_CONFIG_ENV, DEFAULT_LOGS, HOSTS_ENV, LOGS_ENV, Session


JSON_ASKED = "dflash.json"  # ctx.meta: the verb was given --json, so its error is JSON too


class _Group(click.Group):
    """Runs a command and maps the core's one error type to a message and exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Seen before the verb parses its options: a usage error of the verb is JSON too.
        ctx.meta.setdefault(JSON_ASKED, "--json" in (args[:args.index("--")] if "--" in args else args))
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DflashError as exc:
            _fail(ctx, exc)
        except click.ClickException as exc:
            if not ctx.meta.get(JSON_ASKED):
                raise
            exc.show()
            console.data(console.json_line({"error": exc.format_message(), "hint": None, "exit_code": exc.exit_code}))
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            console.say("interrupted")
            if ctx.meta.get(JSON_ASKED):
                console.data(console.json_line({"error": "interrupted", "hint": None,
                                                "exit_code": int(ExitCode.INTERRUPTED)}))
            ctx.exit(int(ExitCode.INTERRUPTED))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's first sentence whole, wrapped: click cuts it to one line with `...`."""
        rows = [(name, command.get_short_help_str(limit=sys.maxsize)) for name in self.list_commands(ctx)
                if (command := self.get_command(ctx, name)) is not None and not command.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _fail(ctx: click.Context, exc: DflashError) -> None:
    """The core's error as a message and its exit code; under --json also as one JSON
    object on stdout (docs/cli.md "--json")."""
    if isinstance(exc, BadOption):
        exc.message = exc.named({option: _flag(ctx, option) for option in exc.options})
    console.human.print(f"dflash: error: {exc.message}", style="red", markup=False,
                        highlight=False, soft_wrap=True)
    if exc.hint:
        console.human.print(f"hint: {exc.hint}", markup=False, highlight=False, soft_wrap=True)
    if ctx.meta.get(JSON_ASKED):
        console.data(console.json_line({"error": exc.message, "hint": exc.hint, "exit_code": int(exc.exit_code)}))
    ctx.exit(int(exc.exit_code))


def _flag(ctx: click.Context, option: str) -> str:
    """The --flag of the running command whose parameter is the core's `option` (the
    API's spelling, which each command's parameter takes)."""
    group = ctx.command
    command = group.get_command(ctx, ctx.invoked_subcommand) if isinstance(group, click.Group) else group
    for param in command.params if command else ():
        if param.name == option and isinstance(param, click.Option):
            return max(param.opts, key=len)
    return option


def _finish(result: object, as_json: bool) -> NoReturn:
    """A verb's result printed (results.py) and the process's exit with its code."""
    results.render(result, as_json)
    if (error := results.refusal(result)) is not None:
        raise error
    sys.exit(int(results.exit_code(result)))


def _json_option(what: str):
    """--json, saying what the verb prints as JSON on stdout."""
    return click.option("--json", "as_json", is_flag=True, help=f"{what} (an error: one JSON object with "
                                                                   "\"error\" and \"exit_code\").")


# deploy's and launch's; the limit is project_tree's, stated there once
_ALLOW_LARGE_HELP = (f"Send a release over {LARGE_RELEASE_BYTES >> 20} MiB (refused by default, naming its largest "
                     "files: data belongs on the host).")


def _run_argument(name: str = "run_id", metavar: str = "[RUN]", required: bool = False):
    return click.argument(name, metavar=metavar, required=required, shell_complete=completion.runs)


def _host_option(what: str = "Host of the run (default: the latest run's host)."):
    return click.option("--host", "host_name", help=what, shell_complete=completion.hosts)


def _chosen_run(session: Session, run_id: str | None, host_name: str | None, reach: Reach) -> RunRef:
    """RUN and --host of the command running, as run_hosts.chosen_run reads them."""
    verb = click.get_current_context().info_name
    if host_name is not None and host_name not in session.inventory.hosts and not (session.logs_dir / host_name).is_dir():
        session.host(host_name)  # a host neither known nor recorded: that is the error, not a missing run
    return run_hosts.chosen_run(session, run_id, host_name, reach, naming=f"dflash {verb} RUN --host HOST")


def _show_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """--version runs while options are parsed, before any command (and without an inventory)."""
    if not value or ctx.resilient_parsing:
        return
    from .commands import version

    try:
        found = version.version()
        results.render(found, as_json=False)
        ctx.exit(int(results.exit_code(found)))
    except DflashError as exc:
        _fail(ctx, exc)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--hosts", "hosts_file", envvar=HOSTS_ENV, type=click.Path(dir_okay=False),
              help=f"Host inventory (default: configs/hosts.yaml of the project root; env {HOSTS_ENV}).")
@click.option("--logs-dir", envvar=LOGS_ENV, type=click.Path(file_okay=False),
              help=f"Where fetched logs and tracebacks are kept (default: {DEFAULT_LOGS}/ of the project root, the "
                   f"nearest folder up holding configs/hosts.yaml, dflash.yaml or {DEFAULT_LOGS}/; env {LOGS_ENV}).")
@click.option("--accept-new-host-key", is_flag=True,
              help="Record the SSH host key of a host seen for the first time instead of refusing it.")
@click.option("--cli-config", "cli_config_file", envvar=CLI_CONFIG_ENV, type=click.Path(dir_okay=False),
              help=f"This machine's CLI settings, e.g. trackers (default: ./dflash.yaml; env {CLI_CONFIG_ENV}).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Print dflash's version and the release id the current tree would deploy, then exit.")
@click.pass_context
def main(ctx: click.Context, hosts_file: str | None, logs_dir: str | None, accept_new_host_key: bool,
         cli_config_file: str | None) -> None:
    """Train DFlash drafters on remote GPU hosts and see why they failed, at once.

    Exit codes: 0 success, 1 the run failed (traceback printed; for `status`: also
    degraded or stalled), 2 usage or configuration error, 3 host unreachable, 4 the run
    was stopped, 5 the local disk (logs/) is full, 130 interrupted (the run keeps going).
    Data goes to stdout; progress and tables to stderr.
    """
    ctx.obj = ctx.with_resource(contextlib.closing(Session(hosts_file, Path(logs_dir or in_state_root(DEFAULT_LOGS)),
                                                           accept_new_host_key, cli_config_file)))


@main.command("deploy")
@click.argument("host_names", nargs=-1, metavar="HOST...", shell_complete=completion.hosts)
@click.option("--all", "all_hosts", is_flag=True, help="Deploy to every host of the inventory.")
@click.option("--verify", is_flag=True,
              help="Re-hash the host's release files instead of comparing size, mtime and ctime.")
@click.option("--source", "source_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Deploy this project tree (default: the one holding the current directory, "
                   "else the copy bundled with dflash).")
@click.option("--allow-large", is_flag=True, help=_ALLOW_LARGE_HELP)
@_json_option("One JSON object per host on stdout: its result, or its error")
@click.pass_obj
def deploy_cmd(session: Session, host_names: tuple[str, ...], all_hosts: bool, verify: bool,
               source_dir: Path | None, allow_large: bool, as_json: bool) -> None:
    """Send remote/ and configs/ to HOSTs as a content-addressed release.

    Only files the host lacks an intact copy of travel, in one tar stream; the host
    verifies every file's sha256 before switching `current`, so an interrupted deploy
    (Ctrl-C included) leaves the previous release in place. A release that was modified
    on the host is replaced by a fresh copy (result `repaired`). An unchanged tree costs
    one round trip. Prints `host<TAB>release<TAB>result` per host on stdout.

    The tree sent is --source DIR, else the project tree holding the current
    directory (the nearest folder with remote/agent.py and remote/dflash_agent/),
    else the copy bundled with dflash; a `source:` line on stderr says which, with
    its git commit and uncommitted changes. A release holds what git would commit
    of remote/ and configs/ (what .gitignore ignores stays here), minus what
    .dflashignore names; files are read from disk as they are sent.
    """
    from .commands import deploy

    _finish(deploy.deploy(session, list(host_names), all_hosts=all_hosts, verify=verify, source_dir=source_dir,
                          allow_large=allow_large), as_json)


@main.command("setup")
@click.argument("host_names", nargs=-1, metavar="HOST...", shell_complete=completion.hosts)
@click.option("--all", "all_hosts", is_flag=True, help="Set up every host of the inventory.")
@click.option("--torch", "torch_version", metavar="VERSION",
              help="Install this torch version (within the range remote/requirements.txt supports).")
@click.option("--index-url", metavar="URL",
              help="Where torch comes from (default: the PyTorch index for the host's CUDA driver, "
                   "https://download.pytorch.org/whl/cpu without a GPU); `pip`: the indexes pip on "
                   "the host is configured with.")
@_json_option("One JSON object per host on stdout: its result, or its error")
@click.pass_obj
def setup_cmd(session: Session, host_names: tuple[str, ...], all_hosts: bool, torch_version: str | None,
              index_url: str | None, as_json: bool) -> None:
    """Make on HOSTs the interpreter the trainer needs: a virtualenv in WORKSPACE/envs/
    with remote/requirements.txt installed, and torch built for the host's CUDA driver.

    It is built beside the one in use and WORKSPACE/env is switched to it only once
    complete: a failed install exits 2 naming the package and leaves the previous
    environment working. Nothing to change costs one round trip (result `unchanged`).
    The environment is the host's interpreter unless the inventory names `python` for
    it. pip's output streams to stderr; `host<TAB>result<TAB>environment` per host on
    stdout.
    """
    from .commands import setup

    _finish(setup.setup(session, list(host_names), all_hosts=all_hosts, torch=torch_version,
                        index_url=index_url), as_json)


@main.command("launch")
@click.argument("host_names", metavar="HOST...", nargs=-1, required=True, shell_complete=completion.hosts_and_groups)
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Training config (YAML), validated here before anything is sent.")
@click.option("--name", help="Run name (default: the config's file name); the run id starts with it.")
@click.option("--follow", is_flag=True, help="Watch the run after starting it (as `dflash watch`).")
@click.option("--force", is_flag=True, help="Start next to the runs holding the same GPUs (they keep them too).")
@click.option("--source", "source_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Deploy this project tree (default: the one holding the current directory, "
                   "else the copy bundled with dflash).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one config key (dotted: optim.lr=1e-4; VALUE read as YAML); repeatable.")
@click.option("--allow-large", is_flag=True, help=_ALLOW_LARGE_HELP)
@click.option("--master-addr", metavar="ADDRESS",
              help="Several hosts: where the others reach the first (default: its inventory address).")
@click.option("--master-port", type=int, metavar="PORT",
              help="Several hosts: the first host's rendezvous port (default: one free there).")
@click.option("--dry-run", is_flag=True,
              help="Print the GPU memory estimate of every device against the host's GPUs; deploy and "
                   "start nothing (exit 2 if it does not fit).")
@_json_option("The run started as one JSON object on stdout (with --dry-run: every check's verdict; with "
              "--follow: then the watch's JSON lines)")
@click.pass_obj
def launch_cmd(session: Session, host_names: tuple[str, ...], config_path: Path, name: str | None,
               follow: bool, force: bool, source_dir: Path | None, overrides: tuple[str, ...],
               allow_large: bool, master_addr: str | None, master_port: int | None, dry_run: bool,
               as_json: bool) -> None:
    """Start a training run on HOST, detached; print its run id on stdout.

    Deploys first if the host's current release differs from the source tree (chosen
    as for `deploy`; run.json records it, with its git commit and uncommitted
    changes, for `status`). Refuses a second run on the same GPUs of a host unless --force.

    --set KEY=VALUE changes one key of the config before it is checked, as if the
    file said so: `--set optim.lr=1e-4 --set drafter.num_layers=3`. VALUE is one YAML
    value (1e-4 a number, true a boolean, [a, b] a list, {k: v} a mapping that replaces
    the key's, nothing at all null; quote a string that would read otherwise: 'off').
    The run directory's config.yaml is the resolved config (every default filled in,
    the overrides applied; `dflash status RUN --config` prints it) and run.json lists
    the overrides.

    Before starting, one line says what the release changed since the newest run on
    HOST (`changed since RUN: 2 files (+14 −3)`, or `same release as RUN`).

    Several HOSTs (or an inventory group) make one run with one trainer per host, the
    first being rank 0: every host is deployed and checked before any starts, and a
    start that fails stops the others. watch, status, stop and fetch-traceback then
    take the run id alone and cover every host.

    Before anything is deployed, the peak GPU memory of every device is estimated from
    the config and the target's config.json on the host, and a run that will not fit a
    GPU is refused (exit 2), naming the device, the estimate, its largest terms and
    what to change. --dry-run prints the estimate, term by term, and stops there.
    """
    from .commands import launch

    options = launch.LaunchOptions(host_names, config_path, name=name, force=force, source_dir=source_dir,
                                   overrides=overrides, allow_large=allow_large, master_addr=master_addr,
                                   master_port=master_port)
    if dry_run:
        _finish(launch.dry_run(session, options), as_json)
    if follow:
        _require_trackers(session)
    launched = launch.start(session, options)
    results.render(launched, as_json)
    sys.exit(_watch_after(session, launched.ref, as_json) if follow else int(results.exit_code(launched)))


@main.command("resume")
@_run_argument()
@_host_option()
@click.option("--follow", is_flag=True, help="Watch the run after resuming it (as `dflash watch`).")
@click.option("--release", type=click.Choice(["current"]),
              help="Run the host's current release instead of the run's own (`current`).")
@click.option("--step", type=int,
              help="Resume from the checkpoint of this step (default: the newest complete one).")
@_json_option("The attempt started as one JSON object on stdout (with --follow: then the watch's JSON lines)")
@click.pass_obj
def resume_cmd(session: Session, run_id: str | None, host_name: str | None, follow: bool,
               release: str | None, step: int | None, as_json: bool) -> None:
    """Continue RUN (default: the latest run) from its newest complete checkpoint.

    The run must have ended (stopped, failed or lost). It goes on as the next attempt of
    the same run id, with the same config and release (or, with --release current, the
    host's current one; a line says which): step count, data cursor, optimizer and loss
    curve as the checkpoint left them; train.log and the events go on after an attempt
    line. `status` and `fetch-traceback` show the latest attempt (`--all`: every one).
    Refused (exit 2, with the reason) while the run is live, when it has no checkpoint,
    or when the checkpoint does not fit the config. A run on several hosts resumes as
    one: every host from rank 0's checkpoint at one step, checked on every host first.
    """
    from .commands import resume

    options = resume.ResumeOptions(release == "current", step)
    ref = _chosen_run(session, run_id, host_name, Reach.EVERY)
    if follow:
        _require_trackers(session)
    resumed = resume.start(session, ref, options)
    results.render(resumed, as_json)
    sys.exit(_watch_after(session, ref, as_json) if follow else int(results.exit_code(resumed)))


def _require_trackers(session: Session) -> None:
    """--follow: the trackers' packages, checked before the run starts rather than after."""
    from .trackers.hub import checked_settings

    checked_settings(session.local_config.trackers, session.local_config.source)


def _watch_after(session: Session, ref: RunRef, as_json: bool) -> ExitCode:
    """--follow: `dflash watch RUN` with its defaults, once the run is started."""
    from .commands import watch

    return watch.run(session, ref, WatchOptions(), as_json=as_json)


@main.command("watch")
@_run_argument()
@_host_option()
@click.option("--tail", type=int, help="First show the last N lines of the log.")
@click.option("--interval", "gpu_interval", default=GPU_INTERVAL_S, show_default=True, type=float,
              help="Seconds between GPU lines.")
@_json_option("Print every message as a JSON line on stdout")
@click.option("--retry-for", default=retry.RETRY_FOR_S, show_default=True, type=float,
              help="Seconds to keep reconnecting to an unreachable host before exit 3.")
@click.option("--trackers/--no-trackers", default=True, show_default=True,
              help="Send the run's scalars to the trackers of dflash.yaml (W&B, MLflow, trackio).")
@click.pass_obj
def watch_cmd(session: Session, run_id: str | None, host_name: str | None, tail: int | None,
              gpu_interval: float, as_json: bool, retry_for: float, trackers: bool) -> None:
    """Follow RUN live (default: the latest run): log lines, GPU line, failures.

    When a thread records an error its full traceback is printed at once and saved
    under logs/<host>/<run>/; a run that ends FAILED of a failure dflash knows ends
    with one `diagnosis:` line and the setting to change. A dropped connection
    resumes where it stopped, with no gap and no duplicate. Ctrl-C detaches; the run
    keeps going. A STALLED run is followed on (a stall may end: a slow compile, a long
    checkpoint; `dflash stacks` shows where it hangs). Exits when the run ends: 0
    succeeded, 1 failed or lost, 4 stopped; 3 host unreachable.

    The trackers of dflash.yaml (`trackers:` W&B, MLflow, trackio) get every scalar
    TensorBoard gets, in one tracker run per run that each watch, and each attempt's,
    goes on with; a tracker that fails is said and left, and the watch goes on.
    """
    from .commands import watch

    options = WatchOptions(tail, gpu_interval, retry_for, trackers)
    ref = _chosen_run(session, run_id, host_name, Reach.ANY)
    sys.exit(watch.run(session, ref, options, as_json=as_json))


def _output_file(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """-o FILE: its folder must exist, checked before the host is asked anything."""
    if value is not None and not value.parent.is_dir():
        raise click.BadParameter(f"{value}: the folder {value.parent} does not exist", ctx, param)
    return value


@main.command("fetch-traceback")
@_run_argument()
@_host_option()
@click.option("--thread", help="The record of this thread (e.g. drafter-1).")
@click.option("--all", "all_records", is_flag=True, help="Every error record, earliest first.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), callback=_output_file,
              help="Write to FILE.")
@click.option("--stacks", is_flag=True,
              help="Every thread's stack instead: a fresh dump of a live run, else the last dump.")
@_json_option("What was found as one JSON object on stdout: the text, the root cause's record, the diagnosis")
@click.pass_obj
def fetch_traceback_cmd(session: Session, run_id: str | None, host_name: str | None,
                        thread: str | None, all_records: bool, output: Path | None,
                        stacks: bool, as_json: bool) -> None:
    """Print the complete traceback of the run's root cause (its earliest error record).

    The text is exactly what the failing thread formatted, chained causes included,
    under a one-line header; a failure dflash knows is followed by one `diagnosis:`
    line (stderr) and the setting to change. A run that died with no record (killed,
    OOM, segfault, abort) gets its exit.json, the last faulthandler dump and last log
    lines by thread instead. A hang records no error: for a STALLED run the host dumps
    every thread's stack now, and a STOPPED run shows its last dump, threads named
    (drafter-1, ...).
    """
    from .commands import fetch_traceback

    ref = _chosen_run(session, run_id, host_name, Reach.ANY)
    _finish(fetch_traceback.fetch(session, ref, thread=thread, all_records=all_records, stacks=stacks,
                                  output=output), as_json)


@main.command("stacks")
@_run_argument()
@_host_option()
@_json_option("The stacks as one JSON object on stdout, as `fetch-traceback --stacks --json`")
@click.pass_obj
def stacks_cmd(session: Session, run_id: str | None, host_name: str | None, as_json: bool) -> None:
    """Print every thread's stack of RUN (default: the latest run), by thread name.

    A live run dumps its stacks now (faulthandler, so even a thread hung while holding
    the GIL shows); a run that ended shows the last dump it left. Short for
    `dflash fetch-traceback --stacks`.
    """
    from .commands import fetch_traceback

    ref = _chosen_run(session, run_id, host_name, Reach.ANY)
    _finish(fetch_traceback.fetch(session, ref, stacks=True), as_json)


@main.command("status")
@_run_argument()
@_host_option()
@_json_option("The status as one JSON object on stdout")
@click.option("--config", "show_config", is_flag=True,
              help="Print the run's config.yaml instead (resolved: every default, the --set overrides applied).")
@click.pass_obj
def status_cmd(session: Session, run_id: str | None, host_name: str | None, as_json: bool,
               show_config: bool) -> None:
    """Print RUN's state (default: the latest run) on stdout, details on stderr.

    Exit code 0 while it is fine (STARTING, RUNNING) or succeeded; 1 FAILED, LOST,
    DEGRADED (a thread failed) or STALLED (no heartbeat for stall_after seconds:
    `dflash stacks` shows where it hangs); 4 STOPPED.

    With --config: the config the run runs, as YAML on stdout (with --json: in the
    status object as "config"), the state and the launch's --set overrides on stderr;
    exit 0 whatever the state.
    """
    from .commands import status

    ref = _chosen_run(session, run_id, host_name, Reach.FIRST if show_config else Reach.ANY)
    _finish(status.config(session, ref) if show_config else status.status(session, ref), as_json)


@main.command("stop")
@_run_argument()
@_host_option()
@click.option("--grace", default=GRACE_S, show_default=True, type=float,
              help="Seconds between SIGTERM and SIGKILL.")
@_json_option("The outcome as one JSON object on stdout: the run's state and each host's")
@click.pass_obj
def stop_cmd(session: Session, run_id: str | None, host_name: str | None, grace: float, as_json: bool) -> None:
    """Stop RUN: SIGTERM to its process group, then SIGKILL after --grace seconds.

    Returns only when none of the run's processes is left.
    """
    from .commands import stop

    options = stop.StopOptions(grace)
    ref = _chosen_run(session, run_id, host_name, Reach.ANY)
    _finish(stop.stop(session, ref, options), as_json)


@main.command("pull")
@_run_argument()
@_host_option()
@click.option("--checkpoint", is_flag=True, help="Also the run's newest checkpoint, to checkpoint/<step>/.")
@click.option("--retry-for", default=retry.RETRY_FOR_S, show_default=True, type=float,
              help="Seconds to keep reconnecting after a dropped connection before exit 3.")
@_json_option("What was pulled as one JSON object on stdout: the local folders and their files")
@click.pass_obj
def pull_cmd(session: Session, run_id: str | None, host_name: str | None, checkpoint: bool,
             retry_for: float, as_json: bool) -> None:
    """Bring RUN's export (default: the latest run) to logs/<host>/<run>/export/.

    Every file is checked against the sha256 the trainer recorded (SHA256SUMS) before
    it takes its name; files whose local copy matches are not sent again, and a pull cut
    short (dropped connection, Ctrl-C) goes on from the bytes it had. A run still
    training can be pulled: a folder it replaces meanwhile is listed again. Prints the
    local folders on stdout; exit 2 when the run has no export (or no checkpoint) yet,
    3 when the host stays unreachable.
    """
    from .commands import pull

    options = pull.PullOptions(checkpoint, retry_for)
    ref = _chosen_run(session, run_id, host_name, Reach.FIRST)
    _finish(pull.pull(session, ref, options), as_json)


@main.command("plot")
@click.argument("run_ids", nargs=-1, metavar="[RUN]...", shell_complete=completion.runs)
@_host_option("Host of the runs (default: found among the runs watched here).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), callback=_output_file,
              help="The PNG to write (default: ./<first run>.png).")
@_json_option("The PNG's path and the runs drawn as one JSON object on stdout")
@click.pass_obj
def plot_cmd(session: Session, run_ids: tuple[str, ...], host_name: str | None, output: Path | None,
             as_json: bool) -> None:
    """Draw RUNs (default: the latest run) in one PNG: loss, acceptance length and
    throughput over steps, one line per run.

    Reads the events `dflash watch` mirrored under logs/<host>/<run>/ (watch a run
    first; nothing is fetched here). Prints the file's path on stdout.
    """
    from .commands import plot

    naming = "dflash plot RUN --host HOST"
    refs = [run_names.find(session, run_id, host_name, ask_hosts=False) for run_id in run_ids] or \
        [latest_or_refuse(session.logs_dir, host_name, naming)]
    for ref in refs:  # the events mirrored here are drawn all the same
        if note := run_hosts.note_left(session, ref):
            console.warn(note)
    _finish(plot.plot(session.logs_dir, refs, output=output), as_json)


@main.command("runs")
@click.option("--host", "host_names", multiple=True, shell_complete=completion.hosts,
              help="This host (repeatable; default: the latest run's host, else local).")
@_json_option("One JSON object per run on stdout")
@click.pass_obj
def runs_cmd(session: Session, host_names: tuple[str, ...], as_json: bool) -> None:
    """List the runs on hosts, newest first: `host<TAB>run<TAB>state` on stdout.

    The table (stderr) adds each run's source commit (`*`: with uncommitted changes) and
    what its release changed since the run before it on that host: `2 files (+14 −3)`,
    or `same release as RUN`. A run whose run.json cannot be read is named on stderr
    instead (exit 2); the others are listed all the same.
    """
    from .commands import status

    _finish(status.list_runs(session, list(host_names)), as_json)


@main.command("diff")
@_run_argument("run_a", "RUN_A", required=True)
@_run_argument("run_b", "RUN_B", required=True)
@click.argument("paths", nargs=-1, metavar="[-- PATH...]")
@_host_option("Host of both runs (or write HOST/RUN).")
@click.option("--stat", is_flag=True, help="Per file, lines added and removed (`added<TAB>removed<TAB>path`).")
@click.option("--config", "config", is_flag=True, help="Diff the runs' config.yaml instead of their code.")
@_json_option("The runs, their releases and each file that differs (its diff, lines added and removed) as one "
              "JSON object on stdout")
@click.pass_obj
def diff_cmd(session: Session, run_a: str, run_b: str, paths: tuple[str, ...], host_name: str | None,
             stat: bool, config: bool, as_json: bool) -> None:
    """Show what RUN_B's release changed from RUN_A's, as a unified diff on stdout.

    Computed from the releases the runs used, kept on their hosts (fetched once into
    <logs>/releases/): no local git history needed, across hosts (HOST/RUN), whatever
    the source tree became since. PATHs (after --) limit it to those files or folders.
    Binary files are said to differ.
    """
    from .commands import diff

    _finish(diff.diff(session, run_a, run_b, host=host_name, paths=paths, stat=stat, config=config), as_json)


@main.command("gc")
@click.argument("host_names", nargs=-1, metavar="HOST...", shell_complete=completion.hosts)
@click.option("--all", "all_hosts", is_flag=True, help="Every host of the inventory.")
@click.option("--keep", type=int, default=0, show_default=True,
              help="Unused releases to keep on each host, newest first.")
@_json_option("One JSON object per host on stdout: what was removed, or its error")
@click.pass_obj
def gc_cmd(session: Session, host_names: tuple[str, ...], all_hosts: bool, keep: int, as_json: bool) -> None:
    """Remove the releases on HOSTs that no recorded run uses, reporting the space freed.

    Never removes `current` or a release a run on the host used, and refuses while a
    deploy is installing a release there. Prints `host<TAB>release<TAB>bytes` per
    removed release.
    """
    from .commands import gc

    _finish(gc.gc(session, list(host_names), all_hosts=all_hosts, keep=keep), as_json)


@main.group("cache", cls=_Group)
def cache_group() -> None:
    """The hosts' compile caches (WORKSPACE/cache/compile/<key>/)."""


@cache_group.command("copy")
@click.argument("source", metavar="SOURCE", shell_complete=completion.hosts)
@click.argument("destinations", nargs=-1, metavar="DESTINATION...", shell_complete=completion.hosts)
@_json_option("One JSON object per compile cache key and destination on stdout: copied, or skipped and why")
@click.pass_obj
def cache_copy_cmd(session: Session, source: str, destinations: tuple[str, ...], as_json: bool) -> None:
    """Copy SOURCE's compile artifacts to each DESTINATION, so its runs start warm.

    Every key of SOURCE's compile cache that a DESTINATION has no artifacts of and can use
    (a GPU of the key's model; for CPU code the same CPU model) is sent, sha256-checked on
    the way and on arrival, and stored atomically; what is skipped is said with the reason.
    A run saves the artifacts after its first compile; a run on several hosts copies them
    between its hosts by itself before it starts.
    """
    from .commands import cache

    _finish(cache.copy(session, source, list(destinations)), as_json)


@main.command("hosts")
@click.argument("names", nargs=-1, metavar="[HOST|GROUP]...", shell_complete=completion.hosts_and_groups)
@click.option("--check", "do_check", is_flag=True,
              help="Connect to each host: reachable, container running, python/torch/transformers, GPUs, "
                   "whether it is ready to train, and whether the current release was modified on the host.")
@_json_option("One JSON object per host on stdout")
@click.option("-v", "--verbose", is_flag=True,
              help="Per SSH host, the effective SSH options (as `ssh -G` resolves the alias) and where each "
                   "came from: your ssh config, the inventory, or the default.")
@click.pass_obj
def hosts_cmd(session: Session, names: tuple[str, ...], do_check: bool, as_json: bool, verbose: bool) -> None:
    """List the hosts of the inventory (the built-in `local` included), or only the
    hosts and groups named (an unknown name is refused before any host is touched).

    With --check, a host is `ok` only when its interpreter imports torch and
    transformers in the versions remote/requirements.txt supports and torch sees every
    GPU nvidia-smi lists; otherwise `needs setup` with the `dflash setup` command to
    run. Exit 3 when a host is unreachable, 2 when one is not ok.
    """
    from .commands import hosts

    _finish(hosts.hosts(session, names, do_check=do_check, verbose=verbose), as_json)


@main.command("init")
@click.argument("host_names", nargs=-1, metavar="[HOST]...")
@click.option("--force", is_flag=True, help="Write over configs/hosts.yaml and dflash.yaml where they exist.")
@_json_option("The files written and the hosts as one JSON object on stdout")
def init_cmd(host_names: tuple[str, ...], force: bool, as_json: bool) -> None:
    """Write a project's configs/hosts.yaml and dflash.yaml, commented, from your SSH hosts.

    Every Host of your SSH client config (~/.ssh/config, or DFLASH_SSH_CONFIG) that
    names one host goes into the inventory, commented out; the HOSTs named are taken
    in. The files go to the current folder, which becomes a project root (dflash run from
    any folder under it finds them); either one there already is kept, and nothing
    written, unless --force. Prints the files' paths on stdout.
    """
    from .commands import init

    _finish(init.initialize(list(host_names), force), as_json)


@main.command("completion")
@click.option("--shell", type=click.Choice(completion.SHELLS), help="bash, zsh or fish (default: your $SHELL's).")
@click.option("--install", "do_install", is_flag=True,
              help="Install it: the script in a file of its own, read by the shell's start-up file "
                   "(~/.bashrc, ~/.zshrc; fish reads its completions folder), once.")
@_json_option("The script (with --install: where it went) as one JSON object on stdout")
@click.pass_context
def completion_cmd(ctx: click.Context, shell: str | None, do_install: bool, as_json: bool) -> None:
    """Complete dflash's verbs, options, run ids, run names and hosts in the shell.

    Prints the shell's completion script (`eval "$(dflash completion)"` in a start-up
    file uses it), or with --install installs it for new shells. The words come from
    this machine only (logs/ and the inventory): a Tab asks no host anything. The script
    runs `dflash` with _DFLASH_COMPLETE set (click's completion: `_DFLASH_COMPLETE=bash_source
    dflash` prints the same script).
    """
    from .commands import completion as verb

    _finish(verb.completion(ctx.find_root().command, shell=shell, do_install=do_install), as_json)
