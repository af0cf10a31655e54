"""Compile artifacts between hosts: what each host's compile cache offers (the agent's
`compile-artifacts`), which hosts can use which (same GPU model; for CPU code, the same CPU
model), and copying one key's artifacts from a host to another, sha256-checked on both
ends. `dflash cache copy` and a multi-host `dflash launch` use it (docs/layout.md,
cache/compile/<key>/)."""
from __future__ import annotations

import dataclasses
import hashlib


from dflash_contract import requests
from dflash_contract.replies import CompileArtifact

from . import console
from .errors import DflashError, ExitCode
from .session import Session


@dataclasses.dataclass(frozen=True)
class HostCache:
    """What one host offers (its agent's listing, by key), and what code it can run."""
    host: str
    gpus: tuple[str, ...]
    cpu: str | None
    offers: dict[str, CompileArtifact]

    def can_use(self, offer: CompileArtifact, source: "HostCache") -> bool:
        """Code compiled for `offer`'s GPU model runs here: a GPU of that name, or for
        CPU code the sending host's CPU model (Inductor's C++ targets its instruction set)."""
        gpu = gpu_of(offer)
        if gpu == "cpu":
            return self.cpu is not None and self.cpu == source.cpu
        return gpu in self.gpus


def gpu_of(offer: CompileArtifact) -> str | None:
    """The GPU model the artifacts were compiled for ("cpu" for CPU code)."""
    return (offer.facts or {}).get("gpu")


def host_cache(session: Session, host_name: str) -> HostCache:
    reply = session.agent(host_name).call(requests.CompileArtifacts())
    return HostCache(host_name, reply.gpus, reply.cpu, {offer.key: offer for offer in reply.artifacts})


def copy_offer(session: Session, source: HostCache, destination: str, offer: CompileArtifact) -> None:
    """`offer`'s bytes from `source` to `destination`, checked here against the listing's
    sha256 before they are sent on (the receiving agent checks them again)."""
    size, sha256 = offer.size, offer.sha256
    data = b"".join(session.agent(source.host).chunks(requests.SendCompileArtifacts(offer.key, sha256)))
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise DflashError(f"compile artifacts for {offer.key} from {source.host}: got {len(data)} bytes of sha256 "
                          f"{hashlib.sha256(data).hexdigest()[:16]}, listed as {size} of {str(sha256)[:16]}",
                          ExitCode.UNREACHABLE)
    session.agent(destination).call(requests.ReceiveCompileArtifacts(offer.key, offer.manifest()), stdin=data)
    console.say(f"compile artifacts for {offer.key} copied {source.host} → {destination} "
                f"({size / 1e6:.1f} MB)")


def missing(source: HostCache, destination: HostCache) -> list[CompileArtifact]:
    """The offers of `source` whose key `destination` has no artifacts of and can use (a
    host's own artifacts of a key serve it as well as another's: never replaced)."""
    return [offer for key, offer in source.offers.items()
            if key not in destination.offers and destination.can_use(offer, source)]


def seed_hosts(session: Session, host_names: list[str]) -> None:
    """Before a run on several hosts starts: every host that lacks the artifacts of a key
    another host of the run has, and can use them, gets them. Seeding only saves compile
    time, so every failure is a warning, never a refusal."""
    listed = session.on_each_host([session.host(name) for name in host_names],
                                  lambda host: host_cache(session, host.name))
    caches = {}
    for name, outcome in listed.items():
        if isinstance(outcome, DflashError):
            console.warn(f"{name}: compile artifacts not listed ({outcome.message}); it compiles on its own")
        else:
            caches[name] = outcome
    wanted: dict[str, list[tuple[HostCache, CompileArtifact]]] = {}
    for name, destination in caches.items():
        sent: set[str] = set()
        for source in caches.values():
            for offer in missing(source, destination) if source is not destination else []:
                if offer.key not in sent:
                    sent.add(offer.key)
                    wanted.setdefault(name, []).append((source, offer))

    def receive(host) -> None:
        for source, offer in wanted[host.name]:
            try:
                copy_offer(session, source, host.name, offer)
            except DflashError as exc:
                console.warn(f"compile artifacts for {offer.key} not copied {source.host} → {host.name}: "
                             f"{exc.message}; {host.name} compiles on its own")

    session.on_each_host([session.host(name) for name in wanted], receive)
