"""The `follow` verb's stream as types: every message a line of it carries, {"t": T, ...}
(dflash_agent/follow.py writes them, the CLI's watch reads them), each read strictly as
the replies are (checker.py)."""
import dataclasses
from typing import Any, Dict, Optional, Tuple, Type, Union

from .checker import M, Message, ProtocolError, optional, read, shown
from .records import ErrorRecord, ExitRecord
from .replies import ErrorReply, Gpu
from .states import RunState


class FollowMessage(Message):
    """One line of the `follow` stream: {"t": T, ...}."""

    T = ""

    @classmethod
    def describe(cls) -> str:
        return "agent follow %r message" % cls.T

    def to_json(self) -> Dict[str, Any]:
        out = {"t": self.T}  # type: Dict[str, Any]
        out.update(super().to_json())
        return out

    @classmethod
    def from_json(cls: Type[M], obj: Any) -> M:
        if not isinstance(obj, dict) or obj.get("t") != cls.T:  # type: ignore[attr-defined]
            raise ProtocolError("%s: expected \"t\": %r, got %r" % (
                cls.describe(), cls.T, obj.get("t") if isinstance(obj, dict) else obj))  # type: ignore[attr-defined]
        return read(cls, {key: value for key, value in obj.items() if key != "t"}, cls.describe())


@dataclasses.dataclass(frozen=True)
class LogMessage(FollowMessage):
    """train.log's bytes from `offset`, whole lines only (a partial last line is held until
    it completes, the run ends or the segment ends), batched for up to 1 s; the lines
    before an error record are sent at once, with it. `data` is utf-8 decoded with
    surrogateescape: data.encode("utf-8", "surrogateescape") gives the exact bytes, and
    offset + their length is where the next message starts."""

    T = "log"
    offset: int
    data: str
    inode: Optional[int] = optional()  # in the first message of a stream and of a segment
    segment: Optional[int] = optional()  # ditto


@dataclasses.dataclass(frozen=True)
class RotatedMessage(FollowMessage):
    """train.log was cut in place ("truncated": copytruncate, a size below what was read or
    other bytes than those read before) or another file took its name ("replaced",
    followed once it has content). Everything of the old content that could be read was
    sent before this message, up to previous_end; the new content follows from `offset`
    as segment `segment`."""

    T = "rotated"
    reason: str  # "truncated" or "replaced"
    segment: int
    inode: int
    offset: int  # 0, or the --tail-lines start
    previous_end: int
    # The old content was read to its end (from the old file, or from a copy next to it,
    # train.log.*, holding the bytes before the read position); false: lines written to
    # it after its last read may be missing.
    complete: bool


@dataclasses.dataclass(frozen=True)
class ErrorMessage(FollowMessage):
    """An errors.jsonl record, as soon as its line is complete."""

    T = "error"
    index: int  # its position in errors.jsonl
    record: Optional[ErrorRecord]  # None for a line that is no record...
    raw: Optional[str] = optional()  # ... which comes as it is


@dataclasses.dataclass(frozen=True)
class EventsMessage(FollowMessage):
    """events.jsonl's records (every type but heartbeat) of the stretch [offset, next) of
    the file, whole lines only, batched like the log (up to 1 s or 64 KiB): a resume
    passes `next` as --events-offset. A stretch of heartbeats alone sends nothing; a line
    that is not JSON (a write cut by a kill) is skipped."""

    T = "events"
    offset: int
    next: int
    events: Tuple[Dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class GpuMessage(FollowMessage):
    """A sample of nvidia-smi every --gpu-interval seconds (none without it)."""

    T = "gpu"
    ts: float
    gpus: Tuple[Gpu, ...]


@dataclasses.dataclass(frozen=True)
class StateMessage(FollowMessage):
    """The run's state, at the start and on every change."""

    T = "state"
    state: RunState
    ts: float


@dataclasses.dataclass(frozen=True)
class EndMessage(FollowMessage):
    """The last message: the run is terminal and everything it wrote was sent."""

    T = "end"
    state: RunState
    exit: Optional[ExitRecord]  # exit.json
    attempt: int  # the latest attempt, whose error records the outcome is
    offset: int  # where the log was sent to...
    segment: int  # ... in this segment


FOLLOW_MESSAGES = {cls.T: cls for cls in (LogMessage, RotatedMessage, ErrorMessage, EventsMessage, GpuMessage,
                                          StateMessage, EndMessage)}


def follow_message(obj: Any) -> Union[FollowMessage, ErrorReply]:
    """One line of the follow stream, by its "t"; an object without one is the error
    reply of a follow refused before it streamed (an unknown run)."""
    if isinstance(obj, dict) and "t" not in obj:
        return ErrorReply.from_json(obj)
    kind = obj.get("t") if isinstance(obj, dict) else None
    if kind not in FOLLOW_MESSAGES:
        raise ProtocolError("agent follow message: unknown type %s" % shown(kind if isinstance(obj, dict) else obj))
    return FOLLOW_MESSAGES[kind].from_json(obj)
