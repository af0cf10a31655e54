"""Argument parsing and the JSON envelope of every verb (the package docstring lists the
verbs, dflash_contract.replies their replies). stdout carries JSON only: help and usage text go to
stderr."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from dflash_contract.checker import ProtocolError
from dflash_contract.records import ReleaseSource, RestartPolicy
from dflash_contract.replies import CompileArtifactsReply, ErrorKind, ErrorReply, GpusReply, InfoReply, Reply
from dflash_contract.requests import FINGERPRINT_BYTES
from dflash_files.config_paths import PATH_KINDS
from dflash_files.diskspace import NO_SPACE

from .jsonio import AgentError, emit, no_space
from .layout import Workspace


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, and writes help to
    stderr: whatever happens, stdout stays JSON."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise AgentError("%s: %s" % (self.prog, message), "usage")

    def print_help(self, file: Any = None) -> None:
        super().print_help(file or sys.stderr)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive, got %s" % text)
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0, got %s" % text)
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0, got %s" % text)
    return value


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("not JSON: %s" % exc)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, got %s" % type(value).__name__)
    return value


def _release_source(text: str) -> ReleaseSource:
    try:
        return ReleaseSource.from_json(_json_object(text))
    except ProtocolError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def _restart_policy(text: str) -> RestartPolicy:
    try:
        policy = RestartPolicy.from_json(_json_object(text))
    except ProtocolError as exc:
        raise argparse.ArgumentTypeError(str(exc))
    problem = policy.problem()
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return policy


def _fingerprint(text: str) -> str:
    """LEN:HEX as dflash_contract.requests.fingerprint writes it: a sha256 of at most FINGERPRINT_BYTES bytes."""
    length, _, digest = text.partition(":")
    if not (length.isdigit() and int(length) <= FINGERPRINT_BYTES and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest)):
        raise argparse.ArgumentTypeError("expected LEN:SHA256HEX (LEN <= %d), got %r" % (FINGERPRINT_BYTES, text))
    return text


def _env_pair(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError("expected KEY=VALUE, got %r" % text)
    return key, value


def _path_requirement(text: str) -> Tuple[str, str, str]:
    kind, colon, rest = text.partition(":")
    key, equals, path = rest.partition("=")
    if not colon or not equals or kind not in PATH_KINDS or not key or not path:
        raise argparse.ArgumentTypeError("expected KIND:KEY=PATH with KIND one of %s, got %r"
                                         % (", ".join(PATH_KINDS), text))
    return kind, key, path


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agent.py", description="dflash agent (JSON on stdout)")
    parser.add_argument("--workspace", required=True, help="the host's dflash workspace")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True

    p = verbs.add_parser("launch", help="start a run detached; returns once run.json exists")
    p.add_argument("--run-id", required=True)
    p.add_argument("--config", required=True, help="path (relative: to the release root) or - for stdin")
    p.add_argument("--name")
    p.add_argument("--resource", action="append", default=[], help="gpu0, gpu1, ... or cpu")
    p.add_argument("--force", action="store_true", help="take resources held by live runs")
    p.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE")
    p.add_argument("--python", default=sys.executable or "python3")
    p.add_argument("--stall-after", type=_positive, default=300.0)
    p.add_argument("--startup-stall-after", type=_positive, default=300.0)
    p.add_argument("--source-json", type=_release_source, help="where the release came from (run.json's source)")
    p.add_argument("--restart-json", type=_restart_policy,
                   help='the restart policy: {"max": N, "on": ["failure", "killed"], "backoff_s": S}')
    p.add_argument("--require-module", action="append", default=[], metavar="NAME",
                   help="a module the trainer's interpreter must find (checked before anything starts)")
    p.add_argument("--require-path", action="append", default=[], type=_path_requirement,
                   metavar="KIND:KEY=PATH", help="a path of the config that must exist on this host")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a --set the config was resolved with (recorded in run.json as given)")
    p.add_argument("--release", metavar="ID",
                   help="the installed release to run (default: the current one); made current as the run starts")
    _distributed_options(p, "launch")

    p = verbs.add_parser("resume", help="start the next attempt of an ended run from a checkpoint")
    p.add_argument("--run-id", required=True)
    p.add_argument("--release", choices=("run", "current"), default="run",
                   help="the run's own release (default) or the host's current one")
    p.add_argument("--step", type=_non_negative_int, help="this checkpoint step (default: the newest complete one)")
    p.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE")
    p.add_argument("--require-module", action="append", default=[], metavar="NAME")
    _distributed_options(p, "resume")

    p = verbs.add_parser("status", help="RunStatus of one run or of all, newest first")
    p.add_argument("--run-id")
    p.add_argument("--config", action="store_true", help="with --run-id: add the run's config.yaml text")

    p = verbs.add_parser("stop", help="SIGTERM the run's process group, then SIGKILL after --grace")
    p.add_argument("--run-id", required=True)
    p.add_argument("--grace", type=_non_negative, default=10.0)

    p = verbs.add_parser("stacks", help="dump every thread's stack (SIGUSR1 + faulthandler)")
    p.add_argument("--run-id", required=True)
    p.add_argument("--timeout", type=_positive, default=5.0)

    p = verbs.add_parser("report", help="everything fetch-traceback needs")
    p.add_argument("--run-id", required=True)
    p.add_argument("--log-lines", type=_non_negative_int, default=200)

    verbs.add_parser("gpus", help="nvidia-smi devices ([] without nvidia-smi)")
    verbs.add_parser("info", help="python, packages, GPUs and current release of this host")

    p = verbs.add_parser("follow", help="stream the run as JSON lines until it ends")
    p.add_argument("--run-id", required=True)
    p.add_argument("--offset", type=_non_negative_int)
    p.add_argument("--inode", type=int)
    p.add_argument("--segment", type=_non_negative_int, default=0)
    p.add_argument("--fingerprint", type=_fingerprint, help="LEN:SHA256 of the LEN bytes before --offset")
    p.add_argument("--errors-seen", type=_non_negative_int, default=0)
    p.add_argument("--events-offset", type=_non_negative_int, default=0,
                   help="byte offset in events.jsonl to send events from")
    p.add_argument("--tail-lines", type=_non_negative_int)
    p.add_argument("--gpu-interval", type=_non_negative, default=5.0, help="0: no GPU samples")
    p.add_argument("--poll", type=_positive, default=0.1)

    p = verbs.add_parser("artifacts", help="the files of the run's export (and newest checkpoint), "
                                           "with size and sha256")
    p.add_argument("--run-id", required=True)
    p.add_argument("--checkpoint", action="store_true", help="also the checkpoint `latest` names")

    p = verbs.add_parser("send-file", help="one listed file's raw bytes from an offset, on stdout")
    p.add_argument("--run-id", required=True)
    p.add_argument("--folder", required=True, help="export, or checkpoints/<step folder>")
    p.add_argument("--path", required=True, help="the file's path inside the folder")
    p.add_argument("--offset", type=_non_negative_int, default=0)
    p.add_argument("--identity", required=True, help="as `artifacts` listed it")

    verbs.add_parser("compile-artifacts", help="the portable compile artifacts of the workspace's compile cache")
    p = verbs.add_parser("send-compile-artifacts", help="one key's compile artifacts' raw bytes, on stdout")
    p.add_argument("--key", required=True)
    p.add_argument("--sha256", required=True, help="as `compile-artifacts` listed it")
    p = verbs.add_parser("receive-compile-artifacts", help="store compile artifacts sent on stdin")
    p.add_argument("--key", required=True)
    p.add_argument("--manifest-json", type=_json_object, required=True, help="the manifest the sender listed")

    p = verbs.add_parser("release-files", help="a release's MANIFEST and the named files' bytes")
    p.add_argument("--release-id", required=True)
    p.add_argument("--path", action="append", default=[], help="a file MANIFEST lists (repeatable)")

    p = verbs.add_parser("run-config", help="the run's config.yaml")
    p.add_argument("--run-id", required=True)

    p = verbs.add_parser("gc", help="remove releases no run uses and `current` is not")
    p.add_argument("--keep", type=_non_negative_int, default=0, help="unused releases to keep, newest first")
    return parser


def _distributed_options(p: argparse.ArgumentParser, verb: str) -> None:
    """A host's place in a run on several hosts (launch.Distributed), and the check of
    every host before any starts."""
    p.add_argument("--rank", type=_non_negative_int, help="this host's position in a run on several hosts")
    p.add_argument("--world-size", type=_non_negative_int, help="how many hosts the run has")
    p.add_argument("--master-addr", help="rank 0's address, where the trainers meet"
                   + (" (default: the launch's)" if verb == "resume" else ""))
    p.add_argument("--master-port", type=_non_negative_int, default=0,
                   help="rank 0's rendezvous port (0 with --check-only: pick a free one)")
    p.add_argument("--host-names", default="", help="the run's hosts, comma-separated, in rank order")
    p.add_argument("--check-only", action="store_true",
                   help="check what the %s would (host, run, checkpoint, locks), start nothing" % verb)


def _distributed(args: argparse.Namespace, address_required: bool = True):
    from .launch import Distributed
    if args.world_size is None and args.rank is None and args.master_addr is None:
        return None
    if args.world_size is None or args.rank is None or (address_required and args.master_addr is None):
        raise AgentError("--rank, --world-size and --master-addr go together"
                         if address_required else "--rank and --world-size go together", "usage")
    return Distributed(args.rank, args.world_size, args.master_addr or "", args.master_port,
                       tuple(name for name in args.host_names.split(",") if name))


# Each verb imports only what it needs: the agent starts afresh for every CLI call.

def _launch(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .launch import LaunchRequest, launch
    distributed = _distributed(args)
    return launch(ws, LaunchRequest(
        run_id=args.run_id, config=args.config, name=args.name, resources=tuple(args.resource),
        force=args.force, env=tuple(args.env), python=args.python, stall_after=args.stall_after,
        startup_stall_after=args.startup_stall_after,
        source=args.source_json, modules=tuple(args.require_module), paths=tuple(args.require_path),
        overrides=tuple(args.override), restart=args.restart_json, release=args.release,
        distributed=distributed, check_only=args.check_only))


def _resume(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .resume import ResumeRequest, resume
    return resume(ws, ResumeRequest(run_id=args.run_id, release=args.release, step=args.step,
                                    env=tuple(args.env), modules=tuple(args.require_module),
                                    distributed=_distributed(args, address_required=False),
                                    check_only=args.check_only))


def _status(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .report import status
    if args.config and args.run_id is None:
        raise AgentError("status --config needs --run-id", "usage")
    return status(ws, args.run_id, args.config)


def _stop(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .control import stop
    return stop(ws.existing_run(args.run_id), args.grace)


def _stacks(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .control import stacks
    return stacks(ws.existing_run(args.run_id), args.timeout)


def _report(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .report import report
    return report(ws.existing_run(args.run_id), args.log_lines)


def _artifacts(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .artifacts import artifacts
    return artifacts(ws.existing_run(args.run_id), args.checkpoint)


def _release_files(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .releases import release_files
    return release_files(ws, args.release_id, args.path)


def _run_config(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .releases import run_config
    return run_config(ws.existing_run(args.run_id))


def _gc(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .releases import gc
    return gc(ws, args.keep)


def _compile_artifacts(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .compile_artifacts import cpu_model, list_artifacts
    from .gpus import gpus
    return CompileArtifactsReply(cpu=cpu_model(), artifacts=list_artifacts(ws.root),
                                 gpus=tuple(gpu["name"] for gpu in gpus()["gpus"]))


def _receive_compile_artifacts(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .compile_artifacts import receive_artifacts
    return receive_artifacts(ws.root, args.key, args.manifest_json)


# gpus.py imports nothing else of this package (it is also sent, with the few modules it
# imports, to a loader run with `python -c`): its answers become replies by being read as them.

def _gpus(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .gpus import gpus
    return GpusReply.from_json(gpus())


def _info(ws: Workspace, args: argparse.Namespace) -> Reply:
    from .gpus import host_facts
    from dflash_files.procfs import boot_id
    return InfoReply.from_json(dict(host_facts(ws.root), boot_id=boot_id()))


VERBS: Dict[str, Callable[[Workspace, argparse.Namespace], Reply]] = {
    "launch": _launch, "resume": _resume, "status": _status, "stop": _stop, "stacks": _stacks,
    "report": _report, "gpus": _gpus, "info": _info, "artifacts": _artifacts,
    "release-files": _release_files, "run-config": _run_config, "gc": _gc,
    "compile-artifacts": _compile_artifacts, "receive-compile-artifacts": _receive_compile_artifacts,
}


def _follow(ws: Workspace, args: argparse.Namespace) -> int:
    from .follow import ClientGone, FollowRequest, Output, follow
    request = FollowRequest(
        run_id=args.run_id, offset=args.offset, inode=args.inode, segment=args.segment,
        fingerprint=args.fingerprint, errors_seen=args.errors_seen,
        events_offset=args.events_offset, tail_lines=args.tail_lines, gpu_interval=args.gpu_interval, poll=args.poll)
    try:
        return follow(ws, request, Output())
    except ClientGone:
        return _reader_gone()


def _send_file(ws: Workspace, args: argparse.Namespace) -> int:
    """stdout carries the file's bytes: a refusal goes to stderr, as the one JSON line
    there, and nothing is written to stdout before it."""
    from .artifacts import send_file
    from .compile_artifacts import send_artifacts
    try:
        if args.verb == "send-file":
            send_file(ws.existing_run(args.run_id), args.folder, args.path, args.offset, args.identity)
        else:
            send_artifacts(ws.root, args.key, args.sha256)
    except AgentError as exc:
        sys.stderr.write(json.dumps(error_reply(exc).to_json()) + "\n")
        return exc.exit_code
    return 0


def _reader_gone() -> int:
    """Nobody reads any more: point stdout at /dev/null so the interpreter's final flush
    does not complain, and leave quietly."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        ws = Workspace.at(args.workspace)
        if args.verb == "follow":
            return _follow(ws, args)
        if args.verb in ("send-file", "send-compile-artifacts"):
            return _send_file(ws, args)
        emit(VERBS[args.verb](ws, args).to_json())
        return 0
    except AgentError as exc:
        emit(error_reply(exc).to_json())
        return exc.exit_code
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except BrokenPipeError:
        return _reader_gone()
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            return _internal_error(exc)
        error = no_space(exc.filename)
        emit(error_reply(error).to_json())
        return error.exit_code
    except BaseException as exc:  # noqa: BLE001 - the caller must get JSON whatever happens
        return _internal_error(exc)


def error_reply(exc: AgentError) -> ErrorReply:
    return ErrorReply(error=exc.message, kind=ErrorKind(exc.kind), **exc.extra)


def _internal_error(exc: BaseException) -> int:
    traceback.print_exc()
    emit(ErrorReply(error="%s: %s" % (type(exc).__name__, exc), kind=ErrorKind.INTERNAL).to_json())
    return 1

