"""A run's parts started on several hosts as one (`launch`, `resume`): every host's
refusal named in one error, and a start that fails on one host stops the parts already
started on the others, so no half-started run is left."""
from __future__ import annotations


from dflash_contract import requests

from .errors import DflashError
from .inventory import Host
from .session import Session


# Seconds between SIGTERM and SIGKILL for the parts of a run stopped because another
# host could not start its own.
ROLLBACK_GRACE_S = 5.0


def start_together(session: Session, hosts: list[Host], run_id: str, start) -> dict:
    """`start(host)` on every host at once; their replies by host name. When any failed,
    the parts started elsewhere are stopped (no half-started run is left) and the error
    names every host's failure."""
    started = session.on_each_host(hosts, start)
    running = [host for host in hosts if not isinstance(started[host.name], DflashError)]
    if len(running) < len(hosts):
        stopped = session.on_each_host(running, lambda host: session.agent(host.name).call(
            requests.Stop(run_id, ROLLBACK_GRACE_S), timeout=ROLLBACK_GRACE_S + 60))
        left = [f"{host}: {outcome.message}" for host, outcome in stopped.items() if isinstance(outcome, DflashError)]
        what = (f"the run was stopped on {', '.join(host.name for host in running)}" if running else
                "it was started nowhere")
        refuse(hosts, started, what + (f"; stopping it failed on {'; '.join(left)}" if left else ""))
    return started


def refuse(hosts: list[Host], outcomes: dict, consequence: str) -> None:
    """Raise one DflashError naming every host whose outcome is an error, if any."""
    errors = [outcomes[host.name] for host in hosts if isinstance(outcomes[host.name], DflashError)]
    if errors:
        raise DflashError("; ".join(error.message for error in errors) + f" ({consequence})",
                          max(error.exit_code for error in errors),
                          hint=next((error.hint for error in errors if error.hint), None))
