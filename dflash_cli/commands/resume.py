"""dflash resume: the next attempt of a run that ended, from its newest intact checkpoint
(on several hosts: every host's part, from rank 0's checkpoint, docs/runs.md "Attempts")."""
from __future__ import annotations

import dataclasses

from dflash_contract import requests
from dflash_contract.names import TRAINER_PACKAGES
from dflash_contract.replies import CorruptCheckpoint, ResumeCheckReply, ResumeReply

from ..errors import DflashError, ExitCode, at_least
from ..inventory import Host
from ..local_state import RunRef, set_latest
from ..run_start import refuse, start_together
from ..session import Session


@dataclasses.dataclass(frozen=True)
class ResumeOptions:
    """What a resume was asked for, checked as it is made."""
    current_release: bool = False  # the host's current release instead of the run's
    step: int | None = None  # the checkpoint's step; None: the newest intact one

    def __post_init__(self) -> None:
        at_least("step", self.step, 1)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The next attempt of a run started: its hosts in rank order, each host's resume
    reply (the attempt, the checkpoint's step, the trainer's pid, the release it runs)
    and, on several hosts, the rendezvous port on rank 0's host."""
    run_id: str
    hosts: tuple[str, ...]
    started: tuple[ResumeReply, ...]
    current_release: bool  # the host's current release was asked for instead of the run's
    master_port: int | None = None
    # rank 0's checkpoints newer than the one resumed from, found corrupt (newest first)
    corrupt: tuple[CorruptCheckpoint, ...] = ()

    @property
    def attempt(self) -> int:
        return self.started[0].attempt

    @property
    def step(self) -> int:
        """The checkpoint step every host resumed from."""
        return self.started[0].step


def start(session: Session, ref: RunRef, options: ResumeOptions = ResumeOptions()) -> Resumed:
    """Start the attempt; the host refuses (exit 2, with the reason) a live run, one
    without an intact checkpoint (or a corrupt one at `step`), and a checkpoint that does
    not fit the config."""
    current_release, step = options.current_release, options.step
    if ref.multihost:
        return _resume_on_hosts(session, ref, current_release, step)
    host = session.host(ref.host)
    reply = session.agent(host.name).call(_request(host, ref, current_release, step))
    set_latest(session.logs_dir, ref)
    return Resumed(ref.run_id, (ref.host,), (reply,), current_release, corrupt=reply.corrupt or ())


def _request(host: Host, ref: RunRef, current_release: bool, step: int | None,
             layout: requests.Layout | None = None, check_only: bool = False) -> requests.Resume:
    # The host's settings travel again: run.json keeps their keys only (values may be secrets).
    return requests.Resume(ref.run_id, "current" if current_release else "run", step, tuple(host.env.items()),
                           TRAINER_PACKAGES, layout, check_only)


def _resume_on_hosts(session: Session, ref: RunRef, current_release: bool, step: int | None) -> Resumed:
    """Every host's part as the same next attempt, from one step: rank 0's checkpoint
    (rank > 0 takes it from rank 0 when the trainers meet), at a rendezvous port picked
    free on rank 0's host. Every host checks before any starts (one refusal starts
    nothing); a start that fails after that stops the parts already started."""
    hosts = [session.host(name) for name in ref.hosts]

    def resume_on(host: Host, at_step: int | None, port: int, check_only: bool = False):
        layout = requests.Layout(ref.hosts.index(host.name), len(hosts), None, port, ref.hosts)
        return session.agent(host.name).call(_request(host, ref, current_release, at_step, layout, check_only))

    def check_on(host: Host, at_step: int | None) -> ResumeCheckReply:
        return resume_on(host, at_step, 0, check_only=True)

    first = hosts[0]
    # Rank 0 first: its checkpoint is the step every host resumes from.
    checks = session.on_each_host(hosts[:1], lambda host: check_on(host, step))
    refuse(hosts[:1], checks, "nothing was started on any host")
    chosen = checks[first.name].step
    checks.update(session.on_each_host(hosts[1:], lambda host: check_on(host, chosen)))
    refuse(hosts, checks, "nothing was started on any host")
    numbers = {checks[host.name].attempt for host in hosts}
    if len(numbers) > 1:
        raise DflashError(f"run {ref.run_id}: the hosts' attempts disagree ("
                          + ", ".join(f"{host.name} would start attempt {checks[host.name].attempt}" for host in hosts)
                          + "): a host's part was resumed or restarted alone; nothing was started on any host",
                          ExitCode.USAGE)
    port = checks[first.name].master_port
    started = start_together(session, hosts, ref.run_id, lambda host: resume_on(host, chosen, port))
    set_latest(session.logs_dir, ref)
    return Resumed(ref.run_id, ref.hosts, tuple(started[name] for name in ref.hosts), current_release, port,
                   corrupt=checks[first.name].corrupt or ())
