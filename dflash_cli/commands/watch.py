"""dflash watch: a run followed live (dflash_cli/watching.py), printed as it comes.

Log lines and tracebacks go to stdout with their control characters escaped (unless
--json, which prints every message of the stream as it is, one JSON line each); the
rest goes to stderr. On a terminal a status line (step, loss, acceptance length, ETA,
GPUs) stays below the scrolling log. A run on several hosts has each line start with
its host's name. The trackers of dflash.yaml are fed by the follow itself
(dflash_cli/trackers), unless --no-trackers.
"""
from __future__ import annotations

import json
import sys

from rich.live import Live
from rich.text import Text


from dflash_contract.records import ErrorRecord
from dflash_contract.replies import Gpu

from .. import console, multihost
from . import WatchOptions
from ..errors import ExitCode
from ..local_state import RunRef
from ..session import Session
from ..status_line import RunProgress
from ..tracebacks import render_no_record, render_record
from ..trackers.config import TrackerSettings
from ..trackers.hub import checked_settings
from ..watching import (FROM_STREAM, Ended, ErrorRecorded, Events, Following, Gpus, HostEnded, Log, Rotated,
                        StateChange, Unfollowed, WatchItem, follow)


def gpu_line(gpus: tuple[Gpu, ...]) -> str:
    """One compact line: index, memory used/total, utilisation, temperature, power."""
    def num(value, fmt):
        return "?" if value is None else format(value, fmt)
    parts = []
    for g in gpus:
        used, total = g.memory_used_mib, g.memory_total_mib
        memory = f"{num(used and used / 1024, '.1f')}/{num(total and total / 1024, '.0f')}GiB"
        parts.append(f"gpu{g.index} {memory} {num(g.utilization_pct, '.0f')}% "
                     f"{num(g.temperature_c, '.0f')}C {num(g.power_w, '.0f')}W")
    return "  ".join(parts)


