"""dflash cache copy: a host's compile artifacts to other hosts, so they start warm."""
from __future__ import annotations

from .. import console
from ..compile_artifacts import copy_offer, gpu_of, host_cache, missing
from ..errors import DflashError, ExitCode
from ..session import Session


def run(session: Session, *, source_name: str, destination_names: list[str], as_json: bool = False) -> ExitCode:
    """Copy SOURCE's compile artifacts (every key of its workspace's compile cache) to each
    DESTINATION that has none of that key and has its GPU model (for CPU code: the same CPU
    model); the bytes are checked against their sha256 on the way and on arrival. A key a
    destination cannot use, or has already, is said and skipped (with `as_json`, one JSON
    object per key and destination on stdout says which). Exit 3 when a host cannot be
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
    for name in destination_names:
        destination = listed[name]
        wanted = missing(source, destination)
        for key, offer in source.offers.items():
            if offer not in wanted:
                reason = ("has them already" if key in destination.offers else
                          f"has no {gpu_of(offer)}" if gpu_of(offer) != "cpu" else
                          "has another CPU model")
                console.say(f"compile artifacts for {key} not copied to {name}: it {reason}")
                if as_json:
                    console.data(console.json_line({"key": key, "source": source_name, "destination": name,
                                                    "copied": False, "reason": reason}))
        for offer in wanted:
            copy_offer(session, source, name, offer)
            if as_json:
                console.data(console.json_line({"key": offer.key, "source": source_name,
                                                "destination": name, "copied": True, "reason": None}))
    return ExitCode.OK
