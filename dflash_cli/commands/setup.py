"""dflash setup: on each host, a virtualenv under the workspace with what the trainer
needs (remote/requirements.txt), made the host's interpreter (docs/hosts.md "Host environments").

The work happens on the host (dflash_cli/host_scripts/host_setup.py, sent with `python -c`), in one
command: one round trip when nothing changed. pip's output comes back line by line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time
from typing import Iterator

from dflash_contract.checker import ProtocolError
from dflash_contract.replies import SetupAnswer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .. import console, host_scripts, requirements
from ..host_replies import check_interpreter, parse_reply
from ..errors import DflashError, ExitCode
from ..inventory import Host
from ..progress import cancel_on_ctrl_c
from ..session import Session
from ..transports.base import Completed
from ..transports.common import CommandFailed

#: --index-url's value for "the indexes pip on the host is configured with"
PIP_CONFIGURED = "pip"
# How pip names the requirement it could not install, most specific first.
_PIP_FAILURES = (
    re.compile(r"No matching distribution found for (\S+)"),
    re.compile(r"Could not find a version that satisfies the requirement (\S+)"),
    re.compile(r"Failed (?:building wheel for|to build) (\S+)"),
    re.compile(r"Cannot install (.+?) because"),
)


@dataclasses.dataclass(frozen=True)
class SetupResult:
    host: str
    status: str  # unchanged | switched | installed
    env: str  # the environment's folder on the host
    torch_index: str
    round_trips: int
    seconds: float


def failed_package(pip_lines: list[str]) -> str | None:
    """The requirement pip's output says it could not install, or None."""
    for pattern in _PIP_FAILURES:
        for line in reversed(pip_lines):
            if found := pattern.search(line):
                return found.group(1)
    return None


class SetupInterrupted(DflashError):
    """Ctrl-C: the host's setup is ended; its environment in use stays as it was."""

    def __init__(self, host: str):
        super().__init__(f"host {host}: setup interrupted; the environment in use stays as it was",
                         ExitCode.INTERRUPTED)


def setup_host(session: Session, host: Host, request: dict, bars: Progress | None,
               cancel: threading.Event | None = None) -> SetupResult:
    """Run host_setup.py on `host`, streaming pip's lines to the user; `cancel` (set by
    Ctrl-C) ends it at the next line, which ends the command on the host."""
    started = time.monotonic()
    transport = session.transport(host)
    trips_before = transport.round_trips
    argv = [host.python, "-c", host_scripts.source("host_setup.py"), host.workspace, json.dumps(request)]
    lines: list[str] = []
    result = None
    task = bars.add_task(f"setup {host.name}", total=None) if bars is not None else None
    lines_in = transport.stream(argv)
    try:
        for raw in lines_in:
            if cancel is not None and cancel.is_set():
                raise SetupInterrupted(host.name)
            message = parse_reply(raw)
            if message is None or "pip" not in message:
                result = message
                continue
            lines.append(message["pip"])
            console.say(console.printable(f"{host.name}: {message['pip']}"))
            if task is not None:
                bars.update(task, description=console.printable(f"setup {host.name}: {message['pip'][:70]}"))
    except CommandFailed as exc:
        check_interpreter(host, Completed(exc.argv, exc.status, b"", exc.stderr))
        raise DflashError(f"host {host.name}: setup failed: {exc.message}", exc.exit_code) from None
    finally:
        lines_in.close()  # ends the command on the host if it still runs
        if task is not None:
            bars.remove_task(task)
    if result is None or "status" not in result:
        raise DflashError(f"host {host.name}: setup gave no answer", ExitCode.UNREACHABLE)
    try:
        answer = SetupAnswer.from_json(result)
    except ProtocolError as exc:
        raise DflashError(f"host {host.name}: cannot read its answer: {exc}", ExitCode.UNREACHABLE) from exc
    if answer.status == SetupAnswer.FAILED:
        raise _failure(host, answer, lines)
    return SetupResult(host.name, answer.status, answer.env, answer.torch_index,
                       transport.round_trips - trips_before, time.monotonic() - started)


def _failure(host: Host, answer: SetupAnswer, pip_lines: list[str]) -> DflashError:
    kept = (f"the environment in use stays {answer.env}" if answer.env
            else "the host has no environment yet")
    package = failed_package(pip_lines) if answer.step in ("torch", "requirements") else None
    error = (answer.error or "").strip()
    if package:
        what = f"pip could not install {package}"
    else:
        what = f"{answer.step}: {error.splitlines()[-1] if error else ''}"
    return DflashError(f"host {host.name}: setup failed: {what}; {kept}", ExitCode.USAGE)


@contextlib.contextmanager
def setup_bars() -> Iterator[Progress | None]:
    """One live display with a spinner per host (hosts set up in parallel); None off a
    terminal, where pip's lines alone show the progress."""
    if not console.human.is_terminal:
        yield None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console.human, transient=True) as bars:
        yield bars


@dataclasses.dataclass(frozen=True)
class SetupDone:
    """`setup`: each host's outcome, in the order named: its SetupResult, or its error."""
    hosts: tuple[tuple[str, SetupResult | DflashError], ...]


def setup(session: Session, host_names: list[str], *, all_hosts: bool = False, torch: str | None = None,
          index_url: str | None = None) -> SetupDone:
    """Set up each host in parallel, pip's output streaming to stderr."""
    if all_hosts:
        host_names = sorted(session.inventory.hosts)
    if not host_names:
        raise DflashError("name at least one host, or use --all", ExitCode.USAGE)
    hosts = [session.host(name) for name in host_names]  # unknown names fail before any work
    needs = requirements.load()
    request = {"requirements": needs.text, "torch": needs.torch_pin(torch) if torch else None,
               "index_url": index_url}
    with setup_bars() as bars, cancel_on_ctrl_c("the setups") as cancel:
        results = session.on_each_host(hosts, lambda host: setup_host(session, host, request, bars, cancel))
    for host in hosts:
        outcome = results[host.name]
        if isinstance(outcome, SetupResult) and host.python_named:
            console.warn(f"{host.name}: the inventory names python {host.python}, which stays the "
                         f"trainer's interpreter; remove `python:` from {host.name} to use {outcome.env}")
    return SetupDone(tuple((name, results[name]) for name in host_names))


def results_table(done: SetupDone) -> Table:
    table = Table(title="trainer environments", title_justify="left")
    for column in ("host", "result", "environment", "torch from", "round trips", "seconds"):
        table.add_column(column, justify="right" if column in ("round trips", "seconds") else "left")
    for name, r in done.hosts:
        if isinstance(r, DflashError):
            table.add_row(name, Text(f"failed: {r.message}", style="red"), "", "", "", "")
        else:
            table.add_row(name, r.status, r.env, r.torch_index, str(r.round_trips), f"{r.seconds:.2f}")
    return table
