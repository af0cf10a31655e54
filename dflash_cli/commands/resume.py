"""dflash resume: the next attempt of a run that ended, from its newest complete checkpoint."""
from __future__ import annotations

from dflash_agent.gpus import TRAINER_PACKAGES

from .. import console
from ..errors import ExitCode
from ..local_state import RunRef, set_latest
from ..session import Session


def run(session: Session, ref: RunRef, current_release: bool, step: int | None) -> ExitCode:
    """Start the attempt; the host refuses (exit 2, with the reason) a live run, one
    without a complete checkpoint, and a checkpoint that does not fit the config."""
    host = session.host(ref.host)
    args = [f"--run-id={ref.run_id}", f"--release={'current' if current_release else 'run'}"]
    if step is not None:
        args.append(f"--step={step}")
    # The host's settings travel again: run.json keeps their keys only (values may be secrets).
    args += [f"--env={key}={value}" for key, value in host.env.items()]
    args += [f"--require-module={package}" for package in TRAINER_PACKAGES]
    reply = session.agent(host.name).call("resume", *args)
    set_latest(session.logs_dir, ref)
    release = reply["release_id"]
    if not current_release:
        which = "the run's own"
    elif release == reply.get("previous_release_id"):
        which = "the host's current, the same as the run's"
    else:
        which = f"the host's current; the run had {reply.get('previous_release_id')}"
    console.say(f"{host.name}: run {ref.run_id} ({reply['previous_state']}) resumed as attempt {reply['attempt']} "
                f"from its checkpoint at step {reply['step']} (pid {reply['pid']}, release {release}: {which})")
    return ExitCode.OK
