"""One line under a failure's traceback, for the failures we know: what happened, in the
run's terms, and the setting to change (docs/errors.md "Diagnosis").

Each `Signature` matches an errors.jsonl record by the exception it raised (the record's
`exc_type`, or an exception line of its chained traceback: the trainer often wraps what
torch raised) and a pattern over the record's message and traceback, in torch's,
NCCL's, gloo's, transformers' or the trainer's own words; the first that matches gives
the line. A record no signature matches gets none: the line is never a guess.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import shlex
from typing import Callable

from dflash_contract.records import ErrorRecord

from dflash_train.memory.ledger import GRAPHS_SUFFIX  # torch-free: it imports torch only to measure

# How an exception line of a traceback starts: `torch.OutOfMemoryError: …`, `AssertionError`.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*)(?::|$)", re.MULTILINE)
_SIZE = r"[\d.]+ (?:bytes|KiB|MiB|GiB|TiB)"
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
DRY_RUN = "`dflash launch --dry-run` prints the memory estimate"
LOWER_BUDGET = "lower data.token_budget or data.block_token_budget (the step's activations grow with them)"
GRAPHS_HOLD_MOST = "the CUDA graphs' pools hold most: `compile: default` captures none"
COMPILE_BUG = ("start-up missed a shape the data makes, a trainer bug: please report it with this traceback; "
               "meanwhile `compile: cudagraphs` or `compile: off` avoid it")


@dataclasses.dataclass(frozen=True)
class Failure:
    """An error record and where it was recorded: `hosts` are the run's hosts in rank
    order (empty when not known, as for a run on one host)."""

    record: ErrorRecord
    run_id: str
    host: str
    hosts: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """What the patterns search: the message, then the whole chained traceback."""
        return f"{self.record.message or ''}\n{self.record.traceback or ''}"

    @functools.cached_property
    def raised(self) -> frozenset[str]:
        """The class names of the record's exception and of every exception in its chain."""
        names = set(_EXCEPTION_LINE.findall(self.record.traceback or ""))
        return frozenset(names | {self.record.exc_type or ""})

    @property
    def rank(self) -> int | None:
        """This record's rank in a run on several hosts."""
        return self.hosts.index(self.host) if self.host in self.hosts else None

    def who(self, rank: int | None) -> str:
        """`rank 1 (ct202)`; `rank 1` where its host is not known; `another rank` for None."""
        if rank is None:
            return "another rank"
        return f"rank {rank} ({self.hosts[rank]})" if 0 <= rank < len(self.hosts) else f"rank {rank}"

    def look(self, rank: int | None) -> str:
        """The command that shows how `rank`'s part of the run ended (every host's without one)."""
        command = f"dflash fetch-traceback {shlex.quote(self.run_id)}"
        if rank is not None and 0 <= rank < len(self.hosts):
            command += f" --host {shlex.quote(self.hosts[rank])}"
        return f"`{command}`"

    def peer(self, rank: int | None) -> int | None:
        """The rank a collective waited for: in a run of two, the other one."""
        return 1 - rank if rank in (0, 1) and len(self.hosts) == 2 else None


@dataclasses.dataclass(frozen=True)
class Signature:
    name: str
    raised: tuple[str, ...]  # class names, one of which the record or its chain raised; () for any
    pattern: re.Pattern[str]  # searched in Failure.text
    explain: Callable[[re.Match[str], Failure], str]

    def diagnose(self, failure: Failure) -> str | None:
        if self.raised and not failure.raised.intersection(self.raised):
            return None
        match = self.pattern.search(failure.text)
        return None if match is None else self.explain(match, failure)


def diagnose(failure: Failure) -> str | None:
    """The line for a record a signature knows (without the `diagnosis: ` mark), else None."""
    for signature in SIGNATURES:
        line = signature.diagnose(failure)
        if line is not None:
            return line
    return None


# -- CUDA out of memory -------------------------------------------------------------------

