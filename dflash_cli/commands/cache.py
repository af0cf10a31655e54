"""dflash cache copy: a host's compile artifacts to other hosts, so they start warm."""
from __future__ import annotations

import dataclasses

from ..compile_artifacts import copy_offer, gpu_of, host_cache, missing
from ..errors import DflashError, ExitCode
from ..session import Session


@dataclasses.dataclass(frozen=True)
class KeyCopy:
    """One compile cache key's outcome at one destination: copied, or skipped and why."""
    key: str
    source: str
    destination: str
    copied: bool
    reason: str | None = None  # why it was skipped


@dataclasses.dataclass(frozen=True)
class CacheCopied:
    """`cache copy`: every key's outcome at every destination, in the order they were done."""
    keys: tuple[KeyCopy, ...]


def copy(session: Session, source_name: str, destination_names: list[str]) -> CacheCopied:
    """Copy SOURCE's compile artifacts (every key of its workspace's compile cache) to each
    DESTINATION that has none of that key and has its GPU model (for CPU code: the same CPU
    model); the bytes are checked against their sha256 on the way and on arrival. A key a
    destination cannot use, or has already, is skipped with the reason. Exit 3 when a host cannot be
    reached, 2 when SOURCE offers nothing."""
    if not destination_names:
        raise DflashError("name at least one host to copy to", ExitCode.USAGE)
    if source_name in destination_names:
        raise DflashError(f"{source_name} is both the source and a destination", ExitCode.USAGE)
    hosts = [session.host(name) for name in (source_name, *destination_names)]
    listed = session.on_each_host(hosts, lambda host: host_cache(session, host.name))
    failures = [outcome for outcome in listed.values() if isinstance(outcome, DflashError)]
    if failures:
        raise failures[0]
    source = listed[source_name]
    if not source.offers:
        raise DflashError(f"{source_name} has no compile artifacts (a run saves them after its first compile)",
                          ExitCode.USAGE)
    done = []
    for name in destination_names:
        destination = listed[name]
        wanted = missing(source, destination)
        for key, offer in source.offers.items():
            if offer not in wanted:
                reason = ("has them already" if key in destination.offers else
                          f"has no {gpu_of(offer)}" if gpu_of(offer) != "cpu" else
                          "has another CPU model")
                done.append(KeyCopy(key, source_name, name, False, reason))
        for offer in wanted:
            copy_offer(session, source, name, offer)
            done.append(KeyCopy(offer.key, source_name, name, True))
    return CacheCopied(tuple(done))
