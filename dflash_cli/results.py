"""The CLI's one place that turns a verb's result into output and an exit code.

`render(result, as_json)` prints it: as text, the data on stdout and the details on
stderr; with --json, one JSON object on stdout (docs/cli.md "--json"). `exit_code(result)`
is what the process exits with. The verbs' cores (commands/) compute their result and
print no outcome; the Python API (dflash_trainer) returns the same results. A renderer
per result type, found by the type's name so that rendering one verb's result does not
import every verb.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import console
from .errors import DflashError, ExitCode

if TYPE_CHECKING:
    from .commands.cache import CacheCopied
    from .commands.completion import Installed, Script
    from .commands.deploy import DeployDone
    from .commands.diff import RunsDiff
    from .commands.fetch_traceback import Fetched
    from .commands.gc import GcResult
    from .commands.hosts import HostsListing
    from .commands.init import Initialized
    from .commands.launch import DryRun, Launched
    from .commands.plot import Plotted
    from .commands.pull import PullResult
    from .commands.resume import Resumed
    from .commands.setup import SetupDone
    from .commands.status import ConfigResult, RunsListing, StatusResult
    from .commands.stop import StopResult
    from .commands.version import Version
    from .multihost import RunOnHosts


def render(result: Any, as_json: bool) -> None:
    _RENDERERS[type(result).__name__](result, as_json)


def exit_code(result: Any) -> ExitCode:
    """The exit code of a verb's result (`_EXIT_CODES`: a verb about several hosts, its
    worst host's error's; a run's, its state's); OK for a result not listed there."""
    code = _EXIT_CODES.get(type(result).__name__)
    return ExitCode.OK if code is None else code(result)


def refusal(result: Any) -> DflashError | None:
    """The error a result ends in once rendered (a dry run's problems), else None."""
    return getattr(result, "refusal", None)


def _worst_error(outcomes: tuple[tuple[str, Any], ...]) -> ExitCode:
    return max((outcome.exit_code for _, outcome in outcomes if isinstance(outcome, DflashError)),
               default=ExitCode.OK)


def _stop(result: StopResult, as_json: bool) -> None:
    from . import multihost

    for host, outcome in result.hosts:
        if isinstance(outcome, DflashError):
            console.warn(f"run {result.run_id} on {host}: not stopped: {outcome.message}")
        else:
            how = "killed after the grace period" if outcome.killed else "ended"
            console.say(f"run {result.run_id} on {host} {how}: {outcome.state}")
    state = multihost.state_name(result.state)
    if as_json:
        console.data(console.json_line({"run_id": result.run_id, "state": state,
                                        "hosts": [console.host_outcome(h, o) for h, o in result.hosts]}))
    else:
        console.data(f"{state}\n")


def _status(result: StatusResult, as_json: bool) -> None:
    """One run's state on stdout, its table and what to look at next on stderr; a run on
    several hosts: the state of the whole and a row per host."""
    from dflash_contract.states import RunState

    from . import provenance
    from .commands import status as verb
    from .multihost import RunOnHosts

    ref, status = result.ref, result.status
    if as_json:
        console.data(console.json_line(status.to_json()))
        return
    if isinstance(status, RunOnHosts):
        _status_on_hosts(status)
        return
    console.data(f"{status.state}\n")
    console.human.print(verb.runs_table(f"run {ref.run_id} on {ref.host}", [status]))
    if status.source:
        console.say(f"source: {provenance.summary(status.source)}")
    if line := verb.overrides_line(status):
        console.say(line)
    if status.reason:
        console.say(console.printable(f"reason: {status.reason}"))
    if status.state == RunState.STALLED:
        console.say(verb.stacks_hint(ref.run_id, ref.host))
    for line in verb.corrupt_lines(ref.host, status):
        console.warn(line)
    if status.export:
        console.say(verb.export_line(ref.run_id, ref.host, status.export))
    if status.state != RunState.SUCCEEDED:
        console.say(verb.resume_point(status))


def _status_on_hosts(status: RunOnHosts) -> None:
    from dflash_contract.states import RunState

    from . import multihost, provenance
    from .commands import status as verb

    shown = multihost.state_name(status.state)
    console.data(f"{shown}\n")
    console.human.print(verb.hosts_table(f"run {status.run_id} on {len(status.hosts)} hosts: {shown}",
                                         list(status.hosts)))
    for s in status.hosts:
        if s.error:
            console.warn(s.error)
        if s.silent:
            console.warn(f"{s.host} (rank {s.rank}) is {s.state}: {s.silent}")
        if s.status and s.status.reason:
            console.say(console.printable(f"{s.host}: reason: {s.status.reason}"))
        if s.state == RunState.STALLED:
            console.say(verb.stacks_hint(status.run_id, s.host))
        for line in verb.corrupt_lines(s.host, s.status) if s.status else ():
            console.warn(line)
    source = next((s.status.source for s in status.hosts if s.status and s.status.source), None)
    if source:
        console.say(f"source: {provenance.summary(source)}")
    first = status.hosts[0]
    if first.status and first.status.export:
        console.say(verb.export_line(status.run_id, first.host, first.status.export))


def _status_exit_code(result: StatusResult) -> ExitCode:
    """The run state's (errors.exit_code_for_state, docs/cli.md "CLI exit codes"); 2 when
    it is unknown only for want of the hosts the inventory lost."""
    from .errors import exit_code_for_state

    return ExitCode.USAGE if result.inventory_lost else exit_code_for_state(result.status.state)


def _config(result: ConfigResult, as_json: bool) -> None:
    """The config as YAML on stdout (--json: in the status object), the state and the
    overrides on stderr."""
    from .commands import status as verb

    status = result.status
    if as_json:
        console.data(console.json_line(status.to_json()))
        return
    console.data(status.config if status.config.endswith("\n") else status.config + "\n")
    console.say(f"run {result.ref.run_id} on {result.ref.host}: {status.state}")
    if line := verb.overrides_line(status):
        console.say(line)


def _runs(result: RunsListing, as_json: bool) -> None:
    """`host<TAB>run<TAB>state` per run on stdout (--json: an object per run), a table per
    host on stderr; a run that could not be read is named there."""
    from .commands import status as verb

    for listed in result.hosts:
        if as_json:
            for r in listed.runs:
                console.data(console.json_line({"host": listed.host, **r.to_json(),
                                                "changed": listed.changes.get(r.run_id)}))
        else:
            for r in listed.runs:
                console.data(f"{listed.host}\t{r.run_id}\t{r.state}\n")
            console.human.print(verb.runs_table(f"runs on {listed.host}", list(listed.runs), listed.changes))
        for bad in listed.unreadable:
            console.warn(console.printable(f"host {listed.host}: run {bad.run_id} not listed: {bad.path} cannot be "
                                           f"read ({bad.error})"))


def _pull(result: PullResult, as_json: bool) -> None:
    """Each local folder on stdout (--json: the PullResult as one object), a summary on
    stderr."""
    removed = f", {result.removed} removed (no longer on the host)" if result.removed else ""
    console.say(f"pulled {result.pulled} files, {result.bytes_received} bytes, {result.skipped} skipped"
                f"{removed}: {', '.join(str(folder) for folder in result.folders)}")
    if as_json:
        console.data(console.json_line(result))
    else:
        for folder in result.folders:
            console.data(f"{folder}\n")


def _resumed(result: Resumed, as_json: bool) -> None:
    """The attempt started said on stderr (--json: the Resumed as one object on stdout)."""
    if as_json:
        console.data(console.json_line(result))
    reply = result.started[0]
    which = _which_release(reply, result.current_release)
    for bad in result.corrupt:
        console.warn(console.printable(f"{result.hosts[0]}: the checkpoint at step {bad.step} is corrupt, "
                                       f"not resumed from: {bad.problem} ({bad.path})"))
    newest = " (the newest intact one)" if result.corrupt else ""
    if result.master_port is None:
        console.say(f"{result.hosts[0]}: run {result.run_id} ({reply.previous_state}) resumed as attempt "
                    f"{reply.attempt} from its checkpoint at step {reply.step}{newest} (pid {reply.pid}, {which})")
        return
    console.say(f"run {result.run_id} ({reply.previous_state}) resumed as attempt {reply.attempt} on "
                f"{len(result.hosts)} hosts from rank 0's checkpoint at step {result.step}{newest} "
                f"({which}; rendezvous port {result.master_port})")
    for rank, (host, started) in enumerate(zip(result.hosts, result.started)):
        console.say(f"{host}: rank {rank}, pid {started.pid}")


def _which_release(reply: Any, current_release: bool) -> str:
    release = reply.release_id
    if not current_release:
        which = "the run's own"
    elif release == reply.previous_release_id:
        which = "the host's current, the same as the run's"
    else:
        which = f"the host's current; the run had {reply.previous_release_id}"
    return f"release {release}: {which}"


def _launched(result: Launched, as_json: bool) -> None:
    """The run id on stdout (--json: the Launched as one object), each host's trainer on
    stderr."""
    for rank, (host, reply) in enumerate(zip(result.hosts, result.started)):
        rank_of = f" as rank {rank} of {len(result.hosts)}" if result.rendezvous else ""
        console.say(f"{host}: started run {result.run_id}{rank_of} (pid {reply.pid}, release {reply.release_id})")
    if result.rendezvous:
        console.say(f"rendezvous at {result.rendezvous} ({result.hosts[0]})")
    console.data(console.json_line(result) if as_json else result.run_id + "\n")


def _dry_run(result: DryRun, as_json: bool) -> None:
    """Every check's verdict and the estimate term by term on stderr (--json: one object
    on stdout, each host's verdicts, problems and estimate)."""
    from . import fit_check, host_check

    reports = list(result.reports)
    if as_json:
        console.data(console.json_line({
            "dry_run": True, "ok": not any(report.problems() for report in reports), "unchecked": result.unchecked,
            "hosts": [{"host": report.host, "verdicts": report.verdicts, "problems": report.problems(),
                       "fit": report.fit} for report in reports]}))
        return
    host_check.show(reports)
    if result.unchecked is not None:
        console.say(f"{result.config_path}: {result.unchecked}")
    fit_check.show([report.fit for report in reports if report.fit is not None])


def _fetched(result: Fetched, as_json: bool) -> None:
    """The text on stdout (or "written to" it on stderr), its diagnosis line after it on
    stderr; --json: the Traceback as one object on stdout (the text as the host wrote it,
    unescaped)."""
    from dflash_contract.states import RunState

    found = result.traceback
    if as_json:
        console.data(console.json_line(found))
        return
    if found.summary:
        console.say(console.printable(found.summary))
    if found.text is None:
        console.say(f"run {found.run_id} on {', '.join(found.hosts)}: no error recorded"
                    f"{' and no stack dump' if found.stacks or found.state == RunState.STOPPED else ''} "
                    f"(state {found.state})")
        return
    if result.written_to is not None:
        console.say(f"written to {result.written_to}")
    else:
        console.remote_text(found.text)
    if found.diagnosis is not None:
        console.say(console.printable(f"diagnosis: {found.diagnosis}"))


def _gc(result: GcResult, as_json: bool) -> None:
    """`host<TAB>release<TAB>bytes` per removed release on stdout (--json: one object per
    host, its error for one that failed), the space freed per host in a table on stderr."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="releases removed", title_justify="left")
    for column in ("host", "removed", "kept", "freed"):
        table.add_column(column)
    for name, outcome in result.hosts:
        if as_json:
            console.data(console.json_line(console.host_outcome(name, outcome)))
        if isinstance(outcome, DflashError):
            table.add_row(name, Text(f"failed: {outcome.message}", style="red"), "", "")
            continue
        for removed in outcome.removed:
            if not as_json:
                console.data(f"{name}\t{removed.release_id}\t{removed.bytes}\n")
        table.add_row(name, str(len(outcome.removed)), str(len(outcome.kept)),
                      f"{outcome.freed_bytes / (1 << 20):.1f} MiB")
    if not as_json:
        console.human.print(table)


def _version(result: Version, as_json: bool) -> None:
    """`dflash X.Y.Z` and `release <id>` on stdout."""
    console.data(f"dflash {result.dflash_version or '(version unknown: not installed)'}\n"
                 f"release {result.release_id}\n")


def _cache_copied(result: CacheCopied, as_json: bool) -> None:
    """A line on stderr per key skipped, with the reason; --json: one object per key and
    destination on stdout."""
    for done in result.keys:
        if not done.copied:
            console.say(f"compile artifacts for {done.key} not copied to {done.destination}: it {done.reason}")
        if as_json:
            console.data(console.json_line(done))


def _plotted(result: Plotted, as_json: bool) -> None:
    """The PNG's path on stdout (--json: one object, with the runs)."""
    if as_json:
        console.data(console.json_line({"path": result.path, "runs": [{"host": ref.host, "run_id": ref.run_id}
                                                                      for ref in result.refs]}))
    else:
        console.data(f"{result.path}\n")


def _runs_diff(result: RunsDiff, as_json: bool) -> None:
    """The unified diff on stdout, or with --stat `added<TAB>removed<TAB>path` per file
    and a table on stderr; --json: one object, the runs, their releases and each file's
    diff and counts."""
    from rich.table import Table

    from .release_store import summary

    refs, diffs = result.refs, result.diffs
    if as_json:
        runs = [{"host": ref.host, "run_id": ref.run_id, "release_id": release[1] if release else None}
                for ref, release in zip(refs, result.releases or (None, None))]
        console.data(console.json_line({
            "run_a": runs[0], "run_b": runs[1], "config": result.config, "summary": summary(list(diffs)),
            "files": [{"path": d.change.path, "added": d.added if d.compared else None,
                       "removed": d.removed if d.compared else None, "compared": d.compared, "diff": d.text}
                      for d in diffs]}))
    elif result.stat:
        table = Table(title=f"{refs[0].run_id} → {refs[1].run_id}: {summary(list(diffs))}", title_justify="left")
        for column in ("file", "+", "−"):
            table.add_column(column, justify="left" if column == "file" else "right")
        for d in diffs:
            added, removed = (str(d.added), str(d.removed)) if d.compared else ("-", "-")  # as git --numstat
            table.add_row(d.change.path, added, removed)
            console.data(f"{added}\t{removed}\t{d.change.path}\n")
        console.human.print(table)
    else:
        for d in diffs:
            console.data(d.text)
        if not diffs:
            console.say("no difference")


def _initialized(result: Initialized, as_json: bool) -> None:
    """The files' paths on stdout (--json: one object), the hosts taken in on stderr."""
    if as_json:
        console.data(console.json_line(result))
        return
    for path in result.files:
        console.data(f"{path}\n")
    console.say(f"hosts from {result.ssh_config}: " + (", ".join(result.hosts) or "none taken in")
                + (f"; commented out: {', '.join(result.commented)}" if result.commented else ""))


def _script(result: Script, as_json: bool) -> None:
    console.data(console.json_line(result) if as_json else result.script)


def _installed(result: Installed, as_json: bool) -> None:
    if as_json:
        console.data(console.json_line(result))
        return
    console.say(f"{result.shell}: the completion script is {result.script}"
                + (f"; {result.startup_file} reads it" if result.startup_file else "")
                + ("" if result.startup_file is None or result.line_added else " (it did already)")
                + "; it takes effect in a new shell")


def _hosts(result: HostsListing, as_json: bool) -> None:
    """One object per host on stdout with --json (the whole answer: no table); else the
    host names on stdout (without --check), the table, the groups and with -v each host's
    SSH options on stderr."""
    from .commands import hosts as verb

    if as_json:
        for entry in result.hosts:
            console.data(console.json_line(verb.to_json(entry)))
        return
    if not result.checked:
        for entry in result.hosts:
            console.data(f"{entry.host.name}\n")
    console.human.print(verb.hosts_table(result))
    for name, members in result.groups:
        console.say(f"group {name}: {', '.join(members)} (one run, rank 0 first)")
    for entry in result.hosts:
        if entry.ssh is not None:
            console.human.print(verb.options_table(entry.host.name, entry.ssh))


def _hosts_exit_code(result: HostsListing) -> ExitCode:
    """3 when a host is unreachable, 2 when one failed otherwise or is not ok."""
    from .errors import UnreachableError

    failures = [entry.found for entry in result.hosts if isinstance(entry.found, DflashError)]
    if any(isinstance(failure, UnreachableError) for failure in failures):
        return ExitCode.UNREACHABLE
    unfit = [entry for entry in result.hosts if entry.status not in (None, "ok")]
    return ExitCode.USAGE if failures or unfit else ExitCode.OK


def _setup_done(result: SetupDone, as_json: bool) -> None:
    """A table of results on stderr and `HOST<TAB>STATUS<TAB>ENV` lines on stdout (--json:
    one object per host, and no table); a failure's message whole, where the table's cell
    wraps it."""
    from .commands import setup as verb

    if not as_json:
        console.human.print(verb.results_table(result))
    for name, outcome in result.hosts:
        if as_json:
            console.data(console.json_line(console.host_outcome(name, outcome)))
        if isinstance(outcome, DflashError):
            console.say(f"error: {outcome.message}")
            if outcome.hint:
                console.say(f"{name}: hint: {outcome.hint}")
        elif not as_json:
            console.data(f"{name}\t{outcome.status}\t{outcome.env}\n")


def _deploy_done(result: DeployDone, as_json: bool) -> None:
    """A table of results on stderr and `HOST<TAB>RELEASE<TAB>RESULT` lines on stdout
    (--json: one object per host, and no table); a failure's hint, and after Ctrl-C each
    release that went live anyway, on stderr."""
    from .commands import deploy as verb
    from .deployment import DeployResult

    if not as_json:
        console.human.print(verb.results_table(result))
    for name, outcome in result.hosts:
        if isinstance(outcome, DflashError) and outcome.hint:
            console.say(f"{name}: hint: {outcome.hint}")
        if result.interrupted and isinstance(outcome, DeployResult):
            console.say(f"{name}: release {outcome.release_id} is live ({outcome.status} "
                        "before the interrupt took effect)")
    for name, outcome in result.hosts:
        if as_json:
            console.data(console.json_line(console.host_outcome(name, outcome)))
        elif isinstance(outcome, DeployResult):
            console.data(f"{name}\t{outcome.release_id}\t{outcome.status}\n")


_RENDERERS: dict[str, Callable[[Any, bool], None]] = {
    "StopResult": _stop,
    "StatusResult": _status,
    "ConfigResult": _config,
    "RunsListing": _runs,
    "PullResult": _pull,
    "Resumed": _resumed,
    "Launched": _launched,
    "DryRun": _dry_run,
    "Fetched": _fetched,
    "GcResult": _gc,
    "Version": _version,
    "CacheCopied": _cache_copied,
    "Plotted": _plotted,
    "RunsDiff": _runs_diff,
    "Initialized": _initialized,
    "Script": _script,
    "Installed": _installed,
    "HostsListing": _hosts,
    "SetupDone": _setup_done,
    "DeployDone": _deploy_done,
}

_EXIT_CODES: dict[str, Callable[[Any], ExitCode]] = {
    "StopResult": lambda result: _worst_error(result.hosts),
    "StatusResult": _status_exit_code,
    "GcResult": lambda result: _worst_error(result.hosts),
    "HostsListing": _hosts_exit_code,
    "SetupDone": lambda result: _worst_error(result.hosts),
    "DeployDone": lambda result: ExitCode.INTERRUPTED if result.interrupted else _worst_error(result.hosts),
    # a failed run that no record explains
    "Fetched": lambda result: ExitCode.OK if result.traceback.explained else ExitCode.RUN_FAILED,
    "RunsListing": lambda result: ExitCode.USAGE if any(listed.unreadable for listed in result.hosts) else ExitCode.OK,
}