def _bytes(size: str) -> int:
    number, unit = size.split()
    return int(float(number) * _UNITS[unit])


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def _cuda_oom(match: re.Match[str], failure: Failure) -> str:
    gpu, text = match["gpu"], failure.text
    line = f"CUDA out of memory on GPU {gpu} (cuda:{gpu}) allocating {match['tried']}"
    used = re.search(rf"this process has ({_SIZE}) memory in use", text)
    line += (f": {used[1]} of its {match['total']} in use by this process, {match['free']} free" if used else
             f" with {match['free']} of its {match['total']} free")
    parts = [p for p in failure.record.memory_parts() if p.device == f"cuda:{gpu}"]
    if not parts:  # nothing noted there (yet, or by an older trainer): torch's figures say if graphs held most
        pools = re.search(rf"with ({_SIZE}) allocated in private pools \(e\.g\., CUDA Graphs\)", text)
        allocated = re.search(rf"Of the allocated memory ({_SIZE}) is allocated by PyTorch", text)
        if pools:
            line += f", {pools[1]} allocated in CUDA graphs' private pools"
        if pools and allocated and 2 * _bytes(pools[1]) > _bytes(allocated[1]):
            return f"{line}; {GRAPHS_HOLD_MOST}; {DRY_RUN}"
        return f"{line}; {LOWER_BUDGET}; {DRY_RUN}"
    line += "; this run held there: " + ", ".join(f"{p.part} {_gib(p.bytes)}" for p in parts)
    graphs = sum(p.bytes for p in parts if p.part.endswith(GRAPHS_SUFFIX))
    drafters = [p for p in parts if p.part.startswith("drafter-") and not p.part.endswith(GRAPHS_SUFFIX)]
    target = sum(p.bytes for p in parts if p.part == "target")
    held = sum(p.bytes for p in drafters)
    if graphs > max(held, target):
        advice = GRAPHS_HOLD_MOST
    elif held > target and len(drafters) > 1:
        advice = (f"its {len(drafters)} drafters hold most: put fewer drafters on each GPU (devices.drafters), "
                  "or lower data.token_budget or data.block_token_budget")
    else:
        advice = LOWER_BUDGET
    return f"{line}; {advice}; {DRY_RUN}"


# -- a compile after start-up -------------------------------------------------------------

def _stray_compile(match: re.Match[str], failure: Failure) -> str:
    return (f"{match['thread']} would compile again after it was ready, for {match['shape']} "
            f"(guard: {match['guard']}): {COMPILE_BUG}")


def _traced_while_compiling(match: re.Match[str], failure: Failure) -> str:
    return ("torch.compile compiled again while another thread ran the compiled step (a recompile racing "
            f"between drafter threads): {COMPILE_BUG}")


def _recompile(match: re.Match[str], failure: Failure) -> str:
    guard = f" (guard {match['guard'].strip()})" if match["guard"] else ""
    return f"torch.compile would compile {match['func'] or match['func2']} again{guard}: {COMPILE_BUG}"


# -- ranks that went silent ---------------------------------------------------------------

def _peer_failed(match: re.Match[str], failure: Failure) -> str:
    peer = failure.record.peer_failure()
    rank = int(match["rank"]) if peer is None else peer.peer_rank
    message = ((peer.peer_message if peer else None) or match["cause"]).split("\n")[0]
    if peer is not None and peer.peer_exc_type:
        return (f"{failure.who(rank)} failed first ({peer.peer_exc_type}: {message}); its traceback: "
                f"{failure.look(rank)}")
    return (f"{failure.who(rank)} went silent ({message}); how it ended: {failure.look(rank)}; "
            "distributed.peer_timeout_s is how long a silent rank is waited for")


def _join_failed(match: re.Match[str], failure: Failure) -> str:
    return (f"{failure.who(int(match['rank']))} could not reach rank 0's rendezvous at {match['address']} within "
            f"{match['seconds']} s: rank 0 did not start, or that address is not reachable from this host "
            f"(rank 0's `address:` in the inventory, or `--master-addr`); rank 0's log: {failure.look(0)}; "
            "distributed.join_timeout_s is the wait")


def _timed_out(failure: Failure, rank: int | None, ms: str, what: str) -> str:
    """`rank` (this record's) waited `ms` in a collective that a peer never joined."""
    silent = failure.peer(rank)
    waited = f"{failure.who(rank)} waited" if rank is not None else "this rank waited"
    return (f"{waited} {int(ms) / 1000:.0f} s for {what}, which {failure.who(silent)} never joined: it went silent "
            f"(hung, or far slower); look at its host: {failure.look(silent)} (with --stacks while it runs); "
            "distributed.timeout_s is how long a collective may take")


def _nccl_timeout(match: re.Match[str], failure: Failure) -> str:
    op = re.search(r"OpType=(\w+)", match["work"])
    return _timed_out(failure, int(match["rank"]), match["ms"], op[1] if op else "a collective")


