"""The agent's verbs as the CLI calls them: each request a frozen dataclass whose `argv()`
is the verb and its options, every value in the option's own word (--name=VALUE) so
that no user value can read as an option (dflash_agent's docstring lists the verbs)."""
import dataclasses
import hashlib
import json
from typing import Any, Callable, Dict, Generic, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from .checker import Message
from .records import ReleaseSource, RestartPolicy
from .replies import (ArtifactsReply, CompileArtifactsReply, GcReply, LaunchCheckReply, LaunchReply,
                      ReceiveCompileArtifactsReply, ReleaseFilesReply, ReportReply, Reply, ResumeCheckReply, ResumeReply,
                      RunConfigReply, StacksReply, StatusReply, StopReply)

# How many bytes before a log offset its fingerprint covers: enough that a log rewritten
# from byte 0 (truncated, then grown past the offset again) shows different bytes there.
FINGERPRINT_BYTES = 64


def fingerprint(data: bytes) -> str:
    """"LEN:SHA256HEX" of `data`, the last bytes before an offset in a log. A follower
    that resumes at the offset (follow --fingerprint) checks that the file still holds
    these bytes there."""
    return "%d:%s" % (len(data), hashlib.sha256(data).hexdigest())


def option(flag: str = "", render: Optional[Callable[[Any], str]] = None, default: Any = None,
           each: bool = True) -> Any:
    """A field given on the command line as `flag` (default: --field-name) and, for a value
    that is not already text, `render(value)`; a list or tuple is the option once per item
    (`each`) or once, rendered whole."""
    return dataclasses.field(default=default, metadata={_FLAG: flag, _RENDER: render, _EACH: each})


_FLAG = "dflash: the option"
_RENDER = "dflash: how its value is written"
_EACH = "dflash: a list is the option repeated"


R = TypeVar("R", bound=Reply)


class Verb:
    """One agent verb with its options: the fields, in the agent's own names. None and
    False are left out, True is the bare flag, a list the option once per item."""

    VERB = ""

    def argv(self) -> List[str]:
        return [self.VERB] + _options(self)


class Request(Verb, Generic[R]):
    """A verb that answers one JSON object, read as `reply()`."""

    def reply(self) -> Type[R]:
        raise NotImplementedError


def _options(options: Any) -> List[str]:
    """The fields of a dataclass as options; a field holding a dataclass gives its own,
    unless the field says how its value is written (a record sent whole as JSON)."""
    out = []  # type: List[str]
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        flag = field.metadata.get(_FLAG) or "--" + field.name.replace("_", "-")
        render = field.metadata.get(_RENDER) or str
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif dataclasses.is_dataclass(value) and field.metadata.get(_RENDER) is None:
            out += _options(value)
        elif isinstance(value, (list, tuple)) and field.metadata.get(_EACH, True):
            out += ["%s=%s" % (flag, render(item)) for item in value]
        else:
            out.append("%s=%s" % (flag, render(value)))
    return out


def _json(value: Any) -> str:
    return json.dumps(value.to_json() if isinstance(value, Message) else value)


def _pair(item: Tuple[str, str]) -> str:
    return "%s=%s" % item


def _path_requirement(item: Tuple[str, str, str]) -> str:
    return "%s:%s=%s" % item


def _names(names: Sequence[str]) -> str:
    return ",".join(names)


@dataclasses.dataclass(frozen=True)
class Status(Request[StatusReply]):
    VERB = "status"
    run_id: Optional[str] = None  # None: every run on the host
    config: bool = False  # with run_id: each RunStatus's config too

    def reply(self) -> Type[StatusReply]:
        return StatusReply


@dataclasses.dataclass(frozen=True)
class Stop(Request[StopReply]):
    VERB = "stop"
    run_id: str
    grace: Optional[float] = None  # seconds the trainer gets before SIGKILL (the agent's default: 10)

    def reply(self) -> Type[StopReply]:
        return StopReply


@dataclasses.dataclass(frozen=True)
class Stacks(Request[StacksReply]):
    VERB = "stacks"
    run_id: str

    def reply(self) -> Type[StacksReply]:
        return StacksReply


@dataclasses.dataclass(frozen=True)
class Report(Request[ReportReply]):
    VERB = "report"
    run_id: str

    def reply(self) -> Type[ReportReply]:
        return ReportReply


