"""dflash stop: SIGTERM to the run's process group, a grace period, then SIGKILL."""
from __future__ import annotations


from dflash_contract import requests
from dflash_contract.states import RunState

from .. import console, multihost, run_hosts
from ..errors import DflashError, ExitCode
from ..local_state import RunRef
from ..session import Session


def run(session: Session, ref: RunRef, *, grace: float, as_json: bool = False) -> ExitCode:
    """Returns once no process of the run is left (the agent waits for that). A run on
    several hosts is stopped on all at once; a host that could not be reached, or that
    left the inventory, is named and gives the exit code, after the others were stopped.
    The run's state on stdout (with `as_json`: one JSON object, with each host's)."""
    hosts, left = run_hosts.members(session, ref)
    replies = {**session.on_each_host(hosts, lambda host: session.agent(host.name).call(
        requests.Stop(ref.run_id, grace), timeout=grace + 60)), **left}
    states: dict[str, RunState | None] = {}
    for member in ref.members:
        reply = replies[member.host]
        if isinstance(reply, DflashError):
            if not ref.multihost:
                raise reply
            states[member.host] = None
            console.warn(f"run {ref.run_id} on {member.host}: not stopped: {reply.message}")
            continue
        how = "killed after the grace period" if reply.killed else "ended"
        console.say(f"run {ref.run_id} on {member.host} {how}: {reply.state}")
        states[member.host] = reply.state
    state = multihost.state_name(multihost.aggregate_state(states))
    if as_json:
        console.data(console.json_line({"run_id": ref.run_id, "state": state,
                                        "hosts": [console.host_outcome(m.host, replies[m.host]) for m in ref.members]}))
    else:
        console.data(f"{state}\n")
    return max((r.exit_code for r in replies.values() if isinstance(r, DflashError)), default=ExitCode.OK)
