"""Calling the agent of a host's current release (or of another installed one), through
its transport.

The agent answers every verb with one JSON object, read here as its type of
dflash_contract.replies; `follow` streams JSON lines, each read as its message type,
`send-file` a file's raw bytes. A tiny bootstrap passed
with `python -c` expands `~` in the workspace on the host itself (no shell expands it:
argv is quoted once) and runs remote/agent.py of the release `current` points to, or of
releases/<id> (launch's, installed but not yet current).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, TypeVar


from dflash_contract import requests
from dflash_contract.checker import Message, ProtocolError
from dflash_contract.follow import FollowMessage, follow_message
from dflash_contract.replies import ErrorKind, ErrorReply, Reply, RunStatus

from .errors import DflashError, ExitCode, UnreachableError
from .host_replies import check_interpreter, parse_reply
from .inventory import Host
from .transports.base import Transport

# Bytecode is never written: not into the release (installed releases are never
# written to; a .pyc cut short by a full disk made every later import fail), and not
# elsewhere either, since a cache anywhere can be cut short the same way. Compiling the
# agent's modules costs tens of ms per call. The environment variable reaches the
# supervisor and the trainer; setting it here also covers releases older than this rule.
# argv: the workspace, the release's folder in it (`current` or releases/<id>), the verb
# and its options.
_BOOTSTRAP = (
    "import json, os, runpy, sys\n"
    "sys.dont_write_bytecode = True\n"
    "os.environ['PYTHONDONTWRITEBYTECODE'] = '1'\n"
    "workspace = os.path.expanduser(sys.argv[1])\n"
    "script = os.path.join(workspace, sys.argv[2], 'remote', 'agent.py')\n"
    "if not os.path.isfile(script):\n"
    "    print(json.dumps({'error': 'no release deployed in %s (no %s)' % (workspace, sys.argv[2]),\n"
    "                      'kind': 'not_deployed'}))\n"
    "    sys.exit(2)\n"
    "sys.argv = [script, '--workspace', workspace] + sys.argv[3:]\n"
    "runpy.run_path(script, run_name='__main__')\n"
)

# Put before the source of every `python -c` run as the host's interpreter when the
# inventory names no `python` (sys.argv[1] is then the workspace): when `dflash setup`
# made <workspace>/env and this is not its interpreter, the same command line, read back
# from /proc (a `-c` source is not in sys.argv), runs again with env/bin/python.
PREFER_SETUP_ENV = (
    "import os, sys\n"
    "_env = os.path.join(os.path.expanduser(sys.argv[1]), 'env')\n"
    "_python = os.path.join(_env, 'bin', 'python')\n"
    "if os.path.isfile(_python) and os.path.realpath(sys.prefix) != os.path.realpath(_env):\n"
    "    with open('/proc/self/cmdline', 'rb') as _fh:\n"
    "        os.execv(_python, [_python] + _fh.read().split(b'\\0')[1:-1])\n"
)

# "host": the host was reached but cannot take the run (a package, a path, disk space).
_EXIT_FOR_KIND = {ErrorKind.USAGE: ExitCode.USAGE, ErrorKind.CONFLICT: ExitCode.USAGE,
                  ErrorKind.NOT_FOUND: ExitCode.USAGE, ErrorKind.NOT_DEPLOYED: ExitCode.USAGE,
                  ErrorKind.HOST: ExitCode.USAGE, ErrorKind.INTERNAL: ExitCode.UNREACHABLE}

R = TypeVar("R", bound=Reply)
M = TypeVar("M", bound=Message)


class AgentClient:
    def __init__(self, host: Host, transport: Transport, release_id: str | None = None):
        """`release_id`: the installed release whose agent answers; None: the current one's."""
        self.host = host
        self.transport = transport
        self.folder = "current" if release_id is None else f"releases/{release_id}"

    def argv(self, request: requests.Verb) -> list[str]:
        return python_argv(self.host, _BOOTSTRAP, self.host.workspace, self.folder, *request.argv())

    @contextlib.contextmanager
    def _naming(self, verb: str) -> Iterator[None]:
        """A transport names a failed command by its argv[0], here the host's interpreter;
        the agent verb says what was going on."""
        try:
            yield
        except DflashError as exc:
            exc.message = exc.message.replace(f"`{self.host.python}`", f"agent {verb}")
            exc.args = (exc.message,)
            raise

    def call(self, request: requests.Request[R], stdin: bytes | None = None, timeout: float | None = None) -> R:
        """The agent's answer to `request`, read as the request's reply type, or the
        agent's refusal raised as a DflashError."""
        verb, reply = request.VERB, request.reply()
        with self._naming(verb):
            done = self.transport.run(self.argv(request), stdin=stdin, timeout=timeout)
        check_interpreter(self.host, done)
        obj = parse_reply(done.stdout)
        if obj is None:
            stderr = done.stderr.decode(errors="replace").strip()
            raise DflashError(f"host {self.host.name}: agent {verb} gave no answer "
                              f"(exit {done.exit_code}): {stderr[-2000:]}", ExitCode.UNREACHABLE)
        with self.reading():
            if "error" in obj:
                raise self.refusal(ErrorReply.from_json(obj))
            return reply.from_json(obj)

    def run_status(self, run_id: str, config: bool = False) -> RunStatus:
        """`status` of one run (`config`: with its config.yaml's text)."""
        (status,) = self.call(requests.Status(run_id, config)).runs
        return status

    def follow(self, request: requests.Follow) -> Iterator[FollowMessage]:
        """The agent's follow stream, message by message. UnreachableError if the
        connection drops."""
        with self._naming(request.VERB):
            for line in self.transport.stream(self.argv(request)):
                obj = parse_reply(line)
                if obj is None:
                    raise UnreachableError(f"host {self.host.name}: unreadable follow line {line[:200]!r}")
                with self.reading():
                    message = follow_message(obj)
                if isinstance(message, ErrorReply):
                    raise self.refusal(message)
                yield message

    def refusal(self, error: ErrorReply) -> DflashError:
        """The agent's error reply as the error this CLI raises."""
        # The agent may say what to do instead (its "hint"), as a refusal of resume does.
        hint = f"run: dflash deploy {self.host.name}" if error.kind == ErrorKind.NOT_DEPLOYED else error.hint
        return DflashError(f"host {self.host.name}: {error.error}", _EXIT_FOR_KIND[error.kind], hint=hint)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """An answer this CLI cannot read: most likely from the agent of another release."""
        try:
            yield
        except ProtocolError as exc:
            raise DflashError(f"host {self.host.name}: cannot read its answer: {exc}", ExitCode.UNREACHABLE,
                              hint=f"the host's release may be another dflash's: dflash deploy {self.host.name} "
                                   "installs this one's") from exc

    def chunks(self, request: requests.SendFile | requests.SendCompileArtifacts) -> Iterator[bytes]:
        """A verb's raw stdout as it comes (send-file). UnreachableError if the connection
        drops; CommandFailed (its stderr holds the agent's error object) if it fails."""
        with self._naming(request.VERB):
            yield from self.transport.chunks(self.argv(request))


