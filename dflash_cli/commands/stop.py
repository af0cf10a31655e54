"""dflash stop: SIGTERM to the run's process group, a grace period, then SIGKILL."""
from __future__ import annotations

from dflash_agent.protocol import RunState, StopReply

from .. import console, multihost
from ..errors import DflashError, ExitCode
from ..local_state import RunRef
from ..session import Session


def run(session: Session, ref: RunRef, *, grace: float) -> ExitCode:
    """Returns once no process of the run is left (the agent waits for that). A run on
    several hosts is stopped on all at once; a host that could not be reached is named
    and gives the exit code, after the others were stopped."""
    hosts = [session.host(member.host) for member in ref.members]
    replies = session.on_each_host(hosts, lambda host: session.agent(host.name).call(
        StopReply, "--run-id", ref.run_id, "--grace", str(grace), timeout=grace + 60))
    states: dict[str, RunState | None] = {}
    for host in hosts:
        reply = replies[host.name]
        if isinstance(reply, DflashError):
            if not ref.multihost:
                raise reply
            console.warn(f"run {ref.run_id} on {host.name}: not stopped: {reply.message}")
            states[host.name] = None
            continue
        how = "killed after the grace period" if reply.killed else "ended"
        console.say(f"run {ref.run_id} on {host.name} {how}: {reply.state}")
        states[host.name] = reply.state
    console.data(f"{multihost.state_name(multihost.aggregate_state(states))}\n")
    return max((r.exit_code for r in replies.values() if isinstance(r, DflashError)), default=ExitCode.OK)