def _gloo_timeout(match: re.Match[str], failure: Failure) -> str:
    return _timed_out(failure, failure.rank, match["ms"], f"a collective's {match['op']}")


def _connection_closed(match: re.Match[str], failure: Failure) -> str:
    silent = failure.peer(failure.rank)
    peer = f"{failure.who(silent)} at {match['address']}" if silent is not None else f"the rank at {match['address']}"
    return (f"{peer} closed its connection in a collective: its process ended (crashed, killed, or OOM-killed); "
            f"how it ended: {failure.look(silent)}; distributed.peer_timeout_s is how long a silent rank is waited "
            "for, distributed.timeout_s a collective")


def _store_gone(match: re.Match[str], failure: Failure) -> str:
    return (f"the store that rank 0 hosts did not answer ({match[0]}): {failure.who(0)} is gone or unreachable; "
            f"how it ended: {failure.look(0)}; distributed.peer_timeout_s is how long a silent rank is waited for")


def _disk_full(match: re.Match[str], failure: Failure) -> str:
    return (f"the disk of {match['mount']} is full ({int(match['free']):,} bytes free while writing {match['path']}); "
            f"the last complete checkpoint is intact: free space there (old runs' checkpoints; unused releases: "
            f"`dflash gc {shlex.quote(failure.host)}`), then `dflash resume {shlex.quote(failure.run_id)}`")


def _hub_unreachable(match: re.Match[str], failure: Failure) -> str:
    return (f"a model was not in {failure.host}'s Hugging Face cache and the hub could not be reached from there "
            "(no network, or HF_HUB_OFFLINE); download it on the host into the cache its HF_HOME names "
            "(`hf download ID`), or name a model folder in target.path (evaluate.drafter); `dflash launch --dry-run` "
            "checks this before a run starts")


# -- CUDA-graph trees in threads ------------------------------------------------------------

def _cudagraph_trees_tls(match: re.Match[str], failure: Failure) -> str:
    return ("torch <= 2.12's CUDA-graph trees (torch.compile mode=reduce-overhead) fail in every thread but the "
            "first that used them; `compile: cudagraphs` (dflash captures each drafter's whole step itself) is "
            "the safe path with several drafter threads")


# -- chat templates -----------------------------------------------------------------------

FIX_TEMPLATE = ("fix the chat template of target.path's tokenizer (chat_template in tokenizer_config.json, or "
                "chat_template.jinja), or give the data as \"text\" rows")


def _template_turn(match: re.Match[str], failure: Failure) -> str:
    return (f"{match['where']}: the chat template {match['problem']}, so turn {match['turn']}'s tokens cannot be "
            f"located; {FIX_TEMPLATE}")


def _template_refuses(match: re.Match[str], failure: Failure) -> str:
    return (f"{match['where']}: the target's chat template refuses this conversation ({match['why']}); change "
            f"the row, or {FIX_TEMPLATE}")


def _template_unreadable(match: re.Match[str], failure: Failure) -> str:
    if match["problem"].startswith("tokenizer"):
        return f"{match['target']}'s tokenizer has no chat template, and data.train is chat \"messages\"; {FIX_TEMPLATE}"
    return (f"the chat template of {match['target']}'s tokenizer cannot be read for the loss mask (refused at "
            f"start-up, before any row was tokenized); {FIX_TEMPLATE}")


def _template_content(match: re.Match[str], failure: Failure) -> str:
    return (f"{match['where']}: the chat template does not render the last message's content, which a "
            f"\"truncated\" row needs; {FIX_TEMPLATE}")


def _no_template(match: re.Match[str], failure: Failure) -> str:
    if match["where"]:
        return (f"{match['where']} is a \"messages\" row, and the target's tokenizer has no chat template; "
                + FIX_TEMPLATE)
    return (f"the target's tokenizer has no chat template, which \"messages\" rows (and job: regenerate's prompts) "
            f"are rendered with; {FIX_TEMPLATE}")


