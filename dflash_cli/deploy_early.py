"""`dflash deploy HOST...` started before the CLI's own imports: the connection, the
host's interpreter and the receiver start while click, rich and the rest of the CLI
are imported (about 100 ms of start-up that the host's side now runs beside).

`start(argv)`, called by the `dflash` command first thing (entry.py, once probe_cache
started what it keeps for this command line), reads the command line with a parser of
the forms `deploy` takes (probe_cache.parse); for any other command line, or a word it
does not know, it starts nothing. For a deploy it does what `dflash deploy` does first
(deployment.start_probes: the hosts looked up, the tree listed, a release refused for
its size contacting no host, each host's probe started, or adopted from probe_cache), and
nothing at all where that fails: the click layer then fails the same way, with its own
message. Once the probes are on their way, each one's command line is kept for the next
deploy of this command line (probe_cache.record).

The click layer parses the command line again, as always, and takes over only what
matches it: `session` hands over the early session if the global options are the same,
`claim` the listing and probes if the deploy's options and hosts are. `abandon` ends
what was not taken: each probe's stdin ends without a release id, so its receiver exits
having looked at nothing, and the session closes.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import probe_cache

if TYPE_CHECKING:
    from .deployment import EarlyProbe
    from .release import Listing, SourceTree
    from .session import Session


@dataclasses.dataclass
class _Started:
    session: Session
    host_names: list[str]
    verify: bool
    source_dir: Path | None
    allow_large: bool
    source: SourceTree
    listing: Listing
    probes: dict[str, EarlyProbe]
    adopted: bool = False  # the click layer took the session (and closes it)


_started: _Started | None = None


def start(argv: Sequence[str]) -> bool:
    """For `dflash ... deploy ...`: each host's probe started, for `claim`; else nothing.
    Whether the command line is a deploy's."""
    global _started
    parsed = probe_cache.parse(argv)
    if parsed is None:
        return False
    from .deployment import probe_argv, start_probes
    from .errors import DflashError
    from .project_tree import in_state_root
    from .session import CLI_CONFIG_ENV, DEFAULT_LOGS, HOSTS_ENV, LOGS_ENV, Session

    options, names = parsed
    # the defaults as the click layer takes them: its options, else their environment variables
    session = Session(options.get("hosts_file") or os.environ.get(HOSTS_ENV) or None,
                      Path(options.get("logs_dir") or os.environ.get(LOGS_ENV) or in_state_root(DEFAULT_LOGS)),
                      bool(options.get("accept_new_host_key")),
                      options.get("cli_config_file") or os.environ.get(CLI_CONFIG_ENV) or None)
    source_dir = Path(options["source_dir"]) if "source_dir" in options else None
    verify, allow_large = bool(options.get("verify")), bool(options.get("allow_large"))
    try:
        if options.get("all_hosts"):
            names = sorted(session.inventory.hosts)
        if not names:
            return True
        hosts = [session.host(name) for name in names]
        source, listing, probes = start_probes(session, hosts, verify, source_dir, allow_large, probe_cache.take())
    except DflashError:
        session.close()
        return True  # the click layer meets the same failure, and says it
    _started = _Started(session, names, verify, source_dir, allow_large, source, listing, probes)
    probe_cache.record({host.name: _first_command_line(session, host, probe_argv(host, verify)) for host in hosts})
    return True


def _first_command_line(session: Session, host, argv: list[str]) -> tuple[list[str], list[str] | None] | None:
    """The command line `host`'s transport starts first for `argv`, for probe_cache to keep;
    None where it keeps none (another transport, options that cannot be resolved)."""
    from .errors import DflashError
    from .transports.openssh import OpenSshTransport

    transport = session.transport(host)
    if not isinstance(transport, OpenSshTransport):
        return None
    try:
        return transport.first_command_line(argv, probe_cache.FOLDER)
    except DflashError:
        return None


def session(hosts_file: str | None, logs_dir: Path, accept_new_host_key: bool,
            cli_config_file: str | None) -> Session:
    """The session for the click layer's global options: the one `start` made if made from
    the same options, else a new one (and what was started is abandoned)."""
    from .session import Session

    if _started is not None:
        early = _started.session
        if (early.hosts_file, early.logs_dir, early.accept_new_host_key, early.cli_config_file) == (
                hosts_file, logs_dir, accept_new_host_key, cli_config_file):
            _started.adopted = True
            return early
        abandon()
    return Session(hosts_file, logs_dir, accept_new_host_key, cli_config_file)


def claim(session: Session, host_names: list[str], verify: bool, source_dir: Path | None,
          allow_large: bool) -> tuple[SourceTree, Listing, dict[str, EarlyProbe]] | None:
    """What `start` started, if it is this deploy's (same session, hosts and options):
    the source, its listing and each host's probe; else None, and it is abandoned."""
    global _started
    started = _started
    if started is None:
        return None
    if (started.session is not session or started.host_names != host_names or started.verify != verify
            or started.source_dir != source_dir or started.allow_large != allow_large):
        abandon()
        return None
    _started = None
    return started.source, started.listing, started.probes


def abandon() -> None:
    """Ends what `start` started and nobody claimed: each receiver exits having looked at
    nothing; the session closes unless the click layer took it (it closes it then)."""
    global _started
    started, _started = _started, None
    if started is None:
        return
    for probe in started.probes.values():
        probe.abandon()
    if not started.adopted:
        started.session.close()