class Printer:
    """What people (or --json) see of a watch's items."""

    def __init__(self, ref: RunRef, as_json: bool):
        self.ref = ref
        self.as_json = as_json
        self.progress = RunProgress(gpu_line)
        self.live: Live | None = None  # the status line, on a terminal
        self.line_open: dict[str, bool] = {}  # per host: the log text printed last did not end its line

    def label(self, host: str) -> str:
        return f"{host}| " if self.ref.multihost else ""

    def show(self, item: WatchItem) -> None:
        if self.as_json and isinstance(item, FROM_STREAM):
            self.show_json(item)
        if isinstance(item, Following):
            self.on_following(item)
        elif isinstance(item, Log) and not self.as_json:
            self.show_remote(self._labelled(item.host, item.text))
            self.line_open[item.host] = not item.text.endswith("\n")
        elif isinstance(item, Rotated) and not self.as_json:
            self.on_rotated(item)
        elif isinstance(item, ErrorRecorded):
            self.on_error(item)
        elif isinstance(item, Events):
            self.progress.update(list(item.events))
        elif isinstance(item, Gpus) and self.live is not None:
            self.progress.gpus = item.gpus
        elif isinstance(item, Gpus) and not self.as_json and item.gpus:
            console.human.print(self.label(item.host) + gpu_line(item.gpus), style="dim", markup=False,
                                highlight=False)
        elif isinstance(item, StateChange) and not self.as_json:
            console.say(f"{self.label(item.host)}[{self.ref.run_id}] state {item.state}")
        elif isinstance(item, HostEnded):
            self.on_host_ended(item)
        elif isinstance(item, Unfollowed):
            console.warn(f"{item.error.message}: its part is not followed" if item.left_inventory
                         else f"{self.label(item.host)}{item.error.message}")
        elif isinstance(item, Ended):
            self.on_ended(item)

    def show_json(self, item: WatchItem) -> None:
        shown = item.message.to_json()
        if self.ref.multihost:
            shown["host"] = item.host
        if isinstance(item, ErrorRecorded) and item.message.record is not None:  # a known failure's line, else null
            shown["diagnosis"] = item.diagnosis
        console.data(json.dumps(shown) + "\n")

    def on_following(self, item: Following) -> None:
        self.progress.update(list(item.recent_events))  # a resumed watch shows where the run was
        if not item.keeps_local_state:
            console.say(f"another watch of {item.run_id} keeps {item.local_dir}: this one shows "
                        "the log from its start (or --tail) and saves nothing")
        elif item.resumed_at is not None:
            console.say(f"{self.label(item.host)}resuming {item.run_id} at byte {item.resumed_at} "
                        "(--tail N shows earlier lines)")

    def _labelled(self, host: str, text: str) -> str:
        """`text` with the host's name at the start of each of its lines (a line the
        last text left open goes on without one)."""
        label = self.label(host)
        if not label or not text:
            return text
        lines = text.split("\n")
        body = ("\n" + label).join(lines[:-1] + ([lines[-1]] if lines[-1] else []))
        return ("" if self.line_open.get(host) else label) + body + ("\n" if not lines[-1] else "")

    def on_rotated(self, item: Rotated) -> None:
        message = item.message
        if self.line_open.get(item.host):  # end the old content's last line: the new one must not continue it
            self.show_remote("\n")
            self.line_open[item.host] = False
        missing = ("" if message.complete else
                   f"; lines written to the old file after byte {message.previous_end} could not be read")
        saved = f", saved as {item.saved_as}" if item.saved_as is not None else ""
        console.say(f"{self.label(item.host)}[{self.ref.run_id}] train.log was {message.reason} on {item.host}"
                    f"{missing}: the new content follows from its start{saved}")

    def on_error(self, item: ErrorRecorded) -> None:
        label, record = self.label(item.host), item.record
        if not self.as_json and record.exc_type == ErrorRecord.PEER_FAILED:
            console.say(console.printable(f"{label}thread {record.thread}: "
                                          + multihost.peer_failed_line(record, self.ref.hosts)))
        elif not self.as_json:
            on = f" on {item.host}" if label else ""
            console.human.rule(f"thread {record.thread} failed{on}", style="red")
            self.show_remote(render_record(record, RunRef(item.host, self.ref.run_id)))
        if item.traceback_saved is not None:
            console.say(f"{label}traceback saved to {item.traceback_saved}")

    def on_host_ended(self, item: HostEnded) -> None:
        if self.ref.host == item.host:
            self.stop_status_line()
        if item.unexplained is not None and not self.as_json:
            console.remote_text(render_no_record(item.unexplained, RunRef(item.host, item.run_id)))
        console.say(f"run {item.run_id} on {item.host} ended: {item.state}")

    def on_ended(self, item: Ended) -> None:
        if not self.ref.multihost:  # one host's part: its root cause's line ends the output
            if item.diagnosis is not None and not self.as_json:
                console.say(console.printable(f"diagnosis: {item.diagnosis}"))
            return
        if item.root_cause is not None and not self.as_json:
            host, record = item.root_cause
            if item.blamed is not None:  # no rank recorded its own failure: the one that died or went silent
                line = (f"root cause on {item.blamed} (rank {item.hosts.index(item.blamed)}): "
                        + multihost.blamed_line(item.hosts, item.exits.get(item.blamed), item.root_cause,
                                                item.records.get(item.blamed, ())))
            else:
                line = (f"root cause on {host} (rank {item.hosts.index(host)}): thread {record.thread} "
                        f"{record.exc_type}: {record.message or ''}".rstrip())
            console.say(console.printable(line))
        console.say(f"run {item.run_id} ended: {multihost.state_name(item.state)} "
                    f"({', '.join(f'{host} {multihost.state_name(s)}' for host, s in item.states.items())})")
        if item.diagnosis is not None and not self.as_json:
            console.say(console.printable(f"diagnosis: {item.diagnosis}"))

    def show_remote(self, text: str) -> None:
        """Text from the host for people: above the status line when there is one."""
        if self.live is None:
            console.remote_text(text)
        else:
            console.human.print(Text(console.printable(text)), end="", soft_wrap=True)

    def start_status_line(self) -> None:
        self.live = Live(get_renderable=self.progress.render, console=console.human, refresh_per_second=2,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def stop_status_line(self) -> None:
        if self.live is not None:
            self.live.stop()  # the last status stays on screen, above what follows
            self.live = None


def run(session: Session, ref: RunRef, options: WatchOptions, *, as_json: bool) -> ExitCode:
    """Print the run's items until it ends; its outcome as the exit code (docs/cli.md "CLI
    exit codes"). Ctrl-C detaches: the run keeps going. The trackers of dflash.yaml
    (unless `options.trackers` is False) have their packages checked first."""
    trackers = TrackerSettings()
    if options.trackers:
        local = session.local_config
        trackers = checked_settings(local.trackers, local.source)
    printer = Printer(ref, as_json)
    if not ref.multihost and not as_json and console.human.is_terminal and sys.stdout.isatty():
        printer.start_status_line()
    items = follow(session, ref, tail=options.tail, interval=options.gpu_interval, retry_for=options.retry_for,
                   trackers=trackers)
    try:
        for item in items:
            printer.show(item)
        return item.exit_code  # the last item is the run's Ended
    except KeyboardInterrupt:
        printer.stop_status_line()
        where = f" on {', '.join(ref.hosts)}" if ref.multihost else ""
        console.say(f"\ndetached from {ref.run_id}; it keeps running{where} (dflash watch resumes)")
        return ExitCode.INTERRUPTED
    finally:
        printer.stop_status_line()
        items.close()