SIGNATURES: tuple[Signature, ...] = (
    # The trainer's own records first: a rank stopped for a peer reports that peer's failure.
    Signature("peer failed", ("PeerFailed",),
              re.compile(r"rank (?P<rank>\d+) failed \((?P<cause>.*)\); this rank stopped"), _peer_failed),
    Signature("join failed", ("JoinFailed",),
              re.compile(r"rank (?P<rank>\d+) could not join the process group of \d+ at (?P<address>\S+) "
                         r"within (?P<seconds>\d+)s"), _join_failed),
    Signature("CUDA out of memory", ("OutOfMemoryError",),
              re.compile(rf"CUDA out of memory\. Tried to allocate (?P<tried>{_SIZE})\. GPU (?P<gpu>\d+) has a "
                         rf"total capacity of (?P<total>{_SIZE}) of which (?P<free>{_SIZE}) is free"), _cuda_oom),
    Signature("stray compile", ("StrayCompile",),
              re.compile(r"(?P<thread>\S+): torch\.compile would compile again after ready, for (?P<shape>.+?) "
                         r"\(guard: (?P<guard>.+)\); every shape"), _stray_compile),
    Signature("FX trace of a compiled function", ("RuntimeError",),
              re.compile(r"Detected that you are using FX to symbolically trace a dynamo-optimized function"),
              _traced_while_compiling),
    Signature("recompile refused", ("RuntimeError", "RecompileError"),
              re.compile(r"(?:Detected recompile when torch\.compile stance is 'fail_on_recompile'\. filename: "
                         r"'[^']*', function name: '(?P<func>[^']*)'|Recompiling function (?P<func2>\S+) in \S+)"
                         r"(?:[^\n]*\n\s*triggered by the following guard failure\(s\):\s*\n\s*- (?P<guard>[^\n]+))?"),
              _recompile),
    Signature("NCCL collective timeout", (),
              re.compile(r"\[(?:PG ID \d+ PG GUID \S+ )?Rank (?P<rank>\d+)\] Watchdog caught collective operation "
                         r"timeout: WorkNCCL\((?P<work>.*?)\) ran for (?P<ms>\d+) milliseconds before timing out"),
              _nccl_timeout),
    Signature("gloo collective timeout", (),
              re.compile(r"gloo/transport/tcp/[\w.]+:\d+\] Timed out waiting (?P<ms>\d+)ms for (?P<op>send|recv) "
                         r"operation to complete"), _gloo_timeout),
    Signature("gloo connection closed", (),
              re.compile(r"gloo/transport/tcp/[\w.]+:\d+\] Connection closed by peer (?P<address>\[[^\]]+\]):\d+"),
              _connection_closed),
    Signature("store gone", ("DistNetworkError",),
              re.compile(r"Failed to recv, got 0 bytes\. Connection was likely closed\. Did the remote server "
                         r"shutdown or crash\?|The client socket has timed out after \d+ms while trying to connect "
                         r"to \([^)]*\)\.|Connection reset by peer|Broken pipe"), _store_gone),
    Signature("disk full", ("DiskFull",),
              re.compile(r"no space left on device writing (?P<path>.+?) \((?P<free>\d+) bytes free on "
                         r"(?P<mount>[^;)]+)"), _disk_full),
    Signature("hub unreachable", ("OSError",),
              re.compile(r"We couldn't connect to '(?P<endpoint>[^']+)' to load the files, and couldn't find them in "
                         r"the cached files"), _hub_unreachable),
    Signature("CUDA-graph trees in threads", ("AssertionError",),
              re.compile(r"cudagraph_trees\.py\", line \d+, in get_obj\n\s*assert torch\._C\._is_key_in_tls\("),
              _cudagraph_trees_tls),
    Signature("chat template: a turn not found", ("ValueError",),
              re.compile(r"^(?P<where>.+?:\d+): the chat template (?P<problem>.+?), so turn (?P<turn>\d+)'s tokens "
                         r"cannot be located", re.MULTILINE), _template_turn),
    Signature("chat template: a conversation refused", ("ValueError",),
              re.compile(r"^(?P<where>.+?:\d+): the chat template refuses this conversation: (?P<why>[^\n]+)",
                         re.MULTILINE), _template_refuses),
    Signature("chat template: refused at start-up", ("ValueError",),
              re.compile(r"^(?P<target>target\.(?:path|tiny) .+?): its (?P<problem>tokenizer has no chat template|"
                         r"chat template cannot be read for the loss mask)", re.MULTILINE), _template_unreadable),
    Signature("chat template: content not rendered", ("ValueError",),
              re.compile(r"^(?P<where>.+?:\d+): the chat template does not render the last message's content",
                         re.MULTILINE), _template_content),
    Signature("no chat template", ("ValueError",),
              re.compile(r"^(?P<where>.+?:\d+): a 'messages' row needs the tokenizer's chat template"
                         r"|Cannot use chat template functions because tokenizer\.chat_template is not set",
                         re.MULTILINE), _no_template),
)