@dataclasses.dataclass(frozen=True)
class RunConfig(Request[RunConfigReply]):
    VERB = "run-config"
    run_id: str

    def reply(self) -> Type[RunConfigReply]:
        return RunConfigReply


@dataclasses.dataclass(frozen=True)
class Artifacts(Request[ArtifactsReply]):
    VERB = "artifacts"
    run_id: str
    checkpoint: bool = False

    def reply(self) -> Type[ArtifactsReply]:
        return ArtifactsReply


@dataclasses.dataclass(frozen=True)
class SendFile(Verb):
    """Its answer is the file's bytes, not a reply."""
    VERB = "send-file"
    run_id: str
    folder: str
    path: str
    offset: int
    identity: str


@dataclasses.dataclass(frozen=True)
class CompileArtifacts(Request[CompileArtifactsReply]):
    VERB = "compile-artifacts"

    def reply(self) -> Type[CompileArtifactsReply]:
        return CompileArtifactsReply


@dataclasses.dataclass(frozen=True)
class SendCompileArtifacts(Verb):
    """Its answer is the artifacts' bytes, not a reply."""
    VERB = "send-compile-artifacts"
    key: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class ReceiveCompileArtifacts(Request[ReceiveCompileArtifactsReply]):
    VERB = "receive-compile-artifacts"
    key: str
    manifest: Dict[str, Any] = option("--manifest-json", _json)

    def reply(self) -> Type[ReceiveCompileArtifactsReply]:
        return ReceiveCompileArtifactsReply


@dataclasses.dataclass(frozen=True)
class ReleaseFiles(Request[ReleaseFilesReply]):
    VERB = "release-files"
    release_id: str
    paths: Tuple[str, ...] = option("--path", default=())

    def reply(self) -> Type[ReleaseFilesReply]:
        return ReleaseFilesReply


@dataclasses.dataclass(frozen=True)
class Gc(Request[GcReply]):
    VERB = "gc"
    keep: int

    def reply(self) -> Type[GcReply]:
        return GcReply


@dataclasses.dataclass(frozen=True)
class Follow(Verb):
    """Its answer is a stream of follow messages (replies.FOLLOW_MESSAGES)."""
    VERB = "follow"
    run_id: str
    errors_seen: int
    gpu_interval: float
    offset: int
    segment: int
    events_offset: int
    inode: Optional[int] = None
    fingerprint: Optional[str] = None
    tail_lines: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one host's part of a run on several hosts sits (launch and resume)."""
    rank: int
    world_size: int
    master_addr: Optional[str]  # None on resume: the run's record has it
    master_port: int
    host_names: Tuple[str, ...] = option(render=_names, each=False, default=())


@dataclasses.dataclass(frozen=True)
class Launch(Request[Union[LaunchReply, LaunchCheckReply]]):
    VERB = "launch"
    run_id: str
    config: str  # "-": on stdin, which is how the CLI sends it
    name: str
    stall_after: float
    startup_stall_after: float
    source: ReleaseSource = option("--source-json", _json)
    restart: RestartPolicy = option("--restart-json", _json)
    resources: Tuple[str, ...] = option("--resource", default=())
    env: Tuple[Tuple[str, str], ...] = option(render=_pair, default=())
    require_modules: Tuple[str, ...] = option("--require-module", default=())
    require_paths: Tuple[Tuple[str, str, str], ...] = option("--require-path", _path_requirement, default=())
    overrides: Tuple[str, ...] = option("--override", default=())
    release: Optional[str] = None
    force: bool = False
    layout: Optional[Layout] = None  # on several hosts
    check_only: bool = False

    def reply(self) -> Type[Union[LaunchReply, LaunchCheckReply]]:
        return LaunchCheckReply if self.check_only else LaunchReply


@dataclasses.dataclass(frozen=True)
class Resume(Request[Union[ResumeReply, ResumeCheckReply]]):
    VERB = "resume"
    run_id: str
    release: str  # "run" (the run's own) or "current"
    step: Optional[int] = None
    env: Tuple[Tuple[str, str], ...] = option(render=_pair, default=())
    require_modules: Tuple[str, ...] = option("--require-module", default=())
    layout: Optional[Layout] = None  # on several hosts
    check_only: bool = False

    def reply(self) -> Type[Union[ResumeReply, ResumeCheckReply]]:
        return ResumeCheckReply if self.check_only else ResumeReply
