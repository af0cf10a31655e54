"""dflash stop: SIGTERM to the run's process group, a grace period, then SIGKILL."""
from __future__ import annotations

from .. import console
from ..errors import ExitCode
from ..local_state import RunRef
from ..session import Session


def run(session: Session, ref: RunRef, grace: float) -> ExitCode:
    """Returns once no process of the run is left (the agent waits for that)."""
    reply = session.agent(ref.host).call(
        "stop", "--run-id", ref.run_id, "--grace", str(grace), timeout=grace + 60)
    how = "killed after the grace period" if reply.get("killed") else "ended"
    console.say(f"run {ref.run_id} on {ref.host} {how}: {reply.get('state')}")
    console.data(f"{reply.get('state')}\n")
    return ExitCode.OK