def python_argv(host: Host, source: str, workspace: str, *args: str) -> list[str]:
    """argv running `source` on `host` with the trainer's interpreter: the inventory's
    `python`, else the environment `dflash setup` made, else the default python."""
    prelude = "" if host.python_named else PREFER_SETUP_ENV
    return [host.python, "-c", prelude + source, workspace, *args]


def run_probe(transport: Transport, host: Host, source: str, answer: type[M], *args: str, doing: str = "",
              stdin: bytes | None = None, timeout: float | None = None) -> M:
    """`source` run on `host` with the trainer's interpreter (python_argv), its reply read
    as `answer`; a run that failed or answered no JSON is a DflashError (usage) naming the
    host and the end of its stderr. `doing`: what the message says it was doing."""
    done = transport.run(python_argv(host, source, host.workspace, *args), stdin=stdin, timeout=timeout)
    check_interpreter(host, done)
    obj = parse_reply(done.stdout)
    if done.exit_code != 0 or obj is None:
        raise DflashError(f"host {host.name}: {host.python} failed (exit {done.exit_code}){doing}: "
                          f"{done.stderr.decode(errors='replace').strip()[-500:]}", ExitCode.USAGE)
    return read_probe(host, answer, obj)


def read_probe(host: Host, answer: type[M], obj: dict) -> M:
    """What a probe (a source of this tree sent with `python -c`: host_check.py's loader)
    answered, read as its type."""
    try:
        return answer.from_json(obj)
    except ProtocolError as exc:
        raise DflashError(f"host {host.name}: {exc}", ExitCode.UNREACHABLE) from exc
