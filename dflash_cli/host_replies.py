"""What a script run on a host with `python -c` answered: the JSON object of its last
line, or that its interpreter never ran. Apart from agent_client.py (and its protocol's
dataclasses) so that deploy's receiver is read without importing them."""
from __future__ import annotations

import json

from .errors import DflashError, ExitCode
from .inventory import Host
from .transports.base import Completed


def check_interpreter(host: Host, done: Completed) -> None:
    """A `host.python -c ...` that exited 127 never ran: the interpreter is missing."""
    if done.exit_code == 127:
        raise DflashError(f"host {host.name}: interpreter {host.python!r} not found "
                          f"({done.stderr.decode(errors='replace').strip()})", ExitCode.USAGE,
                          hint=f"set python: in the inventory entry of {host.name}")


def parse_reply(raw: bytes) -> dict | None:
    """The JSON object on the last line of `raw`, or None when there is none. Lines end
    at "\n" only: str.splitlines would also split at U+2028 or U+0085, which the agent
    leaves raw inside JSON strings (a log line may hold them)."""
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return None
    try:
        value = json.loads(text.rsplit("\n", 1)[-1])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
